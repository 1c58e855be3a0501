// The MoE layer's scheduling rules: which path and launch order a forward takes by default
// (SideStreamScheduling's -1 / -2 values, the LoRA kernels' instances, the GEMV chain's bounds),
// each with the measurement that set it. Used by MoeLayerCuda::forward
// (moe_layer_forward_cuda.cu) only.
#pragma once

#include "ops/moe/moe_layer_cuda.cuh"
#include "ops/moe_gemv/moe_gemv_cuda.cuh"

namespace moelora::ops::cuda {

// From this many tokens on, the side-stream LoRA expands take their register-bounded instance,
// which runs beside the expert GEMM (measured on the H200, qwen3.5 routed experts: 8 adapters at
// 64 / 128 tokens 306.6 -> 297.4 / 408.7 -> 398.2 us with it; 1 adapter at 1 / 4 tokens
// 42.4 -> 45.8 / 66.2 -> 71.3 us, so small batches keep the unbounded one).
constexpr int kLoraExpandBesideGemmTokens = 32;
// SideStreamScheduling::seam2_expand_in_finalize_max_tokens = -1: the seam-2 expand is formed in
// the finalize for decode forwards of up to this many tokens (docs/gpu_moe.md §6.0g) ...
constexpr int kSeam2ExpandInFinalizeDefaultTokens = 64;
// ... whose tokens x hidden size stays within this bound: each finalize CTA loads the B rows
// [H x r] of its token's k pairs, so the fold reads T k H r bf16 values of B where the side
// expand reads each segment's once. At kimi-ep8's H = 7168 and 64 tokens (117 MB of B) the fold
// ended 44 us after GEMM2; without it one H100, one r16 adapter: 807.9 -> 781.1 us, eight
// adapters 863.2 -> 862.9 (qwen3.5's H = 2048 keeps the fold to 64 tokens, where it was measured;
// docs/gpu_moe.md §6.0n).
constexpr long kSeam2ExpandInFinalizeMaxTokenHidden = 32L * 7168;
// SideStreamScheduling::seam1_after_quant = -1: the seam-1 side work after the quant kernel for
// layers whose hidden size keeps the seam-1 shrink in its register-bounded instance (K <= 4096:
// shrink_vec <= 2), which starts beside GEMM1's CTAs, and that have no shared expert or have it
// among the pairs with its LoRA on its own stream (otherwise its chain, after the routed experts'
// on the side stream, ended after GEMM1: docs/gpu_moe.md §6.0g, §6.0i).
constexpr int kSeam1AfterQuantMaxHidden = 4096;
// ... and on NVFP4 experts, after the f16 rows kernel for decode forwards of up to this many
// tokens. The NVFP4 GEMM's three CTAs per SM leave no room for the shrink's, so released after
// the align its 896-1024 CTAs took the SMs first and GEMM1 started ~10 us later; released after
// the rows kernel the shrink and expand run in GEMM1's tail. One H100, one r16 adapter: kimi-ep8
// 466 -> 449 us at 16 tokens, 497 -> 489 at 32, 274 -> 270 at 4; qwen3.5 within 1 %; with eight
// adapters at 64-128 tokens it was 1-5 % slower, hence the bound (docs/gpu_nvfp4.md).
constexpr int kNvfp4Seam1AfterRowsMaxTokens = 32;
// SideStreamScheduling::seam2_shrink_in_activation = -1: whether the seam-2 shrinks run in the
// activation kernel wherever the seam-2 expand is formed in the finalize. Off: on the H100 it
// measured 0.5-1.9 % slower on Qwen3-30B-A3B and within -1.5 / +0.7 % on Qwen3.5-35B-A3B
// (docs/gpu_moe.md §6.0h).
constexpr bool kSeam2ShrinkInActivationDefault = false;
// SideStreamScheduling::shared_lora_stream = -1 and activation_pdl_with_shared_pairs = -1: both
// on; with seam 1 after the quant (by the rule above) they took 1.6-3.7 % off Qwen3.5-35B-A3B's
// LoRA decode step on the H100, and the stream's priority 2.2-2.7 % more with one adapter
// (docs/gpu_moe.md §6.0i).
constexpr bool kSharedLoraStreamDefault = true;
constexpr bool kActivationPdlWithSharedPairsDefault = true;
// SideStreamScheduling::lora_max_ctas = -2 (opt-in): the decode LoRA segment kernels beside the
// FP8 stream GEMM get at most one CTA per SM in forwards of up to this many tokens and layers of
// hidden size up to kSeam1AfterQuantMaxHidden (the layers whose seam-1 shrink runs beside GEMM1),
// where the uncapped grids (up to 1,024 CTAs of the seam-1 shrink and expand) queue behind GEMM1's
// CTAs. One H100 run, qwen3.5 routed experts: 16 tokens 158.6 -> 154.0 us with one r16 adapter,
// 159.7 -> 156.9 with eight; 32 tokens 235.6 -> 230.3 with one but 236.5 -> 240.8 with eight, and
// 64 / 128 tokens with eight 318 -> 345 / 405 -> 517, hence the bound; 1-4 tokens within 1 us
// either way. One run of one build, so the default stays uncapped until the rule is measured
// beside it (docs/gpu_moe.md §6.0q).
constexpr int kLoraSideCtasCapMaxTokens = 16;

// A SideStreamScheduling switch: 1 = on, 0 = off, -1 = the layer's default.
inline bool resolve_setting(int value, bool layer_default) {
  return value < 0 ? layer_default : value > 0;
}

// Whether a forward of `tokens` tokens can take the expert GEMV chain, and why not (nullptr: it
// can).
inline const char* gemv_unsupported_reason(const MoeLayerConfig& c, int tokens, bool lora) {
  if (c.bf16_experts) return "the experts are bf16 (the GEMVs read FP8 experts)";
  if (c.nvfp4_experts) return "the experts are NVFP4 (the GEMVs read FP8 experts)";
  if (lora) return "the forward has LoRA";
  if (tokens > kMoeGemvMaxTokens) return "the forward has more than 8 tokens";
  if (c.hidden % 128 != 0 || c.inter % 128 != 0) return "H or I is not a multiple of 128";
  if (c.num_experts > kMoeGemvMaxExperts || c.top_k > kMoeGemvMaxTopK)
    return "E > 1024 or top_k > 32";
  if (c.route.num_experts != c.num_experts)
    return "the layer holds only some experts (expert parallelism)";
  if (c.shared_in_experts)
    return "the shared expert is one of the expert GEMMs' experts (shared_in_experts)";
  return nullptr;
}

}  // namespace moelora::ops::cuda
