// MoeLayerCuda::forward: the two-stream pipeline of docs/gpu_moe.md §1 (router GEMM, route,
// align, quant, GEMM1, activation, GEMM2, shared expert, finalize on the main stream; the LoRA
// shrink / expand of both seams and of the shared expert on the side stream, joined by events
// right before their consumers). Enqueues only: no allocation, no synchronization.
#include <algorithm>

#include "ops/gemm/moe_gemm.h"
#include "ops/gemm/moe_gemm_cuda.cuh"
#include "ops/lora/lora_cuda.cuh"
#include "ops/lora/lora_mma_cuda.cuh"
#include "ops/moe/moe_cuda.cuh"
#include "ops/moe/moe_layer_cuda.cuh"
#include "ops/moe/moe_layer_impl_cuda.cuh"
#include "ops/moe/moe_layer_rules_cuda.cuh"
#include "ops/moe_align/moe_align_cuda.cuh"
#include "ops/moe_gemv/moe_gemv_cuda.cuh"
#include "ops/quant/quant_cuda.cuh"
#include "ops/route/route_cuda.cuh"

namespace moelora::ops::cuda {

using moe_layer_internal::gemm_bf16_nt;
using moe_layer_internal::PoolTarget;
using moe_layer_internal::round_up;

void MoeLayerCuda::forward(const MoeForwardArgs& f) {
  Impl& m = *impl_;
  const MoeLayerConfig& c = config_;
  const int T = f.tokens, E = c.num_experts, H = c.hidden, I = c.inter, k = c.top_k;
  // Experts the router scores (all ranks' under expert parallelism): routing statistics such as
  // the expected pairs per expert (T k / Er, whichever rank holds the expert) use these.
  const int Er = static_cast<int>(c.route.num_experts);
  MOELORA_CHECK(T > 0 && T <= c.max_tokens, ErrorCode::kInvalidArgument,
                "MoeLayerCuda::forward: tokens = ", T, " outside [1, max_tokens = ", c.max_tokens,
                "]");
  MOELORA_CHECK(f.x && f.out, ErrorCode::kInvalidArgument,
                "MoeLayerCuda::forward: x and out are required");
  const bool lora = f.lora && c.num_slots > 0 && f.slot;
  const bool shared = f.shared && m.has_shared;
  // The shared expert as expert E of the GEMMs (pair k of every token), or its own bf16 kernels.
  const bool shared_pairs = shared && c.shared_in_experts;
  const bool shared_separate = shared && !c.shared_in_experts;
  const int kp = k + (shared_pairs ? 1 : 0);  // pairs per token
  const int Ex = E + (shared_pairs ? 1 : 0);  // experts in the GEMMs
  const int P = T * kp;
  auto* cublas = static_cast<cublasHandle_t>(m.cublas);
  int32_t* offsets = m.x<int32_t>(m.offsets);
  const int32_t* num_pairs = offsets + Ex;  // device value: number of pairs (the shared ones too)

  // Expert GEMM path: decode sizes take the weight-streaming kernel (FP8 experts).
  const bool decode = gemm_path_ == GemmPath::kDecode || gemm_path_ == GemmPath::kDecodeRegister ||
                      (gemm_path_ == GemmPath::kAuto && should_use_decode_gemm(T, k, Er));
  const bool register_decode = decode && gemm_path_ == GemmPath::kDecodeRegister;
  const bool stream = decode && !register_decode && !c.bf16_experts && !c.nvfp4_experts;
  // NVFP4 experts: every forward takes the NVFP4 GEMM, chained by programmatic launch as the FP8
  // stream path; it picks its instance from max_tokens_per_expert (decode: weight-streaming passes
  // of up to 32 tokens; prefill: 256-row x 128-token tiles on the tensor cores).
  const bool nvfp4 = c.nvfp4_experts;
  const bool chain_pdl = stream || nvfp4;
  // Prefill-sized forwards take the tensor-core shrink / expand (64-row tiles of a segment through
  // mma.sync): from kLoraMmaMinTokens tokens on, a segment holds enough rows that the CUDA-core
  // kernels' per-row FMA work dominates (lora_mma_cuda.cuh). Decode sizes keep the CUDA-core
  // kernels, whose split-K shrink spreads a few rows over many CTAs. Both write the same partial
  // and delta layouts; the mma shrink fills split 0 only, so its expand runs with splits = 1.
  const bool lora_mma = lora_path_ == LoraPath::kTensorCore ||
                        (lora_path_ == LoraPath::kAuto && should_use_lora_mma(T));
  // DecodeLoraPath::kFused (decode with the stream GEMM): the quant kernel writes the seam-1 shrink
  // partials, the activation kernel expands them into its gate / up values and writes the seam-2
  // shrink partials (lora_row_fused.cuh); the side stream runs the seam-2 expand only.
  const bool fused_lora = lora && stream && !lora_mma && decode_lora_ == DecodeLoraPath::kFused;
  // DecodeLoraPath::kEpilogue: the same fused shrinks, the expands in the GEMMs' epilogues; the
  // routed experts then put no work on the side stream.
  const bool epilogue_lora =
      lora && stream && !lora_mma && decode_lora_ == DecodeLoraPath::kEpilogue;
  const bool fused_shrink = fused_lora || epilogue_lora;
  // Whether the side stream gets work (and so is forked and joined).
  const bool side_work = lora && (!epilogue_lora || shared);
  // The shared expert's (among the pairs) LoRA kernels on the second side stream
  // (SideStreamScheduling::shared_lora_stream), in decode forwards on the stream GEMM (what was
  // measured). Not with a single adapter: its seam-1 shrink is then a cuBLAS GEMM on the side
  // stream's handle, and all four of its kernels stay there.
  const bool shared_on_side2 =
      lora && shared_pairs && stream && f.single_slot < 0 && m.side2 &&
      resolve_setting(side_scheduling_.shared_lora_stream, kSharedLoraStreamDefault);
  cudaStream_t shared_stream = shared_on_side2 ? m.side2 : m.side;

  // The shared expert's base work on the main stream: gate_up GEMM, activation (with its seam-1
  // delta from the side stream when `with_lora`: waits for ev_shared_lora1), down GEMM into sout.
  // Its down LoRA and the join are the caller's.
  auto enqueue_shared_expert = [&](bool with_lora) {
    const int Is = c.shared_inter;
    gemm_bf16_nt(cublas, m.main, f.x, m.w<__nv_bfloat16>(m.sw13), m.x<__nv_bfloat16>(m.sh), CUDA_R_16BF, T,
                 2 * Is, H);
    if (with_lora) MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.main, m.ev_shared_lora1.get(), 0));
    MoeActivationArgs sact;
    sact.h = m.x<__nv_bfloat16>(m.sh);
    sact.delta = with_lora ? m.x<__nv_bfloat16>(m.sd1) : nullptr;
    sact.delta_row = with_lora ? m.x<int32_t>(m.token_pos) : nullptr;
    sact.row_token = nullptr;
    sact.slot = with_lora ? f.slot : nullptr;
    sact.num_rows = f.num_tokens;
    sact.max_rows = T;
    sact.inter = Is;
    sact.inter_padded = round_up(Is, 128);
    sact.a16 = m.x<__nv_bfloat16>(m.sa16);
    sact.aq = nullptr;
    sact.sa = nullptr;
    launch_moe_activation(sact, m.main);
    gemm_bf16_nt(cublas, m.main, m.x<__nv_bfloat16>(m.sa16), m.w<__nv_bfloat16>(m.sw2),
                 m.x<__nv_bfloat16>(m.sout), CUDA_R_16BF, T, H, Is);
  };

  // 1. router GEMM + route
  // gemv_quant: the route kernel also quantizes x per token (the expert GEMV chain's GEMM1 input).
  auto route_tokens = [&](bool gemv_quant) {
    RouteDeviceArgs ra;
    ra.logits = f.router_logits;
    // Decode sizes: the route launch computes the logits itself (its weight loads overlap the
    // previous kernel's tail through the programmatic launch); larger forwards run the GEMM.
    const bool router_in_route = !ra.logits && router_path_ == RouterGemmPath::kAuto && T <= m.router_route_tokens;
    if (router_in_route) {
      ra.router.x = f.x;
      ra.router.weight = m.w<__nv_bfloat16>(m.router);
      ra.router.hidden = H;
      ra.router.partials = m.x<float>(m.router_partials);
      ra.router.tickets = m.s<int32_t>(m.router_tickets);
      ra.pdl = true;
    } else if (!ra.logits) {
      gemm_bf16_nt(cublas, m.main, f.x, m.w<__nv_bfloat16>(m.router), m.x<float>(m.logits),
                   CUDA_R_32F, T, Er, H);
      ra.logits = m.x<float>(m.logits);
    }
    ra.correction_bias = m.has_bias ? m.w<float>(m.bias) : nullptr;
    ra.num_tokens = f.num_tokens;
    ra.topk_ids = m.s<int32_t>(m.ids);
    ra.topk_weights = m.s<float>(m.tw);
    ra.max_tokens = T;
    // x feeds the quant kernel (and the LoRA shrink) after the routing; the slot map the alignment.
    ra.prefetch[0] = {f.x, static_cast<size_t>(T) * H * sizeof(__nv_bfloat16)};
    if (lora) ra.prefetch[1] = {f.slot, static_cast<size_t>(T) * sizeof(int32_t)};
    if (gemv_quant) ra.quant = {f.x, H, m.x<uint8_t>(m.xq), m.x<float>(m.sx)};
    launch_route(c.route, ra, m.main);
  };

  // GemmPath::kGemv (opt-in, decode with few tokens and no LoRA): the expert GEMV chain
  // (docs/gpu_moe.md §6.4). The shared expert goes first, so that route -> up -> down stay one
  // run of programmatic launches.
  if (gemm_path_ == GemmPath::kGemv) {
    const char* no_gemv = gemv_unsupported_reason(c, T, lora);
    MOELORA_CHECK(!no_gemv, ErrorCode::kUnsupported, "MoeLayerCuda::forward: GemmPath::kGemv cannot run this forward: ",
                  no_gemv ? no_gemv : "", "; use GemmPath::kAuto");
    if (shared_separate) enqueue_shared_expert(/*with_lora=*/false);
    route_tokens(/*gemv_quant=*/true);
    MoeGemvArgs g;
    g.topk_ids = m.s<int32_t>(m.ids);
    g.topk_weights = m.s<float>(m.tw);
    g.num_tokens = f.num_tokens;
    g.tokens = T;
    g.top_k = k;
    g.num_experts = E;
    g.hidden = H;
    g.inter = I;
    g.xq = m.x<uint8_t>(m.xq);
    g.sx = m.x<float>(m.sx);
    g.w13 = m.w<uint8_t>(m.w13);
    g.w13_scale = m.w<float>(m.w13s);
    g.act = m.x<__nv_bfloat16>(m.a16);
    g.aq = m.x<uint8_t>(m.aq);
    g.sa = m.x<float>(m.sa);
    g.tickets = m.s<int32_t>(m.gemv_tickets);
    g.x = f.x;
    g.w2 = m.w<uint8_t>(m.w2);
    g.w2_scale = m.w<float>(m.w2s);
    g.shared = shared_separate ? m.x<__nv_bfloat16>(m.sout) : nullptr;
    g.shared_gate = (shared_separate && m.has_shared_gate) ? m.w<__nv_bfloat16>(m.sgate) : nullptr;
    g.out = f.out;
    // The down kernel fills the W2 rows of the first experts into L2 while the up kernel streams;
    // up to ~24 MB (half the H200's L2) so the fills are not evicted before they are read.
    g.prefetch_experts = static_cast<int>(std::max<int64_t>(1, (int64_t{24} << 20) / (int64_t{H} * I)));
    g.num_sms = m.num_sms;
    g.pdl = true;
    launch_moe_gemv_up(g, m.main);
    launch_moe_gemv_down(g, m.main);
    return;
  }
  route_tokens(/*gemv_quant=*/false);

  // 2. align
  MoeAlignDeviceArgs aa;
  aa.topk_ids = m.s<int32_t>(m.ids);
  aa.slot = lora ? f.slot : nullptr;
  aa.max_tokens = T;
  aa.top_k = k;
  aa.num_experts = Ex;
  aa.shared_expert = shared_pairs ? E : -1;
  aa.expert_begin = c.expert_begin;
  aa.num_slots = lora ? c.num_slots : 0;
  aa.expert_offsets = offsets;
  aa.sorted_pair = m.x<int32_t>(m.sorted_pair);
  aa.sorted_slot_expert = lora ? m.x<int2>(m.sorted_slot_expert) : nullptr;
  aa.sorted_token = m.x<int32_t>(m.sorted_token);
  aa.pair_pos = m.x<int32_t>(m.pair_pos);
  aa.active_experts = m.x<int32_t>(m.active);
  aa.num_active = m.x<int32_t>(m.num_active);
  aa.lora_segments = lora ? m.x<int4>(m.segments) : nullptr;
  aa.num_lora_segments = m.x<int32_t>(m.num_segments);
  aa.max_lora_segments = lora ? std::min(T * k, c.num_slots * E) : 0;  // routed pairs only
  aa.num_tokens = f.num_tokens;
  aa.token_sorted = lora ? m.x<int32_t>(m.token_sorted) : nullptr;
  aa.token_pos = lora ? m.x<int32_t>(m.token_pos) : nullptr;
  aa.token_segments = lora ? m.x<int4>(m.token_segments) : nullptr;
  aa.num_token_segments = lora ? m.x<int32_t>(m.num_token_segments) : nullptr;
  aa.token_shared_row = lora && shared_pairs ? m.x<int32_t>(m.token_shared_row) : nullptr;
  // Decode on FP8 experts chains route -> align -> quant -> GEMM1 -> activation -> GEMM2 ->
  // finalize with programmatic dependent launches (each kernel's launch and prologue overlap its
  // predecessor's tail; docs/gpu_moe.md §1 says what each may read before its wait). NVFP4 experts
  // at decode sizes chain the same way (the align reads nothing before its wait), so the align is
  // resident when the route kernel ends instead of launching after it; at prefill its counted
  // form may hold up to 200 KB of shared memory, which would sit on an SM for the route's whole
  // run (not measured), so it launches after it as on FP8 experts.
  aa.pdl = stream || (nvfp4 && decode);
  launch_moe_align(aa, m.main);
  // The side stream's seam-1 work starts after the align, or (SideStreamScheduling::
  // seam1_after_quant, decode on FP8 experts) after the quant kernel, so that GEMM1's CTAs reach
  // the SMs before the shrink's.
  // NVFP4 decode: after the f16 rows kernel, by rule for forwards of up to
  // kNvfp4Seam1AfterRowsMaxTokens tokens (the shrink does not fit beside the NVFP4 GEMM's CTAs;
  // it then runs in GEMM1's tail instead of holding GEMM1's start back).
  const bool nvfp4_decode = nvfp4 && decode;
  const bool seam1_after_quant =
      (stream && resolve_setting(side_scheduling_.seam1_after_quant,
                                 (!shared || shared_on_side2) && H <= kSeam1AfterQuantMaxHidden)) ||
      (nvfp4_decode &&
       resolve_setting(side_scheduling_.seam1_after_quant, T <= kNvfp4Seam1AfterRowsMaxTokens));
  if (side_work && !seam1_after_quant) m.ev_route.record(m.main);

  // side stream, seam 1 (and the shared expert's gate/up LoRA)
  // Row chunks per segment: a (slot, expert) segment holds about the busiest expert's tokens; a
  // token segment may hold every token (one adapter over a whole prefill).
  const int expected_expert_rows = std::min(T, 2 * ((T * k + Er - 1) / Er) + 6);
  LoraSegmentsView pair_segments{m.x<int4>(m.segments), m.x<int32_t>(m.num_segments),
                                 aa.max_lora_segments, (expected_expert_rows + 31) / 32};
  LoraSegmentsView token_segments{m.x<int4>(m.token_segments), m.x<int32_t>(m.num_token_segments),
                                  std::min(T, c.num_slots), (T + 31) / 32};
  const int lora_max_ctas = [&] {
    switch (side_scheduling_.lora_max_ctas) {
      case -2:  // the rule
        return stream && T <= kLoraSideCtasCapMaxTokens && H <= kSeam1AfterQuantMaxHidden
                   ? m.num_sms
                   : 0;
      case -1: return m.num_sms;
      default: return side_scheduling_.lora_max_ctas;
    }
  }();
  pair_segments.max_ctas = token_segments.max_ctas = lora_max_ctas;
  auto* cublas_side = static_cast<cublasHandle_t>(m.cublas_side);
  // The LoRA of one target, on the side stream: shrink x rows (gathered) into fp32 partials (the
  // segmented kernel, or one dense cuBLAS GEMM over all T rows of x when `dense_a` is given), then
  // expand into `delta` (rows in the segments' order). max_rows bounds the rows of all segments
  // together (the mma kernels' grid capacity): T * k for expert pairs, T for tokens.
  // `stream` is the side stream, or the second one for the shared expert's targets (not with
  // dense_a: the GEMM runs on the side stream's cuBLAS handle).
  auto run_lora = [&](const PoolTarget& t, const LoraSegmentsView& seg, int max_rows,
                      const __nv_bfloat16* x, const int32_t* gather, float* partial,
                      int row_capacity, __nv_bfloat16* delta, const __nv_bfloat16* dense_a,
                      cudaStream_t stream) {
    LoraExpandArgs e;
    e.pool = m.view(t);
    e.seg = seg;
    e.partial = partial;
    e.delta = delta;
    if (dense_a) {
      MOELORA_CHECK(stream == m.side, ErrorCode::kInternal,
                    "MoeLayerCuda::forward: the dense LoRA shrink runs on the side stream only");
      gemm_bf16_nt(cublas_side, m.side, x, dense_a, partial, CUDA_R_32F, T, t.max_rank, t.in);
      e.row_capacity = c.max_tokens;
      e.splits = 1;
      e.u_row = gather;  // u rows are x rows
    } else {
      LoraShrinkArgs sh;
      sh.pool = e.pool;
      sh.seg = seg;
      sh.x = x;
      sh.gather = gather;
      sh.partial = partial;
      sh.row_capacity = row_capacity;
      if (lora_mma) {
        launch_lora_shrink_mma(sh, max_rows, stream);
        e.splits = 1;
      } else {
        launch_lora_shrink(sh, stream);
      }
      e.row_capacity = row_capacity;
    }
    if (!delta) return;  // the expand is formed by its consumer (seam 2 in the finalize)
    if (lora_mma) {
      launch_lora_expand_mma(e, max_rows, stream);
    } else {
      e.pdl = true;  // directly after its shrink (or GEMM) on its stream: B loads overlap it
      e.beside_gemm = T >= kLoraExpandBesideGemmTokens;
      launch_lora_expand(e, stream);
    }
  };
  // A slot's A factor of target t (expert 0), for the dense single-adapter shrink.
  auto slot_a = [&](const PoolTarget& t, int slot) {
    return m.pool.at<__nv_bfloat16>(t.a) + static_cast<size_t>(slot) * t.ea * t.max_rank * t.in;
  };

  // K chunks of a fused row shrink's partials over target t's input (kRowShrinkChunk columns each).
  auto row_shrink_splits = [](const PoolTarget& t) {
    return (round_up(t.in, 128) + kRowShrinkChunk - 1) / kRowShrinkChunk;
  };
  auto row_shrink = [&](const PoolTarget& t, float* partial) {
    LoraRowShrinkArgs r;
    r.pool = m.view(t);
    r.partial = partial;
    r.row_capacity = m.P;
    r.row_slot_expert = m.x<int2>(m.sorted_slot_expert);
    return r;
  };
  // The expand of a fused shrink: partials of ceil(K / 1024) column chunks, rows = sorted pairs.
  auto run_fused_expand = [&](const PoolTarget& t, float* partial, __nv_bfloat16* delta) {
    LoraExpandArgs e;
    e.pool = m.view(t);
    e.seg = pair_segments;
    e.partial = partial;
    e.row_capacity = m.P;
    e.splits = row_shrink_splits(t);
    e.delta = delta;
    e.beside_gemm = T >= kLoraExpandBesideGemmTokens;
    launch_lora_expand(e, m.side);
  };

  if (lora)
    MOELORA_CHECK(f.single_slot >= -1 && f.single_slot < c.num_slots, ErrorCode::kOutOfRange,
                  "MoeLayerCuda::forward: single_slot ", f.single_slot, " outside [-1, ",
                  c.num_slots, ")");
  auto enqueue_seam1_side = [&] {
    MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.side, m.ev_route.get(), 0));
    const int single = f.single_slot;
    // One adapter whose gate_up A is shared by the experts: u = x A^T depends on the token only,
    // so one dense GEMM over the T tokens replaces the per-pair shrink (k times fewer rows); base
    // tokens' rows are computed but never expanded.
    if (!fused_shrink) {
      run_lora(m.gate_up, pair_segments, P, f.x, m.x<int32_t>(m.sorted_token), m.x<float>(m.part1),
               m.P, m.x<__nv_bfloat16>(m.d1),
               single >= 0 && m.slot_shared_a[single] ? slot_a(m.gate_up, single) : nullptr,
               m.side);
      m.ev_lora1.record(m.side);
    }
    if (shared) {  // the shared expert's A is a plain [R, H] matrix: dense for a single adapter
      if (shared_on_side2)
        MOELORA_CUDA_CHECK(cudaStreamWaitEvent(shared_stream, m.ev_route.get(), 0));
      run_lora(m.shared_gate_up, token_segments, T, f.x, m.x<int32_t>(m.token_sorted),
               m.x<float>(m.spart1), c.max_tokens, m.x<__nv_bfloat16>(m.sd1),
               single >= 0 ? slot_a(m.shared_gate_up, single) : nullptr, shared_stream);
      m.ev_shared_lora1.record(shared_stream);
    }
  };
  if (side_work && !seam1_after_quant) enqueue_seam1_side();

  // Expected busiest expert under near-uniform routing; the GEMM kernels loop over more tokens
  // when an expert gets more, so this only picks the fastest instance / grid.
  const int max_active = std::min(Ex, P);
  const int max_tokens_per_expert = std::min(T, 2 * ((T * k + Er - 1) / Er) + 6);

  // 3-5, bf16 experts: GEMM1 gathers bf16 x rows through sorted_token, the activation writes
  // only the bf16 copy, GEMM2 reads it. No FP8 anywhere.
  MoeGemmBf16Args b1;
  if (c.bf16_experts) {
    b1.act = f.x;
    b1.gather = m.x<int32_t>(m.sorted_token);
    b1.weight = m.w<__nv_bfloat16>(m.w13);
    b1.expert_offsets = offsets;
    b1.active_experts = m.x<int32_t>(m.active);
    b1.num_active = m.x<int32_t>(m.num_active);
    b1.out = m.x<__nv_bfloat16>(m.h);
    b1.num_experts = Ex;
    b1.n = 2 * I;
    b1.k = H;
    b1.max_active_experts = max_active;
    b1.max_tokens_per_expert = max_tokens_per_expert;
    b1.tile = gemm_path_ == GemmPath::kPrefill ? MoeGemmBf16Tile::kPrefill
              : gemm_path_ == GemmPath::kAuto  ? MoeGemmBf16Tile::kAuto
                                               : MoeGemmBf16Tile::kDecode;
    launch_moe_gemm_bf16(b1, m.main);
  }

  // The LoRA delta of a GEMM's epilogue (DecodeLoraPath::kEpilogue): target t's B, the shrink
  // partials of its fused shrink (ceil(K / 1024) column chunks, rows = sorted pairs).
  auto lora_epilogue = [&](const PoolTarget& t, float* partial) {
    const LoraPoolTarget v = m.view(t);
    MoeGemmLoraEpilogue l;
    l.b = v.b;
    l.scaling = v.scaling;
    l.rank = v.rank;
    l.b_shared = v.b_shared;
    l.partial = partial;
    l.row_slot_expert = m.x<int2>(m.sorted_slot_expert);
    l.num_slots = v.num_slots;
    l.b_experts = v.eb;
    l.base_only_experts = Ex - E;  // the shared expert's pairs are in its base bin
    l.max_rank = v.max_rank;
    l.splits = row_shrink_splits(t);
    l.row_capacity = m.P;
    return l;
  };

  // 3-5, NVFP4 experts: x rows gathered into sorted f16 rows, GEMM1, (activation below), its bf16
  // copy into f16 rows, GEMM2. The conversions wait for their predecessor before letting the GEMM
  // start (the GEMM reads the align's schedule before its own wait, as after the quant kernel).
  MoeGemmNvfp4Args n1;
  if (nvfp4) {
    RowsToF16Args cx;
    cx.x = f.x;
    // Per pair, not per token as the FP8 quant: a row's scale is row-wide, so a token is one CTA,
    // and one CTA storing its k rows was slower (kimi-ep8 NVFP4 at 1 token 125 -> 130 us, 128
    // tokens 541 -> 546; bench/results/h200/h100/quant_scatter/).
    cx.gather = m.x<int32_t>(m.sorted_token);
    cx.num_rows = num_pairs;
    cx.max_rows = P;
    cx.cols = H;
    cx.out = m.x<__half>(m.xh);
    cx.scale = m.x<float>(m.sxh);
    cx.pdl = true;
    launch_rows_to_f16_pow2(cx, m.main);
    if (side_work && seam1_after_quant) {
      m.ev_route.record(m.main);
      enqueue_seam1_side();
    }
    n1.act = m.x<__half>(m.xh);
    n1.act_scale = m.x<float>(m.sxh);
    n1.act_rows = m.P;
    n1.weight = m.w<uint8_t>(m.w13);
    n1.row_scale = m.w<float>(m.w13s);
    n1.expert_offsets = offsets;
    n1.active_experts = m.x<int32_t>(m.active);
    n1.num_active = m.x<int32_t>(m.num_active);
    n1.out = m.x<__nv_bfloat16>(m.h);
    n1.num_experts = Ex;
    n1.n = 2 * I;
    n1.k = H;
    n1.max_active_experts = max_active;
    n1.max_tokens_per_expert = max_tokens_per_expert;
    n1.instance = nvfp4_instance_;
    const bool claimed = stream_schedule_ == StreamGemmSchedule::kClaimed ||
                         (stream_schedule_ == StreamGemmSchedule::kAuto && !lora);
    if (claimed) n1.work_counters = m.s<int32_t>(m.gemm_work);
    launch_moe_gemm_nvfp4_stream(n1, m.num_sms, /*pdl=*/true, m.main);
  }

  // 3. quant + GEMM1 (FP8 experts). Decode (stream kernel) and prefill (CUTLASS) read each
  // expert's rows contiguously, so the quant kernel permutes x into sorted order; the stream
  // kernel takes its scales k-major. The register decode kernel gathers per-token FP8 rows.
  const int scale_ld = stream ? m.scale_ld : 0;
  MoeGemmFp8Args g1;
  MoeGemmPrefillWorkspace pws{m.x<void>(m.prefill_ws), m.prefill_ws_bytes, m.num_sms};
  auto run_gemm = [&](const MoeGemmFp8Args& g) {
    if (stream) {
      launch_moe_gemm_fp8_stream(g, m.num_sms, /*pdl=*/true, m.main);
    } else if (register_decode) {
      launch_moe_gemm_fp8_decode(g, m.num_sms, m.main);
    } else {
      launch_moe_gemm_fp8_prefill(g, pws, m.main);
    }
  };
  if (!c.bf16_experts && !nvfp4) {
    QuantFp8DeviceArgs qa;
    qa.x = f.x;
    // Pair rows in expert order: each token quantized once and stored to its pairs' rows (the
    // scatter form), or per pair through the gather where the fused LoRA shrink needs a pair row
    // per CTA. Register decode reads token rows as they are. Per pair, kimi-ep8's 128 tokens were
    // 7,168 CTAs that filled the SMs for 19 us and held GEMM1 back until 20.7 us; per token 896,
    // GEMM1 starts at 10.3 (one H100, bench/results/h200/h100/quant_scatter/).
    const bool scatter = !register_decode && !fused_shrink;
    qa.gather = register_decode || scatter ? nullptr : m.x<int32_t>(m.sorted_token);
    qa.num_rows = register_decode ? f.num_tokens : num_pairs;
    qa.max_rows = register_decode ? T : P;
    if (scatter) {
      qa.scatter = m.x<int32_t>(m.pair_pos);
      qa.scatter_rows = T;
      qa.scatter_width = kp;  // pairs per token: k, + 1 with the shared expert among them
    }
    qa.cols = H;
    qa.cols_padded = m.Hp;
    qa.q = m.x<uint8_t>(m.xq);
    qa.scale = m.x<float>(m.sx);
    qa.scale_ld = scale_ld;
    qa.pdl = stream;
    if (fused_shrink) {
      qa.lora = row_shrink(m.gate_up, m.x<float>(m.part1));
      qa.lora.prefetch_next = m.view(m.down);  // the activation kernel's shrink reads these
    }
    launch_quantize_fp8_rows(qa, m.main);
    if (side_work && seam1_after_quant) {
      m.ev_route.record(m.main);
      enqueue_seam1_side();
    }

    g1.act = m.x<uint8_t>(m.xq);
    g1.act_scale = m.x<float>(m.sx);
    g1.act_rows = m.P;
    g1.act_scale_ld = scale_ld;
    g1.gather = register_decode ? m.x<int32_t>(m.sorted_token) : nullptr;
    g1.weight = m.w<uint8_t>(m.w13);
    g1.weight_scale = m.w<float>(m.w13s);
    g1.expert_offsets = offsets;
    g1.active_experts = m.x<int32_t>(m.active);
    g1.num_active = m.x<int32_t>(m.num_active);
    g1.out = m.x<__nv_bfloat16>(m.h);
    g1.num_experts = Ex;
    g1.n = 2 * I;
    g1.k = m.Hp;
    g1.max_active_experts = max_active;
    g1.max_tokens_per_expert = max_tokens_per_expert;
    const bool claimed = stream_schedule_ == StreamGemmSchedule::kClaimed ||
                         (stream_schedule_ == StreamGemmSchedule::kAuto &&
                          (!lora || E <= kClaimedWithLoraMaxExperts));
    if (stream && claimed) g1.work_counters = m.s<int32_t>(m.gemm_work);
    if (epilogue_lora) g1.lora = lora_epilogue(m.gate_up, m.x<float>(m.part1));
    run_gemm(g1);
  }

  // Seam 2's expand in the finalize (SideStreamScheduling::seam2_expand_in_finalize_max_tokens):
  // the side stream keeps only the shrink.
  const int seam2_max_tokens =
      side_scheduling_.seam2_expand_in_finalize_max_tokens >= 0
          ? side_scheduling_.seam2_expand_in_finalize_max_tokens
          : static_cast<int>(std::min<long>(kSeam2ExpandInFinalizeDefaultTokens,
                                            kSeam2ExpandInFinalizeMaxTokenHidden / H));
  // The finalize must be a programmatic dependent of GEMM2 (no separate shared expert) for its B
  // loads to overlap GEMM2; after the shared expert's cuBLAS kernels they would follow GEMM2.
  const bool seam2_in_finalize = lora && chain_pdl && !lora_mma && !fused_shrink &&
                                 !shared_separate && side_scheduling_.pdl_after_side_join &&
                                 T <= seam2_max_tokens && k <= kFinalizeFoldMaxTopK &&
                                 m.down.max_rank <= kFinalizeFoldMaxRank;
  // ... and its shrink in the activation kernel (SideStreamScheduling::seam2_shrink_in_activation),
  // with the shared expert's (among the pairs) down LoRA likewise: seam 2 then has no side-stream
  // kernel at all.
  const bool seam2_shrink_in_act =
      seam2_in_finalize && c.num_slots <= kRowShrinkMaxSlots &&
      (!shared_pairs || m.shared_down.max_rank <= finalize_fold_ranks(m.down.max_rank)) &&
      resolve_setting(side_scheduling_.seam2_shrink_in_activation, kSeam2ShrinkInActivationDefault);
  // Seam-2 LoRA kernels on the side stream after the activation: the routed experts' (unless
  // GEMM2's epilogue or, with the option, the activation and the fold form them) and the shared
  // expert's among the pairs (unless the option moved them too); a separate shared expert's follow
  // its own activation (step 6). With none, the side stream's last work (seam 1) was joined before
  // the activation and the finalize waits on no event.
  const bool seam2_side_after_act =
      lora && !seam2_shrink_in_act && (!epilogue_lora || shared_pairs);
  const bool seam2_side_work = seam2_side_after_act || (lora && shared_separate);
  // 4. activation (+ seam-1 delta: from the side stream, or expanded in the kernel itself; the
  // shared expert's rows' from the side stream)
  if (lora && !fused_shrink) MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.main, m.ev_lora1.get(), 0));
  if (lora && shared_pairs)
    MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.main, m.ev_shared_lora1.get(), 0));
  MoeActivationArgs act;
  act.h = m.x<__nv_bfloat16>(m.h);
  act.delta = lora && !fused_shrink ? m.x<__nv_bfloat16>(m.d1) : nullptr;
  act.row_token = m.x<int32_t>(m.sorted_token);
  act.slot = lora ? f.slot : nullptr;
  act.num_rows = num_pairs;
  act.max_rows = P;
  if (shared_pairs) {
    act.shared_rows_begin = offsets + E;
    act.shared_delta = lora ? m.x<__nv_bfloat16>(m.sd1) : nullptr;
    act.shared_delta_row = lora ? m.x<int32_t>(m.token_pos) : nullptr;
  }
  act.inter = I;
  act.inter_padded = round_up(I, 128);  // = Ip for FP8 experts (I % 128 == 0)
  act.a16 = m.x<__nv_bfloat16>(m.a16);
  act.aq = c.bf16_experts || nvfp4 ? nullptr : m.x<uint8_t>(m.aq);
  act.sa = c.bf16_experts || nvfp4 ? nullptr : m.x<float>(m.sa);
  act.scale_ld = scale_ld;
  // The activation is a programmatic dependent of the stream kernel: it is scheduled while GEMM1
  // drains and GEMM2 after it prefetches its weights; after the side stream's seam-1 event too
  // (SideStreamScheduling::pdl_after_side_join says why that stays ordered). Not beside a shared
  // expert: its LoRA kernels run on the side stream during GEMM1, and an early activation's CTAs
  // (512 at 64 tokens of qwen3.5) held their SMs until GEMM1 ended, which delayed them by ~80 µs
  // and the layer by 1.3 % (docs/gpu_moe.md §6.0e). The fused seam-1 expand reads only
  // main-stream data (the quant kernel's partials, complete before GEMM1 ran), unless the shared
  // expert's rows are among the activation's: their seam-1 delta comes from the side stream.
  // With the shared expert among the pairs, the activation's events cover every side-stream kernel
  // before it, so it may be programmatic too
  // (SideStreamScheduling::activation_pdl_with_shared_pairs).
  const bool act_pdl_with_shared_pairs =
      shared_pairs && resolve_setting(side_scheduling_.activation_pdl_with_shared_pairs,
                                      kActivationPdlWithSharedPairsDefault);
  act.pdl = chain_pdl &&
            (!lora || (fused_shrink && !shared_pairs) ||
             (side_scheduling_.pdl_after_side_join && (!shared || act_pdl_with_shared_pairs)));
  if (fused_shrink || seam2_shrink_in_act) act.lora = row_shrink(m.down, m.x<float>(m.part2));
  if (seam2_shrink_in_act && shared_pairs) {  // its rows' partials at their tokens' rows
    act.shared_lora.pool = m.view(m.shared_down);
    act.shared_lora.partial = m.x<float>(m.spart2);
    act.shared_lora.row_capacity = c.max_tokens;
  }
  if (fused_lora) {
    act.lora_expand.pool = m.view(m.gate_up);
    act.lora_expand.partial = m.x<float>(m.part1);
    act.lora_expand.splits = row_shrink_splits(m.gate_up);
    act.lora_expand.row_capacity = m.P;
    act.lora_expand.row_slot_expert = m.x<int2>(m.sorted_slot_expert);
  }
  launch_moe_activation(act, m.main);
  if (seam2_side_after_act) {
    m.ev_act.record(m.main);
    MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.side, m.ev_act.get(), 0));
    if (epilogue_lora) {
      // the routed seam-2 delta is GEMM2's epilogue
    } else if (fused_shrink) {
      run_fused_expand(m.down, m.x<float>(m.part2), m.x<__nv_bfloat16>(m.d2));
    } else {
      run_lora(m.down, pair_segments, P, m.x<__nv_bfloat16>(m.a16), nullptr, m.x<float>(m.part2),
               m.P, seam2_in_finalize ? nullptr : m.x<__nv_bfloat16>(m.d2), nullptr, m.side);
    }
    if (shared_pairs) {  // the shared expert's down LoRA over its pairs' activation rows
      if (shared_on_side2)
        MOELORA_CUDA_CHECK(cudaStreamWaitEvent(shared_stream, m.ev_act.get(), 0));
      run_lora(m.shared_down, token_segments, T, m.x<__nv_bfloat16>(m.a16),
               m.x<int32_t>(m.token_shared_row), m.x<float>(m.spart2), c.max_tokens,
               m.x<__nv_bfloat16>(m.sd2), nullptr, shared_stream);
      if (shared_on_side2) m.ev_shared_lora2.record(shared_stream);  // joined before the finalize
    }
  }

  // 5. GEMM2
  if (nvfp4) {
    RowsToF16Args ca;
    ca.x = m.x<__nv_bfloat16>(m.a16);
    ca.num_rows = num_pairs;
    ca.max_rows = P;
    ca.cols = I;
    ca.out = m.x<__half>(m.ah);
    ca.scale = m.x<float>(m.sah);
    ca.pdl = true;
    launch_rows_to_f16_pow2(ca, m.main);
    MoeGemmNvfp4Args n2 = n1;
    n2.act = m.x<__half>(m.ah);
    n2.act_scale = m.x<float>(m.sah);
    n2.weight = m.w<uint8_t>(m.w2);
    n2.row_scale = m.w<float>(m.w2s);
    n2.out = m.x<__nv_bfloat16>(m.y);
    n2.n = H;
    n2.k = I;
    if (n1.work_counters) n2.work_counters = m.s<int32_t>(m.gemm_work) + 2;
    launch_moe_gemm_nvfp4_stream(n2, m.num_sms, /*pdl=*/true, m.main);
  } else if (c.bf16_experts) {
    MoeGemmBf16Args b2 = b1;
    b2.act = m.x<__nv_bfloat16>(m.a16);
    b2.gather = nullptr;
    b2.weight = m.w<__nv_bfloat16>(m.w2);
    b2.out = m.x<__nv_bfloat16>(m.y);
    b2.n = H;
    b2.k = I;
    launch_moe_gemm_bf16(b2, m.main);
  } else {
    MoeGemmFp8Args g2 = g1;
    g2.act = m.x<uint8_t>(m.aq);
    g2.act_scale = m.x<float>(m.sa);
    g2.act_scale_ld = scale_ld;
    g2.gather = nullptr;
    g2.weight = m.w<uint8_t>(m.w2);
    g2.weight_scale = m.w<float>(m.w2s);
    g2.out = m.x<__nv_bfloat16>(m.y);
    g2.n = H;
    g2.k = m.Ip;
    // GEMM2 may claim items while GEMM1 still runs (programmatic launch): its own pair
    if (g1.work_counters) g2.work_counters = m.s<int32_t>(m.gemm_work) + 2;
    g2.lora = epilogue_lora ? lora_epilogue(m.down, m.x<float>(m.part2)) : MoeGemmLoraEpilogue{};
    run_gemm(g2);
  }

  // 6. shared expert (bf16, unless it ran among the routed experts), its LoRA deltas from the
  // side stream
  if (shared_separate) {
    enqueue_shared_expert(lora);
    if (lora) {
      m.ev_shared_act.record(m.main);
      MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.side, m.ev_shared_act.get(), 0));
      run_lora(m.shared_down, token_segments, T, m.x<__nv_bfloat16>(m.sa16),
               m.x<int32_t>(m.token_sorted), m.x<float>(m.spart2), c.max_tokens,
               m.x<__nv_bfloat16>(m.sd2), nullptr, m.side);
    }
  }
  if (seam2_side_work) {  // (implies side_work)
    m.ev_lora2.record(m.side);
    MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.main, m.ev_lora2.get(), 0));
    if (shared_on_side2)  // (implies shared_pairs: its seam-2 kernels ran there)
      MOELORA_CUDA_CHECK(cudaStreamWaitEvent(m.main, m.ev_shared_lora2.get(), 0));
  }

  // 7. finalize
  MoeFinalizeArgs fa;
  fa.y = m.x<__nv_bfloat16>(m.y);
  fa.delta = lora && !epilogue_lora && !seam2_in_finalize ? m.x<__nv_bfloat16>(m.d2) : nullptr;
  if (seam2_in_finalize) {
    fa.lora_expand.pool = m.view(m.down);
    fa.lora_expand.partial = m.x<float>(m.part2);
    fa.lora_expand.splits =
        seam2_shrink_in_act ? row_shrink_splits(m.down) : lora_shrink_splits(m.down.in);
    if (seam2_shrink_in_act && shared_pairs) {
      fa.shared_lora_expand.pool = m.view(m.shared_down);
      fa.shared_lora_expand.partial = m.x<float>(m.spart2);
      fa.shared_lora_expand.splits = row_shrink_splits(m.shared_down);
      fa.shared_lora_expand.row_capacity = c.max_tokens;
    }
    fa.lora_expand.row_capacity = m.P;
    fa.lora_expand.row_slot_expert = m.x<int2>(m.sorted_slot_expert);
  }
  fa.topk_weights = m.s<float>(m.tw);
  fa.pair_pos = m.x<int32_t>(m.pair_pos);
  fa.slot = lora ? f.slot : nullptr;
  fa.shared = shared_separate ? m.x<__nv_bfloat16>(m.sout) : nullptr;
  fa.shared_in_pairs = shared_pairs;
  fa.shared_delta = (shared && lora && !seam2_shrink_in_act) ? m.x<__nv_bfloat16>(m.sd2) : nullptr;
  fa.shared_delta_row = (shared && lora) ? m.x<int32_t>(m.token_pos) : nullptr;
  fa.shared_gate = (shared && m.has_shared_gate) ? m.w<__nv_bfloat16>(m.sgate) : nullptr;
  fa.x = f.x;
  fa.num_tokens = f.num_tokens;
  fa.max_tokens = T;
  fa.top_k = k;
  fa.hidden = H;
  fa.out = f.out;
  // Directly after GEMM2 on this stream (also after the seam-2 expand's event, as the
  // activation), not after the shared expert's cuBLAS kernels.
  fa.pdl =
      chain_pdl && !shared_separate && (!seam2_side_work || side_scheduling_.pdl_after_side_join);
  launch_moe_finalize(fa, m.main);
}

}  // namespace moelora::ops::cuda
