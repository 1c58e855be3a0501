// CPU reference of the MoE layer with multi-LoRA (see moe.h and DESIGN.md §3).
//
// The (token, j) pairs are grouped by expert and cut into blocks of up to kPairBlock pairs; one
// block is one work item: gather the block's inputs, GEMM1 against W13[e], seam 1 per pair (from
// fp32 x), SwiGLU, GEMM2 against W2[e], seam 2 per pair (from the unquantized activation). The
// expert outputs land in y [T * k, H] at row t * k + j, and a final pass adds
// out[t] = sum_j w[t, j] * y[t * k + j] in j order, plus the shared expert.
//
// Every value of a pair depends only on that pair's token, slot and expert (each GEMM element is
// one dot_f32), so the result is bit-identical for any blocking, thread count or batch mix: a
// token of slot -1 gets exactly the base model's output, whatever else is in the batch.
#include "ops/moe/moe.h"

#include <algorithm>
#include <string>

#include "core/threads.h"
#include "ops/linear/linear.h"
#include "ops/lora/lora.h"
#include "ops/quant/quant.h"

namespace moelora::ops {

namespace {

constexpr int64_t kPairBlock = 8;
constexpr int kFp8ActivationGroup = 128;
constexpr int64_t kMinMacsPerThread = int64_t{1} << 18;

// One slot's LoRA of one expert target, resolved to raw pointers. rank == 0 or a == nullptr: none.
struct ExpertLora {
  const float* a = nullptr;  // [Ea, R, in]
  const float* b = nullptr;  // [Eb, out, R]
  int64_t rank = 0, in = 0, out = 0;
  bool shared_a = false, shared_b = false;
  float scaling = 0.0f;

  bool active() const { return a != nullptr && rank > 0; }
  const float* a_of(int64_t e) const { return a + (shared_a ? 0 : e) * rank * in; }
  const float* b_of(int64_t e) const { return b + (shared_b ? 0 : e) * out * rank; }

  // y[0, out) += scaling * (x[0, in) A_e^T) B_e^T; u: scratch of `rank` floats.
  void add(int64_t e, const float* x, float* y, std::vector<float>& u) const {
    const float* ae = a_of(e);
    const float* be = b_of(e);
    u.resize(rank);
    for (int64_t r = 0; r < rank; ++r) u[r] = dot_f32(x, ae + r * in, in);
    for (int64_t o = 0; o < out; ++o) y[o] += scaling * dot_f32(u.data(), be + o * rank, rank);
  }
};

// Validates an expert LoRA target: A [Ea, R, in], B [Eb, out, R] with Ea, Eb in {1, E}
// (num_experts = 1 for the plain targets of the shared expert).
ExpertLora resolve_expert_lora(const LoraFactors* f, int64_t num_experts, int64_t in, int64_t out,
                               const std::string& what) {
  ExpertLora lora;
  if (f == nullptr || !f->defined()) return lora;
  const auto bad = ErrorCode::kInvalidArgument;
  const std::string lead = num_experts == 1 ? "1" : "1 or " + std::to_string(num_experts);
  MOELORA_CHECK(f->b.defined(), bad, what, ": lora A is set but lora B is undefined");
  check_dtype(f->a, DType::kF32, what + " lora A");
  check_dtype(f->b, DType::kF32, what + " lora B");
  MOELORA_CHECK(f->a.ndim() == 3, bad, what, " lora A: expected [Ea, R, ", in, "], got ",
                shape_str(f->a.shape()));
  MOELORA_CHECK(f->b.ndim() == 3, bad, what, " lora B: expected [Eb, ", out, ", R], got ",
                shape_str(f->b.shape()));
  const int64_t ea = f->a.dim(0), rank = f->a.dim(1), eb = f->b.dim(0);
  MOELORA_CHECK((ea == 1 || ea == num_experts) && f->a.dim(2) == in, bad, what, " lora A: expected [", lead,
                ", R, ", in, "], got ", shape_str(f->a.shape()));
  MOELORA_CHECK((eb == 1 || eb == num_experts) && f->b.dim(1) == out && f->b.dim(2) == rank, bad, what,
                " lora B: expected [", lead, ", ", out, ", ", rank, "], got ", shape_str(f->b.shape()));
  lora.a = f->a.data<float>();
  lora.b = f->b.data<float>();
  lora.rank = rank;
  lora.in = in;
  lora.out = out;
  lora.shared_a = ea == 1;
  lora.shared_b = eb == 1;
  lora.scaling = f->scaling;
  return lora;
}

void check_weight(const Tensor& t, const Shape& expected, const char* what) {
  MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, what, " is undefined; expected F32 ",
                shape_str(expected));
  check_dtype(t, DType::kF32, what);
  check_shape(t, expected, what);
}

// One work item: up to kPairBlock pairs of the same expert.
struct PairBlock {
  int64_t expert;
  int64_t begin, end;  // range in the expert-sorted pair list
};

}  // namespace

