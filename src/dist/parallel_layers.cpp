// Tensor-parallel MLP and expert-parallel MoE on the CPU reference operators (parallel_layers.h).
#include "dist/parallel_layers.h"

#include <string>

#include "core/error.h"
#include "ops/linear/linear.h"
#include "ops/route/route.h"

namespace moelora::dist {

namespace {

LoraFactors copy_or_empty(const LoraFactors* f) {
  return f != nullptr && f->defined() ? *f : LoraFactors{};
}

// Multiplies row t of `shared` [T, H] by sigmoid(x[t] . gate): the Qwen shared-expert gate.
void apply_shared_gate(const Tensor& x, const Tensor& gate, Tensor& shared) {
  const int64_t tokens = x.dim(0), hidden = x.dim(1);
  const float* xp = x.data<float>();
  const float* gp = gate.data<float>();
  float* sp = shared.data<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const float g = ops::sigmoid_f32(ops::dot_f32(xp + t * hidden, gp, hidden));
    for (int64_t c = 0; c < hidden; ++c) sp[t * hidden + c] = g * sp[t * hidden + c];
  }
}

std::vector<ops::MlpLoraRef> mlp_refs(const std::vector<MlpLora>& lora) {
  std::vector<ops::MlpLoraRef> refs;
  refs.reserve(lora.size());
  for (const MlpLora& l : lora) refs.push_back(l.ref());
  return refs;
}

}  // namespace

// ---------------------------------------------------------------------------- dense MLP, TP

ops::MlpLoraRef MlpLora::ref() const {
  return {factors_or_null(gate), factors_or_null(up), factors_or_null(down)};
}

MlpShard shard_mlp(const Tensor& w_gate, const Tensor& w_up, const Tensor& w_down, ShardSpec tp) {
  return {shard_dim(w_gate, 0, tp, "mlp gate weight"), shard_dim(w_up, 0, tp, "mlp up weight"),
          shard_dim(w_down, 1, tp, "mlp down weight")};
}

MlpLora shard_mlp_lora(const ops::MlpLoraRef& lora, ShardSpec tp) {
  return {shard_lora_column(copy_or_empty(lora.gate), tp, "mlp gate"),
          shard_lora_column(copy_or_empty(lora.up), tp, "mlp up"),
          shard_lora_row(copy_or_empty(lora.down), tp, "mlp down")};
}

Tensor mlp_forward_tp(const Tensor& x, const std::vector<int32_t>& slot, const MlpShard& shard,
                      const std::vector<MlpLora>& lora, Communicator& comm) {
  // Rank r's channels give its partial sum of the output (see the header).
  Tensor partial = ops::mlp_forward_ref(x, slot, shard.w_gate, shard.w_up, shard.w_down, mlp_refs(lora));
  comm.all_reduce_sum({partial.data<float>(), static_cast<size_t>(partial.numel())});
  return partial;
}

// ---------------------------------------------------------------------------- MoE, EP

ops::MoeLoraRef MoeLora::ref() const {
  ops::MoeLoraRef r;
  r.gate_up = factors_or_null(gate_up);
  r.down = factors_or_null(down);
  r.shared_gate = factors_or_null(shared.gate);
  r.shared_up = factors_or_null(shared.up);
  r.shared_down = factors_or_null(shared.down);
  return r;
}

