// One MoE layer with multi-LoRA on the GPU: FP8 block-scaled routed experts (or NVFP4 ones, or bf16
// ones for non-quantized checkpoints and the tiny parity models), an optional bf16 shared expert (with
// Qwen's sigmoid gate), LoRA at both seams and on the shared expert, on a main and a side stream
// (docs/gpu_moe.md §1). Owns its device weights, its slice of the adapter pool and a Workspace
// sized at construction from (max tokens, slots, max rank): forward() allocates nothing and never
// synchronizes, so it can be captured into a CUDA graph and replayed with other routing, other slot
// maps and other adapters written into the pool.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "core/cuda_utils.h"
#include "core/lora.h"
#include "core/tensor.h"
#include "ops/gemm/moe_gemm_cuda.cuh"
#include "ops/route/route.h"

namespace moelora::ops::cuda {

// Experts the weight-streaming decode GEMMs schedule at most (their routing schedule in shared
// memory): E, or E + 1 with MoeLayerConfig::shared_in_experts.
constexpr int kMoeLayerStreamMaxExperts = 512;

struct MoeLayerConfig {
  int hidden = 0;        // H
  int inter = 0;         // I (multiple of 128 for FP8 experts, of 8 for bf16 experts)
  int num_experts = 0;   // E
  int top_k = 0;         // k
  RouteParams route;     // router kind, renormalize, groups, routed scaling
  int shared_inter = 0;  // Is, 0 = no shared expert
  bool shared_gate = false;
  // The shared expert as expert E of the FP8 routed stacks (needs Is == I, FP8 experts and every
  // expert on this layer): each token gets one more pair, for it, after its k routed ones, so
  // GEMM1, the activation and GEMM2 run it beside the routed experts and the finalize adds its row
  // with the gate: no separate kernels (else two cuBLAS GEMMs and an activation after GEMM2, in
  // bf16), and the finalize stays a programmatic dependent of GEMM2. Its LoRA keeps its own
  // targets over the token segments; the activation and the finalize add those deltas to its rows.
  // Its activations are FP8 like the routed experts' (MoeParams::shared_fp8_activations in the
  // reference). Host weights: shared_w13 / shared_w2 as FP8 with their block scales. E + 1 must
  // not pass kMoeLayerStreamMaxExperts.
  bool shared_in_experts = false;
  // capacities (fixed at construction)
  int max_tokens = 0;           // T
  int num_slots = 0;            // S, adapter slots in the pool (0 = no LoRA)
  int max_rank = 0;             // R (multiple of 8)
  bool per_expert_pool = true;  // pool keeps Ea = Eb = E; false: shared-outer only (Ea = 1 for
                                // gate_up A, Eb = 1 for down B)
  // Routed experts in bf16 instead of FP8: w13 / w2 are uploaded as bf16 (no scales), GEMM1
  // reads the bf16 x rows through the align's sorted order, GEMM2 the activation's bf16 copy;
  // nothing is quantized. H and I need only be multiples of 8.
  bool bf16_experts = false;
  // Routed experts in NVFP4 (e2m1 codes, e4m3 scale per 16 inputs, fp32 scale_2 per row): kept
  // packed on the device as the stream kernel's image (ops/gemm/moe_gemm_nvfp4.h); GEMM1 and
  // GEMM2 are launch_moe_gemm_nvfp4_stream on f16 rows (x gathered through sorted_token, then the
  // activation's bf16 copy, each converted by rows_to_f16_pow2). H and I multiples of 128.
  bool nvfp4_experts = false;
  // Expert parallelism: the router scores route.num_experts experts (Er) and this layer holds
  // experts [expert_begin, expert_begin + num_experts) of them; pairs routed to the others add
  // nothing to its output (another rank's layer adds them; the sum over ranks is the layer's).
  // Without it expert_begin = 0 and route.num_experts = num_experts. Not with GemmPath::kGemv.
  int expert_begin = 0;
};

// Host weights of one layer, as loaded (fp32 where not quantized). FP8 tensors use the canonical
// layouts of DESIGN.md §2. Leave w13 undefined to only allocate (then call randomize_weights).
// With config.bf16_experts, w13 / w2 are float tensors of any dtype (uploaded as bf16) and the
// scales are not used. With config.nvfp4_experts: w13 U8 [E, 2I, H/2] (low nibble = even column),
// w13_scale F8_E4M3 [E, 2I, H/16], w13_scale_2 F32 [E, 2I] (the checkpoint's weight_scale_2 of
// each row's tensor: gate and up may differ), and w2 / w2_scale / w2_scale_2 likewise over
// [E, H, I].
struct MoeLayerHostWeights {
  Tensor router;           // [Er, H] any float dtype (uploaded as bf16); Er = route.num_experts
  Tensor correction_bias;  // [Er] f32 or undefined
  Tensor w13;              // F8_E4M3 [E, 2I, H] (bf16 experts: any float dtype)
  Tensor w13_scale;        // F32 [E, 2I/128, ceil(H/128)] (bf16 experts: unused)
  Tensor w2;               // F8_E4M3 [E, H, I] (bf16 experts: any float dtype)
  Tensor w2_scale;         // F32 [E, ceil(H/128), I/128] (bf16 experts: unused)
  Tensor w13_scale_2;      // NVFP4 experts only: F32 [E, 2I]
  Tensor w2_scale_2;       // NVFP4 experts only: F32 [E, H]
  Tensor shared_w13;       // [2Is, H] any float dtype, or undefined (shared_in_experts: F8_E4M3)
  Tensor shared_w13_scale;  // shared_in_experts only: F32 [2I/128, ceil(H/128)]
  Tensor shared_w2;         // [H, Is] (shared_in_experts: F8_E4M3)
  Tensor shared_w2_scale;   // shared_in_experts only: F32 [ceil(H/128), I/128]
  Tensor shared_gate;      // [1, H] or undefined
};

// The LoRA of one adapter for this layer (host fp32 factors, canonical form of core/lora.h);
// null = not targeted.
struct MoeLayerAdapter {
  const LoraFactors* gate_up = nullptr;  // A [Ea, R, H], B [Eb, 2I, R]
  const LoraFactors* down = nullptr;     // A [Ea, R, I], B [Eb, H, R]
  const LoraFactors* shared_gate = nullptr;
  const LoraFactors* shared_up = nullptr;
  const LoraFactors* shared_down = nullptr;
};

struct MoeForwardArgs {
  const __nv_bfloat16* x = nullptr;      // [T, H]
  const int32_t* slot = nullptr;         // [T] (-1 = base), nullptr = all base
  const int32_t* num_tokens = nullptr;   // [1] valid tokens (device value), nullptr = tokens
  const float* router_logits = nullptr;  // [T, E]: skip the router GEMM (routed-experts-only runs)
  int tokens = 0;                        // T of this call (<= max_tokens); fixed per captured graph
  bool lora = true;                      // false: the no-LoRA pipeline (no side-stream work at all)
  // The batch's adapter slots as the scheduler knows them on the host: >= 0 when every token
  // with an adapter uses this one slot (the single-adapter path: dense cuBLAS shrinks over all
  // tokens where the factor is shared by the experts), -1 (default) for any other mix. Never
  // inferred from slot 0.
  int single_slot = -1;
  bool shared = true;            // false: skip the shared expert
  __nv_bfloat16* out = nullptr;  // [T, H]
};

// Which expert GEMM kernels the layer uses. FP8 experts: kDecode = the weight-streaming kernel
// (TMA ring + wgmma, activations permuted into sorted order by the quant kernel, programmatic
// dependent launch along GEMM1 -> activation -> GEMM2 -> finalize), kDecodeRegister = the earlier
// register-fed swap-AB kernel (kept for A/B runs), kPrefill = the CUTLASS grouped GEMM; kAuto
// takes kDecode up to should_use_decode_gemm's bound. bf16 experts: both decode values take the
// decode tile of the bf16 grouped GEMM, kPrefill its prefill tile.
// kGemv (opt-in; FP8 experts, up to kMoeGemvMaxTokens tokens, no LoRA in the forward, H and I
// multiples of 128, else kUnsupported): the two expert GEMV kernels of ops/moe_gemv (route -> up
// -> down, no alignment, no quant / activation / finalize kernels). Measured on the H200
// (docs/gpu_moe.md §6.4): 4 % faster than kDecode at one qwen3.5 token, 1.25-1.75x slower from 2
// tokens on and on kimi-k2.5-ep8 (its cp.async weight stream tops out near 2.3 TB/s where the
// stream GEMM's TMA ring reaches 3.9), so kAuto never takes it.
enum class GemmPath { kAuto, kDecode, kDecodeRegister, kPrefill, kGemv };

// Which LoRA shrink / expand kernels the layer uses: kAuto takes the tensor-core (mma) ones for
// forwards of at least kLoraMmaMinTokens tokens (lora_mma_cuda.cuh says why) and the decode-tuned
// CUDA-core ones below; the others force one family (tests, benchmarks).
enum class LoraPath { kAuto, kCudaCore, kTensorCore };

// Where the decode path (stream GEMM) computes the routed experts' LoRA. kSideStream: segmented
// shrink + expand kernels of both seams on the side stream, joined by events before the
// activation and the finalize. kFused: the quant kernel writes the seam-1 shrink partials, the
// activation kernel expands them into its gate / up values (so it stays a programmatic dependent
// of GEMM1) and writes the seam-2 shrink partials, and only the seam-2 expand runs on the side
// stream (ops/lora/lora_row_fused.cuh). Measured on the H200 (docs/gpu_moe.md §6.0): faster only
// at 16 tokens (qwen3.5 one adapter 136 vs 141 us), slower at 1 token (54 vs 47: the seam-1 A rows
// are read on the critical path) and at 64-128 tokens and on kimi-ep8 (the activation's LoRA
// instance needs 183 registers), so the side stream stays the default.
// kEpilogue: no routed-expert LoRA kernel at all: the quant kernel writes the seam-1 shrink
// partials, GEMM1's epilogue adds the seam-1 delta to its accumulators before the store, the
// activation kernel writes the seam-2 shrink partials and GEMM2's epilogue adds the seam-2 delta
// (MoeGemmLoraEpilogue); the whole chain stays one run of programmatic dependent launches on the
// main stream, and every B row is read once, by the CTA that owns its output tile. Measured on the
// H200 (docs/gpu_moe.md §6.0c): 0.79-0.94 of the side stream's speed with LoRA (each pass's
// LoRA loads are a chain of dependent round trips in the consumer warps, and the seam-1 A rows
// are read on the critical path by the quant kernel), so it stays opt-in.
enum class DecodeLoraPath { kSideStream, kFused, kEpilogue };

// How the stream GEMM's CTAs get their work items (expert, 64-row tile). kClaimed: each CTA's
// first item by its index, the rest first come first served from an atomic counter in the
// layer's workspace, so CTAs on SMs that stream faster take more items and all finish together;
// kRoundRobin: a fixed share per CTA (the earlier schedule). kAuto: the FP8 stream GEMM claims its
// items without LoRA, and with LoRA in layers of at most kClaimedWithLoraMaxExperts experts (since
// the seam-1 side work starts after the quant kernel and seam 2 is formed in the finalize, claimed
// items are the faster schedule with adapters for Qwen3-30B-A3B's 128 experts, 0.8-2.5 % per decode
// step; for Qwen3.5-35B-A3B's 256 they are 0.9-1.4 % slower, and neutral for Kimi-K2.5 EP8's 48:
// docs/gpu_moe.md §6.0k; round-robin had been 0.5-3 % faster with LoRA when the side-stream kernels
// still waited for the GEMM's SMs, §6.0a); the NVFP4 stream GEMM claims them without LoRA only
// (with LoRA claimed items measured -1.5 to +2.4 %, §6.0k).
enum class StreamGemmSchedule { kAuto, kClaimed, kRoundRobin };
constexpr int kClaimedWithLoraMaxExperts = 128;

// Where the router logits x Wg^T come from. kAuto: forwards of up to kRouterRouteMaxTokens tokens
// compute them in the route launch (ops/route/route_cuda.cuh: CTAs of 16 experts x 16 tokens on
// mma.sync, summed and routed by the CTA that completes a token tile; the weight rows are loaded
// before the launch's programmatic wait, so they stream while the previous kernel finishes), larger
// forwards run a cuBLAS GEMM and then the route launch. kCublas: always the GEMM (the earlier path,
// kept for A/B runs).
enum class RouterGemmPath { kAuto, kCublas };

// How the decode LoRA kernels on the side stream share the GPU with the expert GEMMs on the main
// stream. lora_max_ctas: the grid cap of the segment kernels (LoraSegmentsView::max_ctas). The
// stream GEMM is a persistent grid of two CTAs per SM; capping the side grids to leave it room was
// measured slower on the H200 (the side chain gets longer and the GEMM no faster, docs/gpu_moe.md
// §6.1), so the default is uncapped; at 16 tokens of layers with hidden size up to 4096 one CTA
// per SM measured faster in one H100 run (§6.0q), the opt-in rule below.
struct SideStreamScheduling {
  // 0 = one CTA per work unit (the default), -1 = one CTA per SM, N = at most N CTAs, -2 = the
  // rule (one CTA per SM on FP8 experts for decode forwards of up to kLoraSideCtasCapMaxTokens
  // (16) tokens and hidden size <= 4096, otherwise uncapped; moe_layer_rules_cuda.cuh).
  int lora_max_ctas = 0;
  // Decode on FP8 experts: the side stream's seam-1 kernels start after the quant kernel instead
  // of after the align, so that the persistent GEMM1 (a programmatic dependent of the quant
  // kernel) takes its SMs first and the shrink runs beside it (its result is needed only after
  // GEMM1, by the activation). 1 = on, 0 = off, -1 = on where it measured faster: layers whose
  // seam-1 shrink fits beside GEMM1's CTAs (hidden <= 4096, the register-bounded instance) and
  // that have no shared expert, or have it among the pairs with its LoRA on its own stream
  // (shared_lora_stream). docs/gpu_moe.md §6.0d, §6.0g, §6.0i. On NVFP4 experts the switch puts
  // it after the f16 rows kernel; the rule there: decode forwards of up to 32 tokens
  // (docs/gpu_nvfp4.md, "In the layer").
  int seam1_after_quant = -1;
  // Decode on FP8 / NVFP4 experts: the activation (after the seam-1 delta's event) and the
  // finalize (after the seam-2 delta's) stay programmatic dependents of the GEMM before them, so
  // they and the GEMM after them launch while that GEMM drains. The event still orders them after
  // the side stream (cudaStreamWaitEvent holds all later work of the stream; programmatic
  // serialization relaxes only the previous kernel: tests/gpu/cuda_launch_test.cu checks both,
  // eagerly and in graph replays). On by default: on the GPU host it took 0.6-2.2 % off the
  // one-adapter decode step of Qwen3-30B-A3B and 0-4 % off the LoRA rows of the layer, and left
  // the rest within noise (docs/gpu_moe.md §6.0e); false gives the plain launches of before.
  bool pdl_after_side_join = true;
  // Decode (stream or NVFP4 GEMMs, the side-stream DecodeLoraPath with CUDA-core LoRA kernels) of
  // at most this many tokens, top_k <= 8, a down pool of rank <= 32 and the finalize launched
  // programmatically after GEMM2 (pdl_after_side_join, no separate shared expert): the seam-2
  // expand is formed in the finalize kernel from the shrink's partials
  // (MoeFinalizeArgs::lora_expand), its B rows loaded while GEMM2 runs, so the side stream runs
  // only the seam-2 shrink and the expand's grid no longer shares the SMs with GEMM2. The same bits
  // either way. 0 = never; -1 = up to 64 tokens and 32 x 7168 tokens x hidden (the B rows the
  // finalize loads grow with both; docs/gpu_moe.md §6.0g, §6.0n).
  int seam2_expand_in_finalize_max_tokens = -1;
  // Where the seam-2 expand is formed in the finalize (above): the seam-2 shrinks run in the
  // activation kernel (its shrink-only instance: each CTA shrinks the activation row it has just
  // formed, the row's A values loaded at its start) instead of as side-stream grids beside GEMM2,
  // the routed experts' and, when it is among them, the shared expert's, whose expand the
  // finalize then forms too: seam 2 puts no kernel on the side stream and the finalize waits on no
  // side-stream event. Other bits than the side-stream shrinks (another summation order of the same
  // products). 1 = on, 0 = off, -1 = the layer's rule (kSeam2ShrinkInActivationDefault: off;
  // docs/gpu_moe.md §6.0h).
  int seam2_shrink_in_activation = -1;
  // Decode with LoRA on the stream GEMM (FP8 experts) in layers whose shared expert is one of the
  // GEMMs' experts (MoeLayerConfig::shared_in_experts): the shared expert's LoRA kernels (its
  // seam-1 shrink and expand, its seam-2 shrink and expand) run on a second side stream, forked
  // and joined by events as the first, so that its chain of small grids runs beside the routed
  // experts' LoRA instead of after it. Not in single-adapter forwards (single_slot >= 0: its
  // seam-1 shrink is a cuBLAS GEMM on the side stream's handle, and all four stay there). The
  // stream has the device's greatest priority, so its few CTAs are placed before the routed
  // shrink's queued ones (graph replays keep it where the graph is instantiated with
  // cudaGraphInstantiateFlagUseNodePriority, as the engine's are). The same bits either way.
  // 1 = on, 0 = off, -1 = the layer's rule (kSharedLoraStreamDefault: on; docs/gpu_moe.md §6.0i).
  int shared_lora_stream = -1;
  // Decode with LoRA on the stream GEMM (FP8 experts), the shared expert among the pairs,
  // pdl_after_side_join: the activation is a programmatic dependent of GEMM1 as in layers without a
  // shared expert. Its events then cover every side-stream kernel before it (the shared expert's
  // seam-1 LoRA included), so its early CTAs hold no SM that a side-stream kernel still needs (what
  // made §6.0e keep it plain beside a separate shared expert). 1 = on, 0 = off, -1 = the layer's
  // rule (kActivationPdlWithSharedPairsDefault: on; docs/gpu_moe.md §6.0i).
  int activation_pdl_with_shared_pairs = -1;
};

// The transient buffers of MoE layers that run one after another on the same two streams (the
// layers of one model: a layer's side-stream work joins its main stream before its finalize, and
// the next layer's kernels come after that finalize), in one allocation as large as the largest
// layer's plan instead of one per layer. At 8192 tokens per step a Qwen3-30B-A3B layer plans
// ~1.2 GB and a Kimi-K2.5 NVFP4 layer ~4.9 GB, which private copies per layer multiplied into most
// of the GPU. Layers reserve their plan at construction (growing the allocation) and look up its
// address at every forward, so every layer sharing it must be built before the first forward or
// graph capture of any of them. For the same reason the layers share one cuBLAS handle per stream
// (each with a 32 MB workspace: private pairs cost 2.6 GB on Qwen3.5-35B-A3B's 40 MoE layers).
class MoeSharedWorkspace {
 public:
  // At least `bytes`; reallocates (contents lost) when it has fewer.
  void reserve(size_t bytes);
  void* get() const { return buffer_.get(); }
  size_t bytes() const { return buffer_.bytes(); }
  // The cuBLAS handles (cublasHandle_t) of the main and the side stream, created by the first
  // call (a layer's construction, before any capture).
  void* cublas_main();
  void* cublas_side();
  // The second side stream (SideStreamScheduling::shared_lora_stream), of the device's greatest
  // priority, created by the first call.
  cudaStream_t shared_lora_stream();