Tensor moe_expert_outputs_ref(const Tensor& x, const std::vector<int32_t>& slot, const Tensor& w13,
                              const Tensor& w2, const std::vector<MoeLoraRef>& slots,
                              const MoeParams& params, const RouteResult& route,
                              int64_t expert_offset) {
  const auto bad = ErrorCode::kInvalidArgument;
  const int64_t hidden = params.hidden, inter = params.intermediate;
  const int64_t num_experts = params.route.num_experts, top_k = params.route.top_k;
  detail::check_f32(x, 2, "moe input x");
  MOELORA_CHECK(x.dim(1) == hidden, bad, "moe input x: expected [T, ", hidden, "], got ",
                shape_str(x.shape()));
  const int64_t tokens = x.dim(0);
  MOELORA_CHECK(w13.defined() && w13.ndim() == 3, bad, "moe w13: expected [E_local, ", 2 * inter,
                ", ", hidden, "], got ", w13.defined() ? shape_str(w13.shape()) : "undefined");
  const int64_t local_experts = w13.dim(0);
  MOELORA_CHECK(expert_offset >= 0 && local_experts >= 1 &&
                    expert_offset + local_experts <= num_experts,
                ErrorCode::kOutOfRange, "moe experts [", expert_offset, ", ",
                expert_offset + local_experts, ") are not within the layer's ", num_experts);
  check_weight(w13, {local_experts, 2 * inter, hidden}, "moe w13");
  check_weight(w2, {local_experts, hidden, inter}, "moe w2");
  MOELORA_CHECK(static_cast<int64_t>(slot.size()) == tokens, bad, "moe slot map has ", slot.size(),
                " entries for ", tokens, " tokens");
  check_shape(route.ids, {tokens, top_k}, "moe route ids");
  const int64_t num_slots = static_cast<int64_t>(slots.size());
  for (int64_t t = 0; t < tokens; ++t) {
    MOELORA_CHECK(slot[t] >= -1 && slot[t] < num_slots, ErrorCode::kOutOfRange, "moe slot of token ", t,
                  " is ", slot[t], "; valid: -1 (base) or [0, ", num_slots, ")");
  }
  std::vector<ExpertLora> gate_up(num_slots), down(num_slots);
  for (int64_t s = 0; s < num_slots; ++s) {
    const std::string what = "moe lora of slot " + std::to_string(s);
    gate_up[s] = resolve_expert_lora(slots[s].gate_up, local_experts, hidden, 2 * inter, what + " gate_up");
    down[s] = resolve_expert_lora(slots[s].down, local_experts, inter, hidden, what + " down");
  }
  const int32_t* ids = route.ids.data<int32_t>();
  const float* xp = x.data<float>();
  Tensor x_fp8;  // what an FP8 GEMM1 sees: dequant(quant(x)), per token per 128 columns
  const float* gemm1_in = xp;
  if (params.fp8_activations && tokens > 0) {
    x_fp8 = Tensor::empty(DType::kF32, {tokens, hidden});
    float* q = x_fp8.data<float>();
    parallel_for(tokens, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t)
        fp8_round_trip_row_ref(xp + t * hidden, hidden, kFp8ActivationGroup, q + t * hidden);
    });
    gemm1_in = q;
  }

  // Pairs p = t * k + j of the local experts grouped by local expert (increasing token inside an
  // expert), cut into blocks. Pairs of other experts keep zero rows.
  const int64_t num_pairs = tokens * top_k;
  auto local = [&](int64_t p) { return static_cast<int64_t>(ids[p]) - expert_offset; };
  auto is_local = [&](int64_t p) { return local(p) >= 0 && local(p) < local_experts; };
  std::vector<int64_t> expert_begin(local_experts + 1, 0);
  for (int64_t p = 0; p < num_pairs; ++p)
    if (is_local(p)) ++expert_begin[local(p) + 1];
  for (int64_t e = 0; e < local_experts; ++e) expert_begin[e + 1] += expert_begin[e];
  std::vector<int64_t> sorted_pairs(expert_begin[local_experts]);
  {
    std::vector<int64_t> fill(expert_begin.begin(), expert_begin.end() - 1);
    for (int64_t p = 0; p < num_pairs; ++p)
      if (is_local(p)) sorted_pairs[fill[local(p)]++] = p;
  }
  std::vector<PairBlock> blocks;
  for (int64_t e = 0; e < local_experts; ++e) {
    for (int64_t b = expert_begin[e]; b < expert_begin[e + 1]; b += kPairBlock) {
      blocks.push_back({e, b, std::min(b + kPairBlock, expert_begin[e + 1])});
    }
  }

  Tensor expert_out = Tensor::zeros(DType::kF32, {num_pairs, hidden});  // y [T * k, H]
  float* yp = expert_out.data<float>();
  const float* w13p = w13.data<float>();
  const float* w2p = w2.data<float>();
  const int64_t macs_per_block = std::max<int64_t>(1, kPairBlock * 3 * hidden * inter);
  parallel_for(
      static_cast<int64_t>(blocks.size()),
      [&](int64_t begin, int64_t end) {
        std::vector<float> in(kPairBlock * hidden), h(kPairBlock * 2 * inter), act(kPairBlock * inter),
            act_q(kPairBlock * inter), y(kPairBlock * hidden), scratch;
        for (int64_t item = begin; item < end; ++item) {
          const PairBlock& blk = blocks[item];
          const int64_t e = blk.expert, rows = blk.end - blk.begin;
          const int64_t* pairs = sorted_pairs.data() + blk.begin;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = pairs[r] / top_k;
            std::copy_n(gemm1_in + t * hidden, hidden, in.data() + r * hidden);
          }
          // GEMM1: h [rows, 2I] = in W13[e]^T, then seam 1 from the fp32 input.
          detail::linear_rows_f32(in.data(), rows, hidden, hidden, w13p + e * 2 * inter * hidden, 2 * inter,
                                  h.data(), 2 * inter, /*accumulate=*/false);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = pairs[r] / top_k;
            if (slot[t] >= 0 && gate_up[slot[t]].active())
              gate_up[slot[t]].add(e, xp + t * hidden, h.data() + r * 2 * inter, scratch);
          }
          // SwiGLU: a = silu(h[:, :I]) * h[:, I:].
          for (int64_t r = 0; r < rows; ++r) {
            const float* hr = h.data() + r * 2 * inter;
            for (int64_t i = 0; i < inter; ++i) act[r * inter + i] = silu_f32(hr[i]) * hr[inter + i];
          }
          const float* gemm2_in = act.data();
          if (params.fp8_activations) {
            for (int64_t r = 0; r < rows; ++r)
              fp8_round_trip_row_ref(act.data() + r * inter, inter, kFp8ActivationGroup,
                                     act_q.data() + r * inter);
            gemm2_in = act_q.data();
          }
          // GEMM2: y [rows, H] = a W2[e]^T, then seam 2 from the unquantized activation.
          detail::linear_rows_f32(gemm2_in, rows, inter, inter, w2p + e * hidden * inter, hidden, y.data(),
                                  hidden,
                                  /*accumulate=*/false);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t t = pairs[r] / top_k;
            if (slot[t] >= 0 && down[slot[t]].active())
              down[slot[t]].add(e, act.data() + r * inter, y.data() + r * hidden, scratch);
            std::copy_n(y.data() + r * hidden, hidden, yp + pairs[r] * hidden);
          }
        }
      },
      std::max<int64_t>(1, kMinMacsPerThread / macs_per_block));

  return expert_out;
}

