// The whole decoder on the GPU: Qwen3-MoE (GQA, per-head q/k norms, rotate-half RoPE), Qwen3.5-MoE
// (Gated DeltaNet linear-attention layers with a per-sequence state, gated full attention with
// partial RoPE, (1 + w) norms) and DeepSeek-V3 / Kimi (MLA in its absorbed form, YaRN, dense first
// layers), bf16 activations with
// fp32 accumulation, FP8-block or bf16 routed experts through ops::cuda::MoeLayerCuda, a paged KV
// cache, multi-LoRA on every target a PEFT adapter can name, and sampling on the device.
//
// One forward() runs a batch of T token rows from B sequences (prefill chunks and decode tokens
// mixed) and is the same work every step for a given (T, B, flags): everything that varies per
// step - token ids, slots, positions, page tables, LoRA segments, sampling parameters - lives in
// one device metadata block (StepBuffers) that the caller fills through the pinned host mirror and
// uploads with upload_step() before forward() or before replaying a CUDA graph of forward().
// forward() allocates nothing and never synchronizes, so it can be captured once per decode
// bucket and replayed with other sequences, other adapters in the slots and base-only rows mixed
// in (DESIGN.md §4).
//
// Data flow of one step (x [T, H] bf16; slot [T]; LoRA on the side stream where it pays):
//   x = embed(ids)
//   per layer: h = rms_norm(x (+ residual));  attention (GQA or MLA, LoRA on every projection);
//              h = rms_norm(x + attn);        ffn = dense MLP (+LoRA) or MoeLayerCuda (+LoRA)
//   last rows: logits[b] = lm_head(rms_norm(x[last_row[b]]))  fp32 [B, V];  sampled[b] (optional)
//
// Rows must be ordered by slot groups when LoRA is on: the LoRA segments of the dense targets are
// {slot, 0, begin, end} ranges of rows (the executor sorts its batch by slot; base-only rows form
// no segment).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "core/device_collectives.h"
#include "core/tensor.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/peft.h"
#include "ops/sample/sample.h"