 private:
  ::moelora::cuda::DeviceBuffer buffer_;
  std::optional<::moelora::cuda::CublasHandle> cublas_main_, cublas_side_;
  std::optional<::moelora::cuda::Stream> shared_lora_stream_;
};

class MoeLayerCuda {
 public:
  // Streams must outlive the layer; they are created before any capture. `shared_workspace`
  // (optional; must outlive the layer): the transient buffers go there instead of a private
  // allocation (MoeSharedWorkspace says when that is safe).
  MoeLayerCuda(const MoeLayerConfig& config, const MoeLayerHostWeights& weights,
               cudaStream_t main_stream, cudaStream_t side_stream,
               MoeSharedWorkspace* shared_workspace = nullptr);
  ~MoeLayerCuda();
  MoeLayerCuda(const MoeLayerCuda&) = delete;
  MoeLayerCuda& operator=(const MoeLayerCuda&) = delete;

  // Writes an adapter into pool slot `slot` (synchronous copies; call between forwards/replays).
  void set_adapter(int slot, const MoeLayerAdapter& adapter);
  void clear_adapter(int slot);

  // Benchmarks: fill the device weights (when constructed without host weights) or one pool slot
  // with seeded pseudo-random values on the device, at realistic magnitudes, without host copies.
  void randomize_weights(uint64_t seed);
  // rank <= max_rank; shared_outer: gate_up A and down B shared by all experts of the slot.
  void randomize_adapter(int slot, int rank, bool shared_outer, uint64_t seed);

