// The MoE layer's CPU reference with multi-LoRA and the SwiGLU MLP (ops/moe); the routers, the
// dense linear and LoRA on plain linears: ops_route_test.cpp, ops_linear_lora_test.cpp.
//
// The oracles here are written differently from the references on purpose: routing by sorting
// (std::stable_sort), dense double-precision loops over all experts, and LoRA as an explicit
// merged delta W + s B A. The key invariant: applying an adapter at the two MoE seams equals
// running the base layer with s B_e A_e merged into W13[e] / W2[e].
#include <gtest/gtest.h>

#include "unit/ops_ref_oracles.h"

namespace moelora {
namespace {

using namespace ops_ref_test;

// ============================================================================ MoE helpers

struct MoeCase {
  MoeParams params;
  MoeWeightsRef weights;
  int64_t shared_inter = 0;
};

MoeCase make_moe(std::mt19937_64& rng, int64_t hidden, int64_t inter, const RouteParams& route,
                 int64_t shared_inter, bool shared_gate) {
  MoeCase c;
  c.params.hidden = hidden;
  c.params.intermediate = inter;
  c.params.route = route;
  const int64_t e = route.num_experts;
  const float sh = 1.0f / std::sqrt(static_cast<float>(hidden)),
              si = 1.0f / std::sqrt(static_cast<float>(inter));
  c.weights.router = test::random_normal({e, hidden}, rng, 1.5f * sh);
  if (route.kind == RouterKind::kSigmoidNoauxTc)
    c.weights.correction_bias = test::random_normal({e}, rng, 0.05f);
  c.weights.w13 = test::random_normal({e, 2 * inter, hidden}, rng, sh);
  c.weights.w2 = test::random_normal({e, hidden, inter}, rng, si);
  c.shared_inter = shared_inter;
  if (shared_inter > 0) {
    c.weights.shared_w13 = test::random_normal({2 * shared_inter, hidden}, rng, sh);
    c.weights.shared_w2 =
        test::random_normal({hidden, shared_inter}, rng, 1.0f / std::sqrt(float(shared_inter)));
    if (shared_gate) c.weights.shared_gate = test::random_normal({1, hidden}, rng, sh);
  }
  return c;
}

// One slot's adapters for a MoE layer, owning its factors.
struct MoeAdapter {
  LoraFactors gate_up, down, shared_gate, shared_up, shared_down;
  MoeLoraRef ref() const {
    MoeLoraRef r;
    r.gate_up = gate_up.defined() ? &gate_up : nullptr;
    r.down = down.defined() ? &down : nullptr;
    r.shared_gate = shared_gate.defined() ? &shared_gate : nullptr;
    r.shared_up = shared_up.defined() ? &shared_up : nullptr;
    r.shared_down = shared_down.defined() ? &shared_down : nullptr;
    return r;
  }
};

enum class Layout { kPerExpert, kSharedOuter };
void PrintTo(Layout layout, std::ostream* os) {
  *os << (layout == Layout::kPerExpert ? "per-expert" : "shared-outer");
}

MoeAdapter make_adapter(std::mt19937_64& rng, const MoeCase& c, Layout layout, int64_t rank, float scaling,
                        bool with_shared) {
  const int64_t e = c.params.route.num_experts, h = c.params.hidden, i = c.params.intermediate;
  MoeAdapter a;
  // Shared-outer: gate_up A and down B are shared by all experts (Ea = 1 / Eb = 1).
  a.gate_up = random_lora(rng, layout == Layout::kPerExpert ? e : 1, e, rank, h, 2 * i, scaling);
  a.down = random_lora(rng, e, layout == Layout::kPerExpert ? e : 1, rank, i, h, scaling);
  if (with_shared && c.shared_inter > 0) {
    a.shared_gate = random_lora(rng, 1, 1, rank + 1, h, c.shared_inter, scaling);
    a.shared_up = random_lora(rng, 1, 1, rank, h, c.shared_inter, scaling);
    a.shared_down = random_lora(rng, 1, 1, rank + 2, c.shared_inter, h, scaling);
  }
  return a;
}

// The weights with adapter `a` merged in: W13[e] += s B13_e A13_e, W2[e] += s B2_e A2_e, and the
// shared expert's gate / up / down likewise.
MoeWeightsRef merge_adapter(const MoeCase& c, const MoeAdapter& a) {
  MoeWeightsRef m = c.weights;
  const int64_t num_experts = c.params.route.num_experts;
  Tensor w13m = c.weights.w13.clone(), w2m = c.weights.w2.clone();
  for (int64_t e = 0; e < num_experts; ++e) {
    const Tensor m13 = merged(c.weights.w13.select0(e), a.gate_up.defined() ? &a.gate_up : nullptr, e);
    const Tensor m2 = merged(c.weights.w2.select0(e), a.down.defined() ? &a.down : nullptr, e);
    std::memcpy(w13m.data<float>() + e * m13.numel(), m13.data<float>(), m13.nbytes());
    std::memcpy(w2m.data<float>() + e * m2.numel(), m2.data<float>(), m2.nbytes());
  }
  m.w13 = w13m;
  m.w2 = w2m;
  if (c.shared_inter > 0) {
    const int64_t is = c.shared_inter, h = c.params.hidden;
    const Tensor g =
        merged(c.weights.shared_w13.slice0(0, is), a.shared_gate.defined() ? &a.shared_gate : nullptr, 0);
    const Tensor u =
        merged(c.weights.shared_w13.slice0(is, 2 * is), a.shared_up.defined() ? &a.shared_up : nullptr, 0);
    Tensor s13 = Tensor::empty(DType::kF32, {2 * is, h});
    std::memcpy(s13.data<float>(), g.data<float>(), g.nbytes());
    std::memcpy(s13.data<float>() + is * h, u.data<float>(), u.nbytes());
    m.shared_w13 = s13;
    m.shared_w2 = merged(c.weights.shared_w2, a.shared_down.defined() ? &a.shared_down : nullptr, 0);
  }
  return m;
}

// Dense double-precision MoE oracle: full routing per token, then a loop over ALL experts, each
// applied to the tokens that selected it. LoRA is an explicit dense delta per (slot, expert); with
// fp8 the base GEMMs see the FP8 round trips of x and a while the deltas see x and a.
Tensor oracle_moe(const Tensor& x, const std::vector<int32_t>& slot, const MoeCase& c,
                  const std::vector<MoeAdapter>& adapters, bool fp8) {
  const int64_t tokens = x.dim(0), h = c.params.hidden, inter = c.params.intermediate;
  const RouteParams& rp = c.params.route;
  const int64_t num_experts = rp.num_experts;
  const std::vector<double> xd = to_double(x), router = to_double(c.weights.router);
  const std::vector<double> w13 = to_double(c.weights.w13), w2 = to_double(c.weights.w2);
  std::vector<double> bias;
  if (c.weights.correction_bias.defined()) bias = to_double(c.weights.correction_bias);
  std::vector<double> xq = xd;
  if (fp8) xq = to_double(ops::dequant_fp8_per_token_ref(ops::quantize_fp8_per_token_ref(x)));

  std::vector<OracleRoute> routes;
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> logits(num_experts, 0.0);
    for (int64_t e = 0; e < num_experts; ++e)
      for (int64_t k = 0; k < h; ++k) logits[e] += xd[t * h + k] * router[e * h + k];
    routes.push_back(oracle_route(logits, bias, rp));
  }
  std::vector<double> out(tokens * h, 0.0);
  for (int64_t e = 0; e < num_experts; ++e) {
    for (int64_t t = 0; t < tokens; ++t) {
      const auto it = std::find(routes[t].ids.begin(), routes[t].ids.end(), e);
      if (it == routes[t].ids.end()) continue;
      const double weight = routes[t].weights[it - routes[t].ids.begin()];
      const MoeAdapter* a = slot[t] >= 0 ? &adapters[slot[t]] : nullptr;
      std::vector<double> d13, d2;
      if (a && a->gate_up.defined()) d13 = dense_delta(a->gate_up, e);
      if (a && a->down.defined()) d2 = dense_delta(a->down, e);
      std::vector<double> hh(2 * inter, 0.0);
      for (int64_t o = 0; o < 2 * inter; ++o)
        for (int64_t k = 0; k < h; ++k) {
          hh[o] += xq[t * h + k] * w13[(e * 2 * inter + o) * h + k];
          if (!d13.empty()) hh[o] += xd[t * h + k] * d13[o * h + k];
        }
      std::vector<double> act(inter), act_q(inter);
      for (int64_t i = 0; i < inter; ++i) act[i] = silu_d(hh[i]) * hh[inter + i];
      act_q = act;
      if (fp8) {
        std::vector<float> af(act.begin(), act.end());
        act_q = to_double(ops::dequant_fp8_per_token_ref(
            ops::quantize_fp8_per_token_ref(Tensor::from_f32(af, {1, inter}))));
      }
      for (int64_t o = 0; o < h; ++o) {
        double y = 0;
        for (int64_t i = 0; i < inter; ++i) {
          y += act_q[i] * w2[(e * h + o) * inter + i];
          if (!d2.empty()) y += act[i] * d2[o * inter + i];
        }
        out[t * h + o] += weight * y;
      }
    }
  }
  if (c.shared_inter > 0) {
    const int64_t is = c.shared_inter;
    const std::vector<double> s13 = to_double(c.weights.shared_w13), s2 = to_double(c.weights.shared_w2);
    for (int64_t t = 0; t < tokens; ++t) {
      const MoeAdapter* a = slot[t] >= 0 ? &adapters[slot[t]] : nullptr;
      std::vector<double> dg, du, dd;
      if (a && a->shared_gate.defined()) dg = dense_delta(a->shared_gate, 0);
      if (a && a->shared_up.defined()) du = dense_delta(a->shared_up, 0);
      if (a && a->shared_down.defined()) dd = dense_delta(a->shared_down, 0);
      std::vector<double> act(is);
      for (int64_t i = 0; i < is; ++i) {
        double g = 0, u = 0;
        for (int64_t k = 0; k < h; ++k) {
          g += xd[t * h + k] * (s13[i * h + k] + (dg.empty() ? 0.0 : dg[i * h + k]));
          u += xd[t * h + k] * (s13[(is + i) * h + k] + (du.empty() ? 0.0 : du[i * h + k]));
        }
        act[i] = silu_d(g) * u;
      }
      double gate = 1.0;
      if (c.weights.shared_gate.defined()) {
        double z = 0;
        for (int64_t k = 0; k < h; ++k) z += xd[t * h + k] * c.weights.shared_gate.data<float>()[k];
        gate = sigmoid_d(z);
      }
      for (int64_t o = 0; o < h; ++o) {
        double y = 0;
        for (int64_t i = 0; i < is; ++i) y += act[i] * (s2[o * is + i] + (dd.empty() ? 0.0 : dd[o * is + i]));
        out[t * h + o] += gate * y;
      }
    }
  }
  return to_tensor(out, {tokens, h});
}

std::vector<MoeLoraRef> refs(const std::vector<MoeAdapter>& adapters) {
  std::vector<MoeLoraRef> r;
  for (const MoeAdapter& a : adapters) r.push_back(a.ref());
  return r;
}

constexpr float kMoeAtol = 2e-5f, kMoeRtol = 2e-4f;

// ============================================================================ MoE tests

TEST(Moe, BaseMatchesDenseOracleSoftmax) {
  std::mt19937_64 rng(test::test_seed(401));
  const MoeCase c = make_moe(rng, 24, 10, softmax_params(6, 2, true), 0, false);
  const Tensor x = test::random_normal({13, 24}, rng);
  const std::vector<int32_t> slot(13, -1);
  ops::MoeTrace trace;
  const Tensor out = ops::moe_forward_ref(x, slot, c.weights, {}, c.params, &trace);
  EXPECT_TRUE(test::all_close(out, oracle_moe(x, slot, c, {}, false), kMoeAtol, kMoeRtol));
  EXPECT_EQ(trace.logits.shape(), (Shape{13, 6}));
  EXPECT_EQ(trace.route.ids.shape(), (Shape{13, 2}));
  // Without renormalization as well (Qwen3-MoE class default).
  MoeCase c2 = c;
  c2.params.route.renormalize = false;
  EXPECT_TRUE(test::all_close(ops::moe_forward_ref(x, slot, c2.weights, {}, c2.params),
                              oracle_moe(x, slot, c2, {}, false), kMoeAtol, kMoeRtol));
}

TEST(Moe, BaseMatchesDenseOracleNoauxTcWithSharedExpert) {
  std::mt19937_64 rng(test::test_seed(402));
  const MoeCase c = make_moe(rng, 32, 12, noaux_params(16, 4, 4, 2, true, 2.5f), 20, false);
  const Tensor x = test::random_normal({9, 32}, rng);
  const std::vector<int32_t> slot(9, -1);
  const Tensor out = ops::moe_forward_ref(x, slot, c.weights, {}, c.params);
  EXPECT_TRUE(test::all_close(out, oracle_moe(x, slot, c, {}, false), kMoeAtol, kMoeRtol));
}

class MoeLoraLayout : public ::testing::TestWithParam<Layout> {};

TEST_P(MoeLoraLayout, SeamsEqualMergedWeights) {
  std::mt19937_64 rng(test::test_seed(GetParam() == Layout::kPerExpert ? 411 : 412));
  const MoeCase c = make_moe(rng, 24, 10, noaux_params(8, 3, 4, 2, true, 2.5f), 14, true);
  const std::vector<MoeAdapter> adapters = {make_adapter(rng, c, GetParam(), 5, 0.5f, true)};
  const int64_t tokens = 11;
  const Tensor x = test::random_normal({tokens, 24}, rng);
  const std::vector<int32_t> all0(tokens, 0), base(tokens, -1);
  const Tensor with_lora = ops::moe_forward_ref(x, all0, c.weights, refs(adapters), c.params);
  const Tensor merged_out =
      ops::moe_forward_ref(x, base, merge_adapter(c, adapters[0]), refs(adapters), c.params);
  EXPECT_TRUE(test::all_close(with_lora, merged_out, kMoeAtol, kMoeRtol));
  // The adapter changes the output a lot, so the comparison above means something.
  const Tensor base_out = ops::moe_forward_ref(x, base, c.weights, refs(adapters), c.params);
  EXPECT_GT(test::max_abs_diff(with_lora, base_out), 0.05);
  // And the dense oracle agrees.
  EXPECT_TRUE(test::all_close(with_lora, oracle_moe(x, all0, c, adapters, false), kMoeAtol, kMoeRtol));
}

INSTANTIATE_TEST_SUITE_P(Layouts, MoeLoraLayout, ::testing::Values(Layout::kPerExpert, Layout::kSharedOuter),
                         [](const auto& info) {
                           return info.param == Layout::kPerExpert ? std::string("PerExpert")
                                                                   : std::string("SharedOuter");
                         });

TEST(Moe, MixedSlotsAreIndependentBitForBit) {
  std::mt19937_64 rng(test::test_seed(421));
  const MoeCase c = make_moe(rng, 24, 10, softmax_params(8, 3, true), 12, true);
  std::vector<MoeAdapter> adapters;
  adapters.push_back(make_adapter(rng, c, Layout::kPerExpert, 4, 0.7f, true));
  adapters.push_back(make_adapter(rng, c, Layout::kSharedOuter, 6, 1.3f, false));
  adapters.push_back(MoeAdapter{});  // a slot whose adapter does not touch this layer
  MoeAdapter down_only = make_adapter(rng, c, Layout::kPerExpert, 3, 0.9f, false);
  down_only.gate_up = LoraFactors{};
  adapters.push_back(down_only);
  const int64_t tokens = 17;
  const Tensor x = test::random_normal({tokens, 24}, rng);
  std::vector<int32_t> slot(tokens);
  std::uniform_int_distribution<int> pick(-1, 3);
  for (auto& s : slot) s = pick(rng);
  slot[0] = -1;
  slot[1] = 0;
  slot[2] = 1;
  slot[3] = 3;
  const Tensor mixed = ops::moe_forward_ref(x, slot, c.weights, refs(adapters), c.params);
  const Tensor base =
      ops::moe_forward_ref(x, std::vector<int32_t>(tokens, -1), c.weights, refs(adapters), c.params);
  std::vector<Tensor> uniform;
  for (int32_t s = 0; s < 4; ++s)
    uniform.push_back(
        ops::moe_forward_ref(x, std::vector<int32_t>(tokens, s), c.weights, refs(adapters), c.params));
  for (int64_t t = 0; t < tokens; ++t) {
    const Tensor& expect = slot[t] < 0 ? base : uniform[slot[t]];
    EXPECT_TRUE(rows_bitwise_equal(mixed, t, expect, t)) << "token " << t << " slot " << slot[t];
  }
  // The slot without LoRA for this layer equals the base exactly; the others do not.
  for (int64_t t = 0; t < tokens; ++t) EXPECT_TRUE(rows_bitwise_equal(uniform[2], t, base, t)) << t;
  EXPECT_GT(test::max_abs_diff(uniform[0], base), 0.05);
  EXPECT_GT(test::max_abs_diff(uniform[1], base), 0.05);
  EXPECT_GT(test::max_abs_diff(uniform[3], base), 0.01);
  // The mixed batch also matches the dense oracle.
  EXPECT_TRUE(test::all_close(mixed, oracle_moe(x, slot, c, adapters, false), kMoeAtol, kMoeRtol));
}

// moe_expert_outputs_ref over disjoint expert ranges (as expert-parallel ranks hold them, with
// per-expert factors sliced to the range and shared-outer factors whole) adds up to the whole
// layer's expert outputs bit for bit (each row comes from exactly one range; the others add
// zeros), and moe_combine_ref of them with the shared expert is moe_forward_ref exactly.
TEST(Moe, ExpertRangesAddUpToTheWholeLayerBitForBit) {
  std::mt19937_64 rng(test::test_seed(425));
  const MoeCase c = make_moe(rng, 24, 10, softmax_params(8, 3, true), 0, false);
  std::vector<MoeAdapter> adapters;
  adapters.push_back(make_adapter(rng, c, Layout::kPerExpert, 4, 0.7f, false));
  adapters.push_back(make_adapter(rng, c, Layout::kSharedOuter, 6, 1.3f, false));
  const int64_t tokens = 13;
  const Tensor x = test::random_normal({tokens, 24}, rng);
  std::vector<int32_t> slot(tokens);
  for (int64_t t = 0; t < tokens; ++t) slot[t] = static_cast<int32_t>(t % 3) - 1;
  ops::MoeTrace trace;
  const Tensor whole = ops::moe_forward_ref(x, slot, c.weights, refs(adapters), c.params, &trace);

  auto slice = [](const Tensor& t, int64_t begin, int64_t end) {
    return t.dim(0) == 1 ? t : t.slice0(begin, end).clone();
  };
  for (int64_t parts : {1, 2, 4, 8}) {
    const int64_t per = 8 / parts;
    Tensor sum = Tensor::zeros(DType::kF32, {tokens * 3, 24});
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t b = p * per, e = b + per;
      std::vector<MoeAdapter> local(adapters.size());
      for (size_t s = 0; s < adapters.size(); ++s) {
        local[s].gate_up = {slice(adapters[s].gate_up.a, b, e), slice(adapters[s].gate_up.b, b, e),
                            adapters[s].gate_up.scaling};
        local[s].down = {slice(adapters[s].down.a, b, e), slice(adapters[s].down.b, b, e),
                         adapters[s].down.scaling};
      }
      const Tensor y = ops::moe_expert_outputs_ref(x, slot, c.weights.w13.slice0(b, e).clone(),
                                                   c.weights.w2.slice0(b, e).clone(), refs(local),
                                                   c.params, trace.route, b);
      for (int64_t i = 0; i < sum.numel(); ++i) sum.data<float>()[i] += y.data<float>()[i];
    }
    const Tensor out = ops::moe_combine_ref(sum, trace.route.weights);
    for (int64_t t = 0; t < tokens; ++t)
      EXPECT_TRUE(rows_bitwise_equal(out, t, whole, t)) << parts << " ranges, token " << t;
  }
  EXPECT_ERROR_MENTIONS(ops::moe_expert_outputs_ref(x, slot, c.weights.w13, c.weights.w2,
                                                    refs(adapters), c.params, trace.route, 1),
                        "moe experts [1, 9)", "8");
}