Tensor moe_combine_ref(const Tensor& expert_out, const Tensor& route_weights, const Tensor& shared) {
  const auto bad = ErrorCode::kInvalidArgument;
  detail::check_f32(route_weights, 2, "moe route weights");
  const int64_t tokens = route_weights.dim(0), top_k = route_weights.dim(1);
  detail::check_f32(expert_out, 2, "moe expert outputs");
  MOELORA_CHECK(expert_out.dim(0) == tokens * top_k, bad, "moe expert outputs: expected [",
                tokens * top_k, ", H] for ", tokens, " tokens x top-", top_k, ", got ",
                shape_str(expert_out.shape()));
  const int64_t hidden = expert_out.dim(1);
  if (shared.defined()) check_weight(shared, {tokens, hidden}, "moe shared expert output");
  const float* yp = expert_out.data<float>();
  const float* route_w = route_weights.data<float>();
  Tensor out = Tensor::empty(DType::kF32, {tokens, hidden});
  float* op = out.data<float>();
  const float* sp = shared.defined() ? shared.data<float>() : nullptr;
  parallel_for(
      tokens,
      [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          float* ot = op + t * hidden;
          std::fill_n(ot, hidden, 0.0f);
          for (int64_t j = 0; j < top_k; ++j) {
            const float w = route_w[t * top_k + j];
            const float* yr = yp + (t * top_k + j) * hidden;
            for (int64_t c = 0; c < hidden; ++c) ot[c] += w * yr[c];
          }
          if (sp != nullptr) {
            for (int64_t c = 0; c < hidden; ++c) ot[c] += sp[t * hidden + c];
          }
        }
      },
      std::max<int64_t>(1, 65536 / std::max<int64_t>(1, hidden * top_k)));
  return out;
}