namespace moelora::model {

struct GpuModelLimits {
  int max_tokens = 0;     // rows of one forward (decode tokens + prefill chunks)
  int max_seqs = 0;       // sequences of one forward
  int num_slots = 0;      // adapter slots (0 = no LoRA)
  int max_rank = 0;       // largest adapter rank a slot holds (multiple of 8)
  int page_size = 64;     // KV tokens per page
  int64_t num_pages = 0;  // pages in the pool (all layers share the page ids); 0 = derive from
                          // kv_cache_bytes
  uint64_t kv_cache_bytes = 0;  // budget for the paged cache when num_pages == 0
  int max_pages_per_seq = 0;    // page-table width (longest sequence / page_size, rounded up)
};

// Kernels of the GQA attention layers (Qwen3-MoE): FlashInfer's paged-prefill kernel
// (ops/attention/attention_flashinfer.cuh, 2-3x faster, see there) or moelora's own. MLA layers
// always run moelora's absorbed MLA kernels.
enum class AttentionKernel {
  kAuto,        // FlashInfer's when the build has it and serves the shape, else moelora's
  kFlashInfer,  // kUnsupported when the build lacks it or the shape is not served
  kMoelora,
};
// "auto", "flashinfer", "moelora" (kInvalidArgument naming the value otherwise).
AttentionKernel parse_attention_kernel(const std::string& name);

struct GpuModelOptions {
  bool show_progress = true;  // progress bar on stderr while uploading
  int device = 0;
  AttentionKernel attention = AttentionKernel::kAuto;
  // GQA layers on FlashInfer's kernels: the attention and its split merge launched as
  // programmatic dependents of the qkv prologue (ops::cuda::FlashInferAttentionShape::
  // programmatic_launch; 0.5-1.3 % per decode step of Qwen3-30B-A3B, docs/gpu_engine.md §4b);
  // false: plain launches (A/B runs).
  bool attention_pdl = true;
  // MoE layers: decode forwards compute the router logits inside the route launch
  // (ops::cuda::RouterGemmPath::kAuto); false runs a cuBLAS GEMM before it (A/B runs).
  bool router_in_route = true;
  // MoE layers' side-stream scheduling (ops::cuda::SideStreamScheduling; A/B runs of
  // bench_decode_step): the seam-1 LoRA work released after the quant kernel instead of the
  // align (1 / 0; -1 = the layer's rule), the activation / finalize launched programmatically
  // after their LoRA events, and the seam-2 expand in the finalize for decode forwards of at most
  // this many tokens (0 = never, -1 = the layer's default), where it is, the seam-2 shrinks
  // (routed and shared expert) in the activation kernel (1 / 0; -1 = the layer's rule: off).
  int moe_seam1_after_quant = -1;
  bool moe_pdl_after_side_join = true;
  int moe_seam2_in_finalize_max_tokens = -1;
  int moe_seam2_shrink_in_activation = -1;
  // Layers with the shared expert among the pairs: its LoRA on a second side stream, and the
  // activation a programmatic launch (1 / 0; -1 = the layer's rules: ops::cuda::
  // SideStreamScheduling::shared_lora_stream, activation_pdl_with_shared_pairs).
  int moe_shared_lora_stream = -1;
  int moe_activation_pdl_with_shared_pairs = -1;
  // The grid cap of the decode LoRA kernels on the side stream (ops::cuda::SideStreamScheduling::
  // lora_max_ctas: 0 = uncapped, the default; -1 = one CTA per SM, -2 = the opt-in rule, N CTAs).
  int moe_lora_side_ctas = 0;
  // The stream GEMMs' work items: claimed (1) or round-robin (0); -1 = the layer's rule
  // (ops::cuda::StreamGemmSchedule::kAuto).
  int moe_stream_schedule = -1;
  // MoE layers whose shared expert is FP8 with the routed experts' intermediate size (FP8 routed
  // experts, all experts on this GPU) run it as expert E of the routed GEMMs
  // (ops::cuda::MoeLayerConfig::shared_in_experts); false: a separate bf16 MLP (dequantized).
  bool moe_shared_expert_in_experts = true;
  // Gated DeltaNet layers, forwards of at most max_seqs rows that take no chunked rule: the
  // in-projection's LoRA expand writes a delta buffer on the side stream beside the base GEMM and
  // the mix kernels add it as they read (ops::cuda::GdnInputDelta); false: the expand adds in place
  // after the GEMM, on the main stream.
  bool gdn_lora_delta_in_mix = false;
  // Tensor / expert parallelism: this model is rank collectives->rank() of collectives->size(), its
  // config and weights that rank's share (dist::shard_checkpoint: the rank's heads, intermediate
  // channels and routed experts [r E / n, (r + 1) E / n) of the config's num_experts), and the
  // group sums the partial outputs of each attention and FFN half (one all-reduce of [T, H] bf16
  // each, on the main stream, LoRA deltas included). Adapters must be cut alike
  // (dist::shard_adapter). nullptr: the whole model on one GPU. Not owned; outlives the model.
  DeviceCollectives* collectives = nullptr;
};

// Per-step device metadata (all owned by the model; sizes from GpuModelLimits). The host mirror
// has the same layout in pinned memory; upload_step() copies it in one cudaMemcpyAsync.
struct StepMetadata {
  int32_t* num_tokens;  // [1] valid rows T_valid (rows >= T_valid are padding)
  int32_t* num_seqs;    // [1] valid sequences
  int32_t* token_ids;   // [max_tokens]
  int32_t* token_slot;  // [max_tokens] adapter slot, -1 = base (padding rows: -1)
  int32_t* token_seq;   // [max_tokens] batch sequence of the row, -1 = padding
  int32_t* token_pos;   // [max_tokens] position in its sequence
  int32_t* q_start;     // [max_seqs] first row of the sequence
  int32_t* q_len;       // [max_seqs] rows of the sequence (0 = padding sequence)
  int32_t* kv_len;      // [max_seqs] cached length after this step
  int32_t* last_row;    // [max_seqs] row whose logits are computed (padding: any valid row, e.g. 0)
  int32_t* page_table;  // [max_seqs, max_pages_per_seq]
  int32_t* num_lora_segments;           // [1]
  int32_t* lora_segments;               // [num_slots, 4] {slot, 0, begin, end} (int4)
  ops::SampleRowParams* sample_params;  // [max_seqs]
  float* uniform;                       // [max_seqs] u in [0, 1) per sequence
  // Linear-attention layers (Qwen3.5): sequence k's rows are [cu_seqlens[k], cu_seqlens[k + 1])
  // (padding sequences: empty ranges at num_tokens) and its recurrent state lives in state slot
  // state_slot[k] (-1: padding, skipped).
  int32_t* cu_seqlens;  // [max_seqs + 1]
  int32_t* state_slot;  // [max_seqs]
};

struct ForwardShape {
  int tokens = 0;      // T: rows this forward runs (a bucket's capacity; <= max_tokens)
  int seqs = 0;        // B: sequences (<= max_seqs)
  int max_q_len = 0;   // host bound of the longest q_len (1 for decode)
  int max_kv_len = 0;  // host bound of the longest kv_len (decode graphs: the page-table capacity)
  bool lora = false;   // false: no LoRA work at all (no adapter in the batch)
  int single_slot = -1;  // >= 0 when every adapter row uses this one slot (see MoeForwardArgs)
  bool sample = true;    // run the sampler into sampled()
};

class GpuModel {
 public:
  // Uploads a loaded checkpoint (dense weights as bf16, FP8-block experts as they are when
  // moe_intermediate_size % 128 == 0, NVFP4 experts packed when hidden and moe_intermediate_size
  // are multiples of 128, else and for bf16 experts: bf16 experts).
  static std::unique_ptr<GpuModel> load(const io::ModelWeights& weights,
                                        const GpuModelLimits& limits,
                                        const GpuModelOptions& options = {});
  // A model of `config`'s shapes with seeded random weights drawn on the device (benchmarks of
  // models nobody has on disk): FP8-block experts when fp8_experts, NVFP4 experts when the
  // config's quantization is NVFP4 (and H, I are multiples of 128), else bf16. Same scales as
  // `moelora synth` for FP8 and bf16.
  static std::unique_ptr<GpuModel> random(const io::ModelConfig& config, uint64_t seed,
                                          bool fp8_experts, const GpuModelLimits& limits,
                                          const GpuModelOptions& options = {});
  virtual ~GpuModel() = default;