TEST(Moe, GateAndUpUseTheirOwnA) {
  // A per-expert adapter with separate gate and up factors (rank r each) in the canonical R = 2r
  // form: A_e = [Ag_e; Au_e], B_e = [[Bg_e, 0], [0, Bu_e]]. The reference merge is written from the
  // separate factors: W_gate[e] += s Bg_e Ag_e, W_up[e] += s Bu_e Au_e. Using the gate's A for the
  // up rows (or any other mix-up) breaks the equality.
  std::mt19937_64 rng(test::test_seed(431));
  const int64_t h = 20, inter = 9, e_count = 5, r = 3;
  const float s = 0.8f;
  const MoeCase c = make_moe(rng, h, inter, softmax_params(e_count, 2, true), 0, false);
  std::vector<LoraFactors> gate(e_count), up(e_count);
  MoeAdapter adapter;
  adapter.gate_up.a = Tensor::zeros(DType::kF32, {e_count, 2 * r, h});
  adapter.gate_up.b = Tensor::zeros(DType::kF32, {e_count, 2 * inter, 2 * r});
  adapter.gate_up.scaling = s;
  for (int64_t e = 0; e < e_count; ++e) {
    gate[e] = random_lora(rng, 1, 1, r, h, inter, s);
    up[e] = random_lora(rng, 1, 1, r, h, inter, s);
    float* a = adapter.gate_up.a.data<float>() + e * 2 * r * h;
    std::memcpy(a, gate[e].a.data<float>(), r * h * sizeof(float));
    std::memcpy(a + r * h, up[e].a.data<float>(), r * h * sizeof(float));
    float* b = adapter.gate_up.b.data<float>() + e * 2 * inter * 2 * r;
    for (int64_t i = 0; i < inter; ++i)
      for (int64_t k = 0; k < r; ++k) {
        b[i * 2 * r + k] = gate[e].b.data<float>()[i * r + k];
        b[(inter + i) * 2 * r + r + k] = up[e].b.data<float>()[i * r + k];
      }
  }
  auto merge_with = [&](bool swap_a_for_up) {
    MoeWeightsRef m = c.weights;
    m.w13 = c.weights.w13.clone();
    for (int64_t e = 0; e < e_count; ++e) {
      LoraFactors up_used = up[e];
      if (swap_a_for_up) up_used.a = gate[e].a;  // the bug: up delta computed with the gate's A
      const Tensor g = merged(c.weights.w13.select0(e).slice0(0, inter), &gate[e], 0);
      const Tensor u = merged(c.weights.w13.select0(e).slice0(inter, 2 * inter), &up_used, 0);
      float* dst = m.w13.data<float>() + e * 2 * inter * h;
      std::memcpy(dst, g.data<float>(), g.nbytes());
      std::memcpy(dst + inter * h, u.data<float>(), u.nbytes());
    }
    return m;
  };
  const int64_t tokens = 12;
  const Tensor x = test::random_normal({tokens, h}, rng);
  const std::vector<int32_t> all0(tokens, 0), base(tokens, -1);
  const std::vector<MoeLoraRef> lora = {adapter.ref()};
  const Tensor out = ops::moe_forward_ref(x, all0, c.weights, lora, c.params);
  EXPECT_TRUE(test::all_close(out, ops::moe_forward_ref(x, base, merge_with(false), lora, c.params), kMoeAtol,
                              kMoeRtol));
  // The wrong merge must be distinguishable, or this test could not catch the bug.
  EXPECT_GT(test::max_abs_diff(out, ops::moe_forward_ref(x, base, merge_with(true), lora, c.params)), 1e-2);
}