MoeShard shard_moe(const ops::MoeWeightsRef& layer, const ops::MoeParams& params, ShardSpec ep,
                   SharedExpertSplit shared_split) {
  const int64_t experts = params.route.num_experts;
  MoeShard s;
  s.params = params;
  s.shared_split = shared_split;
  s.expert_offset = shard_range(experts, ep, "moe experts").begin;
  s.router = layer.router.clone();
  if (layer.correction_bias.defined()) s.correction_bias = layer.correction_bias.clone();
  MOELORA_CHECK(layer.w13.defined() && layer.w13.ndim() == 3 && layer.w13.dim(0) == experts,
                ErrorCode::kInvalidArgument, "moe w13: expected [", experts, ", 2I, H], got ",
                layer.w13.defined() ? shape_str(layer.w13.shape()) : "undefined");
  s.w13 = shard_dim(layer.w13, 0, ep, "moe w13");
  s.w2 = shard_dim(layer.w2, 0, ep, "moe w2");
  if (layer.shared_w13.defined()) {
    const int64_t shared_inter = layer.shared_w13.dim(0) / 2;
    const Tensor gate = layer.shared_w13.slice0(0, shared_inter);
    const Tensor up = layer.shared_w13.slice0(shared_inter, 2 * shared_inter);
    s.shared = shared_split == SharedExpertSplit::kTensorParallel
                   ? shard_mlp(gate, up, layer.shared_w2, ep)
                   : MlpShard{gate.clone(), up.clone(), layer.shared_w2.clone()};
    if (layer.shared_gate.defined()) s.shared_gate = layer.shared_gate.clone();
  }
  return s;
}

MoeLora shard_moe_lora(const ops::MoeLoraRef& lora, const ops::MoeParams& params, ShardSpec ep,
                       SharedExpertSplit shared_split) {
  const int64_t experts = params.route.num_experts;
  MoeLora s;
  s.gate_up = shard_lora_experts(copy_or_empty(lora.gate_up), experts, ep, "moe gate_up");
  s.down = shard_lora_experts(copy_or_empty(lora.down), experts, ep, "moe down");
  const ops::MlpLoraRef shared{lora.shared_gate, lora.shared_up, lora.shared_down};
  s.shared = shared_split == SharedExpertSplit::kTensorParallel
                 ? shard_mlp_lora(shared, ep)
                 : MlpLora{copy_or_empty(lora.shared_gate), copy_or_empty(lora.shared_up),
                           copy_or_empty(lora.shared_down)};
  return s;
}

Tensor moe_forward_ep(const Tensor& x, const std::vector<int32_t>& slot, const MoeShard& shard,
                      const std::vector<MoeLora>& lora, MoeCombine combine, Communicator& comm) {
  const int64_t experts = shard.params.route.num_experts;
  MOELORA_CHECK(shard.w13.defined() && shard.w13.dim(0) * comm.size() == experts &&
                    shard.expert_offset == shard.w13.dim(0) * comm.rank(),
                ErrorCode::kInvalidArgument, "moe: rank ", comm.rank(), " of ", comm.size(),
                " holds experts [", shard.expert_offset, ", ",
                shard.expert_offset + (shard.w13.defined() ? shard.w13.dim(0) : 0),
                ") of ", experts, "; expected [", experts / comm.size() * comm.rank(), ", ",
                experts / comm.size() * (comm.rank() + 1), ")");
  std::vector<ops::MoeLoraRef> refs;
  std::vector<MlpLora> shared_lora;
  for (const MoeLora& l : lora) {
    refs.push_back(l.ref());
    shared_lora.push_back(l.shared);
  }

  // 1. Route every token with the whole router: the same ids and weights on every rank.
  const ops::RouteResult route =
      ops::route_ref(ops::linear_ref(x, shard.router), shard.correction_bias, shard.params.route);
  // 2. The local experts' pair rows y [T * k, H] (zeros for the other ranks' pairs).
  Tensor pairs = ops::moe_expert_outputs_ref(x, slot, shard.w13, shard.w2, refs, shard.params, route,
                                             shard.expert_offset);
  // 3. The shared expert: all of it (replicated) or this rank's partial sum (tensor parallel).
  Tensor shared;
  if (shard.shared.w_gate.defined()) {
    shared = ops::mlp_forward_ref(x, slot, shard.shared.w_gate, shard.shared.w_up,
                                  shard.shared.w_down, mlp_refs(shared_lora));
    if (shard.shared_gate.defined()) apply_shared_gate(x, shard.shared_gate, shared);
  }
  const bool shared_partial =
      shared.defined() && shard.shared_split == SharedExpertSplit::kTensorParallel;
  auto all_reduce = [&](Tensor& t) {
    comm.all_reduce_sum({t.data<float>(), static_cast<size_t>(t.numel())});
  };

  // 4. Combine.
  MOELORA_CHECK(combine != MoeCombine::kDispatch, ErrorCode::kInvalidArgument,
                "moe: MoeCombine::kDispatch runs through moe_forward_dispatch (each rank with its "
                "own tokens), not moe_forward_ep");
  if (combine == MoeCombine::kPairRows) {
    all_reduce(pairs);
    if (shared_partial) all_reduce(shared);
    return ops::moe_combine_ref(pairs, route.weights, shared);
  }
  // kPartialSums: a replicated shared expert is added by rank 0 only, so the sum has it once.
  const bool add_shared = shared.defined() && (shared_partial || comm.rank() == 0);
  Tensor out = ops::moe_combine_ref(pairs, route.weights, add_shared ? shared : Tensor());
  all_reduce(out);
  return out;
}