  virtual const io::ModelConfig& config() const = 0;
  virtual const GpuModelLimits& limits() const = 0;  // num_pages resolved

  // Adapters: check throws like model::AdapterSet::check (names adapter, layer, target; rank above
  // max_rank -> kUnsupported). write_slot uploads synchronously (call between steps).
  virtual void check_adapter(const io::LoraAdapter& adapter) const = 0;
  virtual void write_slot(int32_t slot, const io::LoraAdapter& adapter) = 0;
  virtual void clear_slot(int32_t slot) = 0;
  // Fills `slot` with a seeded random adapter of `rank` on every routed-expert, shared-expert,
  // dense-MLP and attention target (benchmarks); shared_outer: the routed experts' gate_up A and
  // down B are shared by all experts.
  virtual void randomize_slot(int32_t slot, int rank, bool shared_outer, uint64_t seed) = 0;

  // Linear-attention state slots (Qwen3.5's Gated DeltaNet layers): limits().max_seqs of them, one
  // per live sequence, assigned by the caller (StepMetadata::state_slot). reset_state zeroes a
  // slot's conv and recurrent states in every linear-attention layer: call it on `stream` before a
  // new sequence's first forward (not during a capture). Models without such layers have none
  // (num_state_slots() 0; reset_state is a no-op).
  virtual int num_state_slots() const = 0;
  virtual void reset_state(int32_t state_slot, cudaStream_t stream) = 0;
  // Copies state slot `src` into `dst` in every linear-attention layer (a sequence forked at its
  // current position, e.g. several samples of one prompt); same rules as reset_state.
  virtual void copy_state(int32_t src, int32_t dst, cudaStream_t stream) = 0;

  // Step metadata: host mirror (pinned, write it, then upload_step) and device copy.
  // upload_step copies the mirror to the device and plans the forward of `shape` (FlashInfer's
  // attention schedule, read from the mirror): call it before forward(shape) and before replaying
  // a graph captured from forward(shape). Graphs: decode shapes only (max_q_len 1), whose plans
  // keep one launch configuration per number of sequences.
  virtual StepMetadata& host_step() = 0;
  virtual const StepMetadata& device_step() const = 0;
  virtual void upload_step(const ForwardShape& shape, cudaStream_t stream) = 0;

  // Enqueues one forward on main_stream() (LoRA on the side stream). Captureable.
  virtual void forward(const ForwardShape& shape) = 0;
  // Outputs of the last forward (device): fp32 logits [max_seqs, V], sampled tokens [max_seqs].
  virtual const float* logits() const = 0;
  virtual const int32_t* sampled() const = 0;
  // Routing of the last forward in MoE layer `layer` (device, I32 [tokens, top_k] in the forward's
  // row order, each row in descending selection score); nullptr for a dense layer. Tests compare
  // it with the reference's routing (bf16 activations can flip near-tied experts).
  virtual const int32_t* moe_topk_ids(int64_t layer) const = 0;

  // The attention kernels the model runs: "flashinfer", "moelora" (GQA) or "moelora-mla".
  virtual const char* attention_kernel() const = 0;
  // MoE layers whose shared expert runs as one more expert of the routed FP8 GEMMs
  // (GpuModelOptions::moe_shared_expert_in_experts, where the layer allows it).
  virtual int shared_experts_in_experts() const = 0;
  // Rows of the forwards whose Gated DeltaNet in-projection delta the mix kernels add
  // (GpuModelOptions::gdn_lora_delta_in_mix; forwards of at most this many rows without the chunked
  // rule); 0 when the option is off or the model has no adapter slots or linear-attention layers.
  virtual int gdn_delta_rows() const = 0;

  virtual cudaStream_t main_stream() const = 0;
  virtual uint64_t weight_bytes() const = 0;        // device bytes of the weights
  virtual uint64_t kv_bytes_per_token() const = 0;  // all layers
  virtual uint64_t device_bytes() const = 0;        // everything the model allocated
};

}  // namespace moelora::model