TEST(Moe, EdgeCasesIdleExpertsOddSizesSingleAndZeroTokens) {
  std::mt19937_64 rng(test::test_seed(441));
  {  // Many idle experts: 3 tokens, 16 experts, k = 2.
    const MoeCase c = make_moe(rng, 24, 10, noaux_params(16, 2, 4, 2, true, 1.7f), 0, false);
    const std::vector<MoeAdapter> adapters = {make_adapter(rng, c, Layout::kPerExpert, 2, 0.5f, false)};
    const Tensor x = test::random_normal({3, 24}, rng);
    const std::vector<int32_t> slot = {0, -1, 0};
    // At most 6 of the 16 experts receive a pair: at least 10 are idle.
    const Tensor out = ops::moe_forward_ref(x, slot, c.weights, refs(adapters), c.params);
    EXPECT_TRUE(test::all_close(out, oracle_moe(x, slot, c, adapters, false), kMoeAtol, kMoeRtol));
  }
  {  // k = E, odd sizes, one token.
    const MoeCase c = make_moe(rng, 23, 7, softmax_params(5, 5, false), 9, true);
    const std::vector<MoeAdapter> adapters = {make_adapter(rng, c, Layout::kSharedOuter, 3, 1.0f, true)};
    for (int64_t tokens : {1, 6}) {
      const Tensor x = test::random_normal({tokens, 23}, rng);
      std::vector<int32_t> slot(tokens, 0);
      slot[0] = tokens > 1 ? -1 : 0;
      const Tensor out = ops::moe_forward_ref(x, slot, c.weights, refs(adapters), c.params);
      EXPECT_TRUE(test::all_close(out, oracle_moe(x, slot, c, adapters, false), kMoeAtol, kMoeRtol))
          << tokens;
    }
    // Zero tokens: an empty [0, H] output.
    ops::MoeTrace trace;
    const Tensor empty = ops::moe_forward_ref(Tensor::zeros(DType::kF32, {0, 23}), {}, c.weights,
                                              refs(adapters), c.params, &trace);
    EXPECT_EQ(empty.shape(), (Shape{0, 23}));
    EXPECT_EQ(trace.route.ids.shape(), (Shape{0, 5}));
  }
}