Tensor moe_forward_ref(const Tensor& x, const std::vector<int32_t>& slot, const MoeWeightsRef& weights,
                       const std::vector<MoeLoraRef>& slots, const MoeParams& params, MoeTrace* trace,
                       const Tensor& router_logits, const Tensor& forced_ids) {
  const auto bad = ErrorCode::kInvalidArgument;
  check_route_params(params.route);
  const int64_t hidden = params.hidden, inter = params.intermediate;
  const int64_t num_experts = params.route.num_experts;
  MOELORA_CHECK(hidden > 0 && inter > 0, bad, "moe params: hidden ", hidden, " and intermediate ", inter,
                " must be positive");
  MOELORA_CHECK(x.defined() && x.ndim() == 2 && x.dim(1) == hidden, bad, "moe input x: expected [T, ", hidden,
                "], got ", x.defined() ? shape_str(x.shape()) : std::string("undefined"));
  check_dtype(x, DType::kF32, "moe input x");
  const int64_t tokens = x.dim(0);

  // ---- weights ----
  check_weight(weights.w13, {num_experts, 2 * inter, hidden}, "moe w13");
  check_weight(weights.w2, {num_experts, hidden, inter}, "moe w2");
  if (!router_logits.defined() || weights.router.defined()) {
    check_weight(weights.router, {num_experts, hidden}, "moe router weight");
  }
  const bool has_shared = weights.shared_w13.defined();
  int64_t shared_inter = 0;
  if (has_shared) {
    MOELORA_CHECK(weights.shared_w13.ndim() == 2 && weights.shared_w13.dim(0) % 2 == 0, bad,
                  "moe shared_w13: expected [2 * Is, ", hidden, "], got ",
                  shape_str(weights.shared_w13.shape()));
    shared_inter = weights.shared_w13.dim(0) / 2;
    check_weight(weights.shared_w13, {2 * shared_inter, hidden}, "moe shared_w13");
    check_weight(weights.shared_w2, {hidden, shared_inter}, "moe shared_w2");
    if (weights.shared_gate.defined()) check_weight(weights.shared_gate, {1, hidden}, "moe shared_gate");
  } else {
    MOELORA_CHECK(!weights.shared_w2.defined() && !weights.shared_gate.defined(), bad,
                  "moe shared_w2 / shared_gate are set but shared_w13 is undefined");
  }

  // ---- slots and LoRA ----
  MOELORA_CHECK(static_cast<int64_t>(slot.size()) == tokens, bad, "moe slot map has ", slot.size(),
                " entries for ", tokens, " tokens");
  const int64_t num_slots = static_cast<int64_t>(slots.size());
  for (int64_t t = 0; t < tokens; ++t) {
    MOELORA_CHECK(slot[t] >= -1 && slot[t] < num_slots, ErrorCode::kOutOfRange, "moe slot of token ", t,
                  " is ", slot[t], "; valid: -1 (base) or [0, ", num_slots, ")");
  }
  std::vector<MlpLoraRef> shared_lora(num_slots);
  for (int64_t s = 0; s < num_slots; ++s) {
    const std::string what = "moe lora of slot " + std::to_string(s);
    shared_lora[s] = {slots[s].shared_gate, slots[s].shared_up, slots[s].shared_down};
    const bool any_shared = (slots[s].shared_gate && slots[s].shared_gate->defined()) ||
                            (slots[s].shared_up && slots[s].shared_up->defined()) ||
                            (slots[s].shared_down && slots[s].shared_down->defined());
    MOELORA_CHECK(has_shared || !any_shared, bad, what, " targets the shared expert, which this layer lacks");
    if (has_shared) {  // shape checks with the target's name; mlp_forward_ref applies them
      resolve_expert_lora(slots[s].shared_gate, 1, hidden, shared_inter, what + " shared_gate");
      resolve_expert_lora(slots[s].shared_up, 1, hidden, shared_inter, what + " shared_up");
      resolve_expert_lora(slots[s].shared_down, 1, shared_inter, hidden, what + " shared_down");
    }
  }

  // ---- 1. route ----
  Tensor logits;
  if (router_logits.defined()) {
    check_weight(router_logits, {tokens, num_experts}, "moe router_logits");
    logits = router_logits;
  } else {
    logits = linear_ref(x, weights.router);
  }
  RouteResult route = route_ref(logits, weights.correction_bias, params.route, forced_ids);

  // ---- 2. routed experts: y [T * k, H] ----
  const Tensor expert_out =
      moe_expert_outputs_ref(x, slot, weights.w13, weights.w2, slots, params, route, 0);
  const float* xp = x.data<float>();

  // ---- 3. shared expert ----
  Tensor shared;
  if (has_shared) {
    shared = mlp_forward_ref(x, slot, weights.shared_w13.slice0(0, shared_inter),
                             weights.shared_w13.slice0(shared_inter, 2 * shared_inter),
                             weights.shared_w2, shared_lora, params.shared_fp8_activations);
    if (weights.shared_gate.defined()) {
      const float* gate = weights.shared_gate.data<float>();
      float* sp = shared.data<float>();
      for (int64_t t = 0; t < tokens; ++t) {
        const float g = sigmoid_f32(dot_f32(xp + t * hidden, gate, hidden));
        for (int64_t c = 0; c < hidden; ++c) sp[t * hidden + c] = g * sp[t * hidden + c];
      }
    }
  }

  // ---- 4. finalize: out[t] = sum_j w[t, j] y[t * k + j] (+ shared[t]) ----
  Tensor out = moe_combine_ref(expert_out, route.weights, shared);

  if (trace != nullptr) {
    trace->logits = logits;
    trace->route = route;
  }
  return out;
}