Tensor moe_forward_dispatch(const Tensor& x, const std::vector<int32_t>& slot,
                            const MoeShard& shard, const std::vector<MoeLora>& lora,
                            Communicator& comm) {
  const int64_t experts = shard.params.route.num_experts, top_k = shard.params.route.top_k;
  const int64_t hidden = shard.params.hidden, tokens = x.dim(0);
  const int ranks = comm.size();
  MOELORA_CHECK(shard.w13.defined() && shard.w13.dim(0) * ranks == experts &&
                    shard.expert_offset == shard.w13.dim(0) * comm.rank(),
                ErrorCode::kInvalidArgument, "moe dispatch: rank ", comm.rank(), " of ", ranks,
                " holds experts [", shard.expert_offset, ", ",
                shard.expert_offset + (shard.w13.defined() ? shard.w13.dim(0) : 0), ") of ",
                experts, "; expected [", experts / ranks * comm.rank(), ", ",
                experts / ranks * (comm.rank() + 1), ")");
  MOELORA_CHECK(
      !shard.shared.w_gate.defined() || shard.shared_split == SharedExpertSplit::kReplicated,
      ErrorCode::kInvalidArgument,
      "moe dispatch: the shared expert is split over the ranks, but each rank holds only "
      "its own tokens; replicate it (SharedExpertSplit::kReplicated)");
  MOELORA_CHECK(x.ndim() == 2 && x.dim(1) == hidden && static_cast<int64_t>(slot.size()) == tokens,
                ErrorCode::kInvalidArgument, "moe dispatch: x ", shape_str(x.shape()), " with ",
                slot.size(), " slots; expected [T, ", hidden, "] and T slots");
  std::vector<ops::MoeLoraRef> refs;
  std::vector<MlpLora> shared_lora;
  for (const MoeLora& l : lora) {
    refs.push_back(l.ref());
    shared_lora.push_back(l.shared);
  }
  const int64_t per_rank = experts / ranks, row = hidden + 2;

  // 1. Route this rank's tokens; pair p = t * k + j goes to the owner of expert ids[p].
  ops::RouteResult route;
  if (tokens > 0)
    route =
        ops::route_ref(ops::linear_ref(x, shard.router), shard.correction_bias, shard.params.route);
  const int64_t pairs = tokens * top_k;
  const int32_t* ids = tokens > 0 ? route.ids.data<int32_t>() : nullptr;
  // Pairs grouped by destination rank, in pair order inside each (a stable counting sort).
  std::vector<int64_t> to_rank_begin(static_cast<size_t>(ranks) + 1, 0), order(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++to_rank_begin[static_cast<size_t>(ids[p] / per_rank) + 1];
  for (int r = 0; r < ranks; ++r) to_rank_begin[r + 1] += to_rank_begin[r];
  {
    std::vector<int64_t> fill(to_rank_begin.begin(), to_rank_begin.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) order[fill[static_cast<size_t>(ids[p] / per_rank)]++] = p;
  }

  // 2. Counts, then the pair rows.
  std::vector<float> send_pairs(static_cast<size_t>(ranks)), recv_pairs(static_cast<size_t>(ranks));
  const std::vector<int64_t> ones(static_cast<size_t>(ranks), 1);
  for (int r = 0; r < ranks; ++r)
    send_pairs[r] = static_cast<float>(to_rank_begin[r + 1] - to_rank_begin[r]);
  comm.all_to_all_v(send_pairs, ones, recv_pairs, ones);
  std::vector<int64_t> send_counts(static_cast<size_t>(ranks)),
      recv_counts(static_cast<size_t>(ranks));
  int64_t received = 0;
  for (int r = 0; r < ranks; ++r) {
    send_counts[r] = (to_rank_begin[r + 1] - to_rank_begin[r]) * row;
    recv_counts[r] = static_cast<int64_t>(recv_pairs[r]) * row;
    received += static_cast<int64_t>(recv_pairs[r]);
  }
  std::vector<float> outgoing(static_cast<size_t>(pairs * row));
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t p = order[i], t = p / top_k;
    float* dst = outgoing.data() + i * row;
    std::copy_n(x.data<float>() + t * hidden, hidden, dst);
    dst[hidden] = static_cast<float>(ids[p]);
    dst[hidden + 1] = static_cast<float>(slot[t]);
  }
  std::vector<float> incoming(static_cast<size_t>(received * row));
  comm.all_to_all_v(outgoing, send_counts, incoming, recv_counts);

  // 3. This rank's experts on the received pairs, one pair a row (top-1 routes).
  std::vector<float> results(static_cast<size_t>(received * hidden));
  if (received > 0) {
    Tensor xr = Tensor::empty(DType::kF32, {received, hidden});
    Tensor rid = Tensor::empty(DType::kI32, {received, 1});
    std::vector<int32_t> rslot(static_cast<size_t>(received));
    for (int64_t i = 0; i < received; ++i) {
      const float* src = incoming.data() + i * row;
      std::copy_n(src, hidden, xr.data<float>() + i * hidden);
      rid.data<int32_t>()[i] = static_cast<int32_t>(src[hidden]);
      rslot[static_cast<size_t>(i)] = static_cast<int32_t>(src[hidden + 1]);
    }
    ops::MoeParams one = shard.params;
    one.route.top_k = 1;
    const ops::RouteResult single{
        rid,
        Tensor::from_f32(std::vector<float>(static_cast<size_t>(received), 1.0f), {received, 1})};
    const Tensor y = ops::moe_expert_outputs_ref(xr, rslot, shard.w13, shard.w2, refs, one, single,
                                                 shard.expert_offset);
    std::copy_n(y.data<float>(), y.numel(), results.data());
  }

  // 4. The outputs back to the tokens' ranks, in the order their pairs were sent.
  std::vector<int64_t> back_send(static_cast<size_t>(ranks)), back_recv(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    back_send[r] = recv_counts[r] / row * hidden;
    back_recv[r] = send_counts[r] / row * hidden;
  }
  std::vector<float> returned(static_cast<size_t>(pairs * hidden));
  comm.all_to_all_v(results, back_send, returned, back_recv);
  if (tokens == 0) return Tensor::zeros(DType::kF32, {0, hidden});
  Tensor pair_rows = Tensor::empty(DType::kF32, {pairs, hidden});  // y [T_r * k, H]
  for (int64_t i = 0; i < pairs; ++i)
    std::copy_n(returned.data() + i * hidden, hidden, pair_rows.data<float>() + order[i] * hidden);

  // 5. Combine this rank's tokens, with the replicated shared expert.
  Tensor shared;
  if (shard.shared.w_gate.defined()) {
    shared = ops::mlp_forward_ref(x, slot, shard.shared.w_gate, shard.shared.w_up,
                                  shard.shared.w_down, mlp_refs(shared_lora));
    if (shard.shared_gate.defined()) apply_shared_gate(x, shard.shared_gate, shared);
  }
  return ops::moe_combine_ref(pair_rows, route.weights, shared);
}

}  // namespace moelora::dist