TEST(Moe, SharedExpertWithSigmoidGate) {
  std::mt19937_64 rng(test::test_seed(451));
  const MoeCase gated = make_moe(rng, 24, 10, softmax_params(6, 2, true), 16, true);
  std::vector<MoeAdapter> adapters = {make_adapter(rng, gated, Layout::kPerExpert, 4, 0.6f, true)};
  const int64_t tokens = 8;
  const Tensor x = test::random_normal({tokens, 24}, rng);
  std::vector<int32_t> slot = {-1, 0, 0, -1, 0, -1, -1, 0};
  const Tensor out = ops::moe_forward_ref(x, slot, gated.weights, refs(adapters), gated.params);
  EXPECT_TRUE(test::all_close(out, oracle_moe(x, slot, gated, adapters, false), kMoeAtol, kMoeRtol));
  // The gate scales exactly the shared part: out(gated) - out(no shared) = sigmoid(x Wsg^T) *
  // (out(ungated) - out(no shared)).
  MoeCase ungated = gated;
  ungated.weights.shared_gate = Tensor();
  MoeCase routed_only = gated;
  routed_only.weights.shared_w13 = routed_only.weights.shared_w2 = routed_only.weights.shared_gate = Tensor();
  std::vector<MoeAdapter> routed_adapters = adapters;
  routed_adapters[0].shared_gate = routed_adapters[0].shared_up = routed_adapters[0].shared_down =
      LoraFactors{};
  const Tensor full = ops::moe_forward_ref(x, slot, ungated.weights, refs(adapters), ungated.params);
  const Tensor routed =
      ops::moe_forward_ref(x, slot, routed_only.weights, refs(routed_adapters), routed_only.params);
  for (int64_t t = 0; t < tokens; ++t) {
    double z = 0;
    for (int64_t k = 0; k < 24; ++k)
      z += double(x.data<float>()[t * 24 + k]) * gated.weights.shared_gate.data<float>()[k];
    for (int64_t o = 0; o < 24; ++o) {
      const int64_t i = t * 24 + o;
      EXPECT_NEAR(out.data<float>()[i] - routed.data<float>()[i],
                  sigmoid_d(z) * (full.data<float>()[i] - routed.data<float>()[i]), 1e-5)
          << "token " << t << " column " << o;
    }
  }
}