  // Enqueues the layer on the main stream (LoRA on the side stream, joined before the consumers).
  void forward(const MoeForwardArgs& args);

  void set_gemm_path(GemmPath path) { gemm_path_ = path; }
  void set_lora_path(LoraPath path) { lora_path_ = path; }
  // Refuses values outside each field's range (seam1_after_quant in {-1, 0, 1}, the token count
  // >= -1, lora_max_ctas >= -2).
  void set_side_stream_scheduling(const SideStreamScheduling& s);
  void set_decode_lora_path(DecodeLoraPath path) { decode_lora_ = path; }
  void set_stream_gemm_schedule(StreamGemmSchedule s) { stream_schedule_ = s; }
  // The NVFP4 stream GEMMs' instance (measurements; kAuto picks it from the expected tokens of the
  // busiest expert). Refuses kPrefill where H or 2I (GEMM2's and GEMM1's N) is not a multiple of
  // 256, here rather than halfway through a forward.
  void set_nvfp4_instance(Nvfp4StreamInstance i);
  void set_router_gemm_path(RouterGemmPath path) { router_path_ = path; }
  const MoeLayerConfig& config() const { return config_; }
  // Bytes of the weights a forward of `active_experts` distinct experts must read (FP8 experts
  // incl. scales, NVFP4 codes incl. group and row scales, or bf16 experts; router, shared expert):
  // the byte roofline's numerator.
  uint64_t expert_bytes() const;
  uint64_t router_bytes() const;
  uint64_t shared_bytes() const;
  // Bytes of the transient buffers' plan (in the shared workspace when one was given).
  size_t workspace_bytes() const;