namespace {

// dequant(quant(t)) of an F32 [rows, cols] tensor, per row per kFp8ActivationGroup columns.
Tensor fp8_round_trip_rows(const Tensor& t) {
  Tensor out = Tensor::empty(DType::kF32, t.shape());
  const int64_t rows = t.dim(0), cols = t.dim(1);
  for (int64_t r = 0; r < rows; ++r)
    fp8_round_trip_row_ref(t.data<float>() + r * cols, cols, kFp8ActivationGroup,
                           out.data<float>() + r * cols);
  return out;
}

}  // namespace

Tensor mlp_forward_ref(const Tensor& x, const std::vector<int32_t>& slot, const Tensor& w_gate,
                       const Tensor& w_up, const Tensor& w_down,
                       const std::vector<MlpLoraRef>& lora, bool fp8_activations) {
  const auto bad = ErrorCode::kInvalidArgument;
  detail::check_f32(x, 2, "mlp input x");
  detail::check_f32(w_gate, 2, "mlp gate weight");
  const int64_t tokens = x.dim(0), hidden = x.dim(1), inter = w_gate.dim(0);
  check_weight(w_gate, {inter, hidden}, "mlp gate weight");
  check_weight(w_up, {inter, hidden}, "mlp up weight");
  check_weight(w_down, {hidden, inter}, "mlp down weight");
  MOELORA_CHECK(static_cast<int64_t>(slot.size()) == tokens, bad, "mlp slot map has ", slot.size(),
                " entries for ", tokens, " tokens");
  std::vector<const LoraFactors*> gate(lora.size()), up(lora.size()), down(lora.size());
  for (size_t s = 0; s < lora.size(); ++s) {
    gate[s] = lora[s].gate;
    up[s] = lora[s].up;
    down[s] = lora[s].down;
  }
  const Tensor x_gemm = fp8_activations ? fp8_round_trip_rows(x) : x;
  Tensor g = linear_ref(x_gemm, w_gate);
  Tensor u = linear_ref(x_gemm, w_up);
  lora_add_slots_ref(x, slot, gate, g);
  lora_add_slots_ref(x, slot, up, u);
  Tensor a = silu_mul_ref(g, u);
  Tensor out = linear_ref(fp8_activations ? fp8_round_trip_rows(a) : a, w_down);
  lora_add_slots_ref(a, slot, down, out);
  return out;
}

}  // namespace moelora::ops