TEST(Moe, Fp8ActivationEmulationMatchesOracle) {
  std::mt19937_64 rng(test::test_seed(461));
  // H = 300 and I = 140: three and two 128-column groups, each with a partial last group.
  MoeCase c = make_moe(rng, 300, 140, softmax_params(6, 2, true), 0, false);
  c.params.fp8_activations = true;
  const std::vector<MoeAdapter> adapters = {make_adapter(rng, c, Layout::kPerExpert, 4, 0.5f, false)};
  const int64_t tokens = 5;
  Tensor x = test::random_normal({tokens, 300}, rng);
  const std::vector<int32_t> slot = {0, -1, 0, 0, -1};
  const Tensor out = ops::moe_forward_ref(x, slot, c.weights, refs(adapters), c.params);
  EXPECT_TRUE(test::all_close(out, oracle_moe(x, slot, c, adapters, true), kMoeAtol, kMoeRtol));
  // The emulation is not a no-op.
  MoeCase exact = c;
  exact.params.fp8_activations = false;
  const Tensor out_exact = ops::moe_forward_ref(x, slot, exact.weights, refs(adapters), exact.params);
  EXPECT_GT(test::max_abs_diff(out, out_exact), 1e-4);
  // Feeding dequant(quant(x)) to the non-emulated layer is a different computation: the router and
  // the LoRA seams would see quantized x too. With router logits pinned and no LoRA, GEMM1 inputs
  // agree, so the only remaining difference is GEMM2's quantization of a.
  const Tensor xq = ops::dequant_fp8_per_token_ref(ops::quantize_fp8_per_token_ref(x));
  const Tensor logits = ops::linear_ref(x, c.weights.router);
  const std::vector<int32_t> base(tokens, -1);
  const Tensor emulated = ops::moe_forward_ref(x, base, c.weights, {}, c.params, nullptr, logits);
  const Tensor manual = ops::moe_forward_ref(xq, base, exact.weights, {}, exact.params, nullptr, logits);
  EXPECT_TRUE(test::all_close(emulated, manual, 0.05f, 0.05f));  // only a's e4m3 rounding differs
  EXPECT_TRUE(test::all_close(emulated, oracle_moe(x, base, c, {}, true), kMoeAtol, kMoeRtol));
}