  // Read-only views of the device weights and pool (benchmark baselines and tests).
  // FP8 experts fill w13 .. w2_scale, bf16 experts w13_bf16 / w2_bf16, NVFP4 experts the *_nvfp4
  // images and their row scales; the other fields are nullptr.
  // With MoeLayerConfig::shared_in_experts the FP8 stacks hold E + 1 experts (the shared one
  // last) and shared_w13 / shared_w2 are nullptr.
  struct DeviceView {
    const uint8_t* w13;               // e4m3 [E, 2I, Hp]
    const float* w13_scale;           // [E, 2I/128, Hp/128]
    const uint8_t* w2;                // e4m3 [E, H, I]
    const float* w2_scale;            // [E, ceil(H/128), I/128]
    const __nv_bfloat16* w13_bf16;    // [E, 2I, H]
    const __nv_bfloat16* w2_bf16;     // [E, H, I]
    const uint8_t* w13_nvfp4;         // NVFP4 experts: images (pack_nvfp4_for_stream) and row scales
    const float* w13_scale_2;         // [E, 2I]
    const uint8_t* w2_nvfp4;
    const float* w2_scale_2;          // [E, H]
    const float* correction_bias;     // [E] or nullptr
    const __nv_bfloat16* router;      // [E, H]
    const __nv_bfloat16* shared_w13;  // [2Is, H] or nullptr
    const __nv_bfloat16* shared_w2;   // [H, Is] or nullptr
    const __nv_bfloat16* lora_a13;    // pool [S, Ea, R, H]
    const __nv_bfloat16* lora_b13;    // pool [S, E, 2I, R]
    const __nv_bfloat16* lora_a2;     // pool [S, E, R, I]
    const __nv_bfloat16* lora_b2;     // pool [S, Eb, H, R]
    int hidden_padded, lora_a13_experts, lora_b2_experts,
        max_rank;  // hidden_padded = H for bf16 experts
  };
  DeviceView device_view() const;

  // Device buffers exposed for tests (valid after forward): routing and sorted order.
  const int32_t* topk_ids() const;
  const float* topk_weights() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  MoeLayerConfig config_;
  GemmPath gemm_path_ = GemmPath::kAuto;
  LoraPath lora_path_ = LoraPath::kAuto;
  SideStreamScheduling side_scheduling_;
  DecodeLoraPath decode_lora_ = DecodeLoraPath::kSideStream;
  StreamGemmSchedule stream_schedule_ = StreamGemmSchedule::kAuto;
  Nvfp4StreamInstance nvfp4_instance_ = Nvfp4StreamInstance::kAuto;
  RouterGemmPath router_path_ = RouterGemmPath::kAuto;
};

}  // namespace moelora::ops::cuda