TEST(Moe, RouterLogitsOverrideAndTrace) {
  std::mt19937_64 rng(test::test_seed(471));
  MoeCase c = make_moe(rng, 16, 8, softmax_params(6, 2, true), 0, false);
  const int64_t tokens = 4;
  const Tensor x = test::random_normal({tokens, 16}, rng);
  const Tensor logits = test::random_normal({tokens, 6}, rng, 2.0f);
  MoeWeightsRef no_router = c.weights;
  no_router.router = Tensor();
  ops::MoeTrace trace;
  const std::vector<int32_t> base(tokens, -1);
  const Tensor out = ops::moe_forward_ref(x, base, no_router, {}, c.params, &trace, logits);
  EXPECT_EQ(trace.logits.data<float>(), logits.data<float>());
  const ops::RouteResult expect = ops::route_ref(logits, Tensor(), c.params.route);
  for (int64_t t = 0; t < tokens; ++t) EXPECT_EQ(ids_row(trace.route, t), ids_row(expect, t));
  // The output follows the given routing: recompute it per token in double from the expected ids
  // and weights.
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> acc(16, 0.0);
    for (int64_t j = 0; j < 2; ++j) {
      const int32_t e = expect.ids.data<int32_t>()[t * 2 + j];
      const double w = expect.weights.data<float>()[t * 2 + j];
      std::vector<double> hh(16, 0.0);
      for (int64_t o = 0; o < 16; ++o)
        for (int64_t k = 0; k < 16; ++k)
          hh[o] += double(x.data<float>()[t * 16 + k]) * c.weights.w13.data<float>()[(e * 16 + o) * 16 + k];
      for (int64_t o = 0; o < 16; ++o) {
        double y = 0;
        for (int64_t i = 0; i < 8; ++i)
          y += silu_d(hh[i]) * hh[8 + i] * c.weights.w2.data<float>()[(e * 16 + o) * 8 + i];
        acc[o] += w * y;
      }
    }
    for (int64_t o = 0; o < 16; ++o)
      EXPECT_NEAR(out.data<float>()[t * 16 + o], acc[o], 1e-5) << t << "," << o;
  }
  // Without logits the router is required.
  EXPECT_ERROR_MENTIONS(ops::moe_forward_ref(x, base, no_router, {}, c.params), "router weight");
}

TEST(Moe, ValidationNamesTensorAndShapes) {
  std::mt19937_64 rng(test::test_seed(481));
  const MoeCase c = make_moe(rng, 16, 8, softmax_params(6, 2, true), 0, false);
  const Tensor x = test::random_normal({3, 16}, rng);
  const std::vector<int32_t> base(3, -1);
  MoeWeightsRef w = c.weights;
  w.w13 = Tensor::zeros(DType::kF32, {6, 15, 16});
  EXPECT_ERROR_MENTIONS(ops::moe_forward_ref(x, base, w, {}, c.params), "moe w13", "[6, 16, 16]",
                        "[6, 15, 16]");
  w = c.weights;
  w.w2 = Tensor::zeros(DType::kF32, {6, 8, 16});
  EXPECT_ERROR_MENTIONS(ops::moe_forward_ref(x, base, w, {}, c.params), "moe w2", "[6, 16, 8]", "[6, 8, 16]");
  EXPECT_ERROR_MENTIONS(
      ops::moe_forward_ref(test::random_normal({3, 15}, rng), base, c.weights, {}, c.params), "moe input x",
      "[3, 15]");
  EXPECT_ERROR_MENTIONS(ops::moe_forward_ref(x, {-1, -1}, c.weights, {}, c.params), "2 entries", "3 tokens");
  EXPECT_ERROR_MENTIONS(ops::moe_forward_ref(x, {-1, 1, -1}, c.weights, {MoeLoraRef{}}, c.params), "token 1",
                        "is 1");
  MoeAdapter a = make_adapter(rng, c, Layout::kPerExpert, 2, 1.0f, false);
  a.gate_up.a = test::random_normal({3, 2, 16}, rng);  // Ea = 3, neither 1 nor E = 6
  EXPECT_ERROR_MENTIONS(ops::moe_forward_ref(x, {0, 0, 0}, c.weights, {a.ref()}, c.params), "slot 0 gate_up",
                        "lora A", "[3, 2, 16]");
  a = make_adapter(rng, c, Layout::kPerExpert, 2, 1.0f, false);
  a.down.b = test::random_normal({6, 15, 2}, rng);
  EXPECT_ERROR_MENTIONS(ops::moe_forward_ref(x, {0, 0, 0}, c.weights, {a.ref()}, c.params), "slot 0 down",
                        "lora B", "[6, 15, 2]");
  a = make_adapter(rng, c, Layout::kPerExpert, 2, 1.0f, false);
  a.shared_up = random_lora(rng, 1, 1, 2, 16, 4, 1.0f);
  EXPECT_ERROR_MENTIONS(ops::moe_forward_ref(x, {0, 0, 0}, c.weights, {a.ref()}, c.params), "shared expert");
  {  // A shared-expert LoRA of the wrong width is named by its target.
    const MoeCase cs = make_moe(rng, 16, 8, softmax_params(6, 2, true), 5, false);
    MoeAdapter as = make_adapter(rng, cs, Layout::kPerExpert, 2, 1.0f, true);
    as.shared_down = random_lora(rng, 1, 1, 2, 6, 16, 1.0f);  // in = 6, Is = 5
    EXPECT_ERROR_MENTIONS(ops::moe_forward_ref(x, {0, 0, 0}, cs.weights, {as.ref()}, cs.params),
                          "slot 0 shared_down", "[1, R, 5]", "[1, 2, 6]");
  }
  MoeParams bad = c.params;
  bad.route.top_k = 7;
  EXPECT_ERROR_MENTIONS(ops::moe_forward_ref(x, base, c.weights, {}, bad), "top_k 7");
}

TEST(Mlp, MatchesMergedWeightsPerSlot) {
  std::mt19937_64 rng(test::test_seed(491));
  const int64_t h = 24, inter = 17, tokens = 9;
  const Tensor wg = test::random_normal({inter, h}, rng, 0.2f);
  const Tensor wu = test::random_normal({inter, h}, rng, 0.2f);
  const Tensor wd = test::random_normal({h, inter}, rng, 0.25f);
  const LoraFactors g0 = random_lora(rng, 1, 1, 3, h, inter, 0.5f),
                    d0 = random_lora(rng, 1, 1, 2, inter, h, 0.5f);
  const LoraFactors u1 = random_lora(rng, 1, 1, 5, h, inter, 2.0f);
  const std::vector<ops::MlpLoraRef> lora = {{&g0, nullptr, &d0}, {nullptr, &u1, nullptr}, {}};
  const std::vector<int32_t> slot = {0, 1, -1, 2, 0, 1, 1, -1, 0};
  const Tensor x = test::random_normal({tokens, h}, rng);
  const Tensor out = ops::mlp_forward_ref(x, slot, wg, wu, wd, lora);
  const std::vector<int32_t> base_slots(tokens, -1);
  const Tensor base = ops::mlp_forward_ref(x, base_slots, wg, wu, wd, lora);
  const Tensor m0 = ops::mlp_forward_ref(x, base_slots, merged(wg, &g0, 0), wu, merged(wd, &d0, 0), lora);
  const Tensor m1 = ops::mlp_forward_ref(x, base_slots, wg, merged(wu, &u1, 0), wd, lora);
  for (int64_t t = 0; t < tokens; ++t) {
    if (slot[t] < 0 || slot[t] == 2) {
      EXPECT_TRUE(rows_bitwise_equal(out, t, base, t)) << t;
      continue;
    }
    const Tensor& ref = slot[t] == 0 ? m0 : m1;
    for (int64_t o = 0; o < h; ++o)
      EXPECT_NEAR(out.data<float>()[t * h + o], ref.data<float>()[t * h + o], 2e-5) << t;
    EXPECT_FALSE(rows_bitwise_equal(out, t, base, t)) << t;
  }
  EXPECT_ERROR_MENTIONS(ops::mlp_forward_ref(x, slot, wg, wu, test::random_normal({h, inter + 1}, rng), lora),
                        "mlp down weight", "[24, 17]", "[24, 18]");
}

}  // namespace
}  // namespace moelora
