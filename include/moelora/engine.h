// moelora::Engine: the serving API. Requests (prompt token ids, an adapter name or none, sampling
// settings) go in; generated tokens stream back through a per-request callback; the engine runs
// every live request together, one model forward per step, each request through its own LoRA
// adapter (or none) in the same batch.
//
// What one step() does (continuous batching with chunked prefill):
//   1. batch, within max_batch_tokens tokens in all: one decode token for every request that is
//      generating, then the next prompt chunk of every request still in prefill (oldest first),
//      then waiting requests join in arrival order, each with its first chunk, while the limits
//      allow (see "Admission");
//   2. ONE forward of that batch (every request with its own KV cache and adapter slot);
//   3. sampling: a request whose prompt is complete gets its next token (picked by the backend
//      with a uniform number drawn from the request's own seeded generator: on the device for
//      the GPU backend); finished requests leave (stop token, max_new_tokens, cancel) and free
//      their KV cache and adapter slot at once.
// A request's tokens do not depend on which other requests share its steps: each request samples
// with its own seeded RNG, and the CPU backend computes every sequence exactly as it would alone.
// The GPU backend's bf16 GEMMs round differently for other batch sizes, so there a greedy token
// may differ where the top logits are within bf16 error of each other (a near-tie) or where a
// top-k expert choice is that close (tests/gpu/serve_gpu_test.cpp measures it).
//
// Admission. A waiting request joins when all of these hold:
//   - fewer than max_running requests are running and the step still has token budget;
//   - (a backend with a fixed KV page pool: the GPU) the KV pages of its whole length,
//     ceil((prompt + max_new_tokens) / page_size), are free of other requests' reservations;
//   - its adapter (if any) is already used by a running request, or fewer than
//     max_loras_per_batch distinct adapters are in use and the adapter pool can give it a slot
//     (a free slot, or one whose adapter no running request uses: least recently used first).
// Base-only requests need no slot and never count against max_loras_per_batch. A request that
// waits for an adapter slot keeps its place: later adapter requests (of any adapter) wait behind
// it, so a steady stream of one adapter cannot starve another; later base-only requests go past
// it. When the running requests' adapters finish, the waiting adapter gets the freed slot.
//
// KV cache reservation. On a backend with a fixed page pool (ModelInfo::kv_cache_pages > 0), a
// request reserves at admission the pages of prompt + max_new_tokens tokens and keeps them until
// it leaves, whether or not it uses them all (it may stop early). So a running request never
// fails, and is never paused, because others were admitted: every page it can grow into is
// its own from the start. The price is predictability over packing: admission counts
// max_new_tokens, not the tokens generated so far. A request that does not fit waits, and every
// later request waits behind it (even a small or base-only one), so it is first to get in as
// running requests finish; submit() rejects (kOutOfRange, naming both sizes) a request whose
// prompt + max_new_tokens needs more pages than the whole pool. The CPU backend has no page
// pool: nothing is reserved there.
//
// Adapters are registered by name (register_adapter) before requests name them; registering
// reads and validates the files at once (so a bad adapter fails there, not in a request). The
// engine keeps up to host_adapter_cache adapters in host memory (least recently used dropped; a
// dropped one is read from its directory again when next needed) and adapter_slots of them in
// the backend's slot pool; loading one into a slot only rewrites that slot (nothing else about
// the backend changes, so a GPU backend's captured graphs stay valid). A pinned adapter keeps its
// slot. unregister_adapter refuses while
// a waiting or running request names the adapter.
//
// Threads: every method may be called from any thread. One thread should drive step() /
// run_until_idle() (the calls serialize). Callbacks run on that thread, outside the engine's
// state lock, in token order per request; a callback may call submit(), cancel(), stats() and the
// adapter methods, but not step() or run_until_idle(). A callback that throws has its request
// cancelled (no further events).
//
// Errors: every method returns Status / Result (core/error.h, the one library header this API
// exposes: std-only, no other moelora header comes with it) and never throws moelora::Error
// (Result::value() on an error does, by design).
// Bad requests are rejected by submit() with a message that names the field, e.g.
//   "request: token id 900 at prompt position 3 is outside the vocabulary [0, 512)".
// Failures while running (an adapter that has to be read again from a directory that no longer
// holds it, a backend error) end the affected requests with FinishReason::kError and the message;
// other requests go on.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace moelora {

namespace runtime {
class Executor;
}

using RequestId = uint64_t;

// Devices: "cpu" runs the fp32 reference model; "cuda" the bf16 / FP8 GPU model with a paged KV
// cache and CUDA-graph decode steps (a CUDA build with a visible device).
//
// Whether this build can run an engine on `device` ("cpu" always can; "cuda" when the build has
// CUDA and a device is visible). kUnsupported for "cuda" otherwise (the message says which of the
// two is missing), kInvalidArgument for an unknown name.
Status check_device(const std::string& device);
// "cuda" when check_device("cuda") succeeds, else "cpu".
std::string default_device();

struct EngineOptions {
  std::filesystem::path model_dir;  // Hugging Face checkpoint (config.json + *.safetensors)
  std::string device = "cpu";       // "cpu" (fp32 reference backend) or "cuda" (bf16 / FP8 GPU)
  // Tokens per step, decode tokens and prefill chunks together (the chunked-prefill budget).
  // Must be >= max_running so that every running request can always decode.
  int64_t max_batch_tokens = 2048;
  int32_t max_running = 64;         // requests in the batch at once
  int32_t max_loras_per_batch = 8;  // distinct adapters among running requests (base-only excluded)
  int32_t adapter_slots = 8;        // adapters resident in the backend pool; >= max_loras_per_batch
  int64_t max_lora_rank = 64;       // larger adapters are refused at registration
  int32_t host_adapter_cache =
      32;                       // adapters kept in host memory (LRU); 0 = read from disk each time
  int64_t prefill_chunk = 512;  // prompt tokens of one request per step; 0 = only the budget limits
  bool show_progress = false;   // progress bars on stderr while loading the model
  int64_t max_layers = 0;       // run only the first N decoder layers (0 = all; benchmarks)

  // GPU backend (device "cuda"); ignored on the CPU.
  // Benchmarks of models nobody has on disk: read only model_dir/config.json and draw seeded
  // random weights on the device (FP8-block experts when config.json says FP8). See also
  // register_random_adapter().
  bool random_weights = false;
  uint64_t random_seed = 0;
  // Longest sequence (prompt + generated) the paged KV cache's page tables hold; 0 =
  // min(max_position_embeddings, 8192). Requests beyond it are rejected by submit().
  int64_t max_seq_len = 0;
  // KV cache size: kv_cache_bytes when > 0, else gpu_memory_fraction of the device memory free at
  // start, less the model, the adapter pool and the workspaces (estimated from the shapes).
  uint64_t kv_cache_bytes = 0;
  double gpu_memory_fraction = 0.9;
  bool cuda_graphs = true;  // decode steps replay one CUDA graph per batch bucket
  // GQA attention kernels: "auto" (FlashInfer's paged-prefill kernel when the build has it and
  // serves the head dim, else moelora's own), "flashinfer" or "moelora". MLA models always run
  // moelora's absorbed MLA kernels.
  std::string attention = "auto";
  // GQA attention on FlashInfer's kernels launched as programmatic dependents of the qkv prologue
  // (model::GpuModelOptions::attention_pdl; false for A/B runs of the benchmarks).
  bool attention_pdl = true;
  // MoE layers on the GPU: decode forwards (up to 64 tokens) compute the router logits inside
  // the route launch; false runs a cuBLAS GEMM before it (A/B runs of the benchmarks).
  bool router_in_route = true;
  // MoE layers' LoRA side stream at decode (A/B runs of the benchmarks; model::GpuModelOptions):
  // the seam-1 work released after the quant kernel instead of the align (1 / 0; -1 = the layer's
  // measured rule), the activation / finalize launched programmatically after the side stream's
  // events, and the seam-2 expand formed in the finalize for decode forwards of at most this many
  // tokens (0 = never, -1 = the layer's default), where it is, the seam-2 shrinks (routed and
  // shared expert) in the activation kernel (1 / 0; -1 = the layer's rule: off).
  int moe_seam1_after_quant = -1;
  bool moe_pdl_after_side_join = true;
  int moe_seam2_in_finalize_max_tokens = -1;
  int moe_seam2_shrink_in_activation = -1;
  // MoE layers with the shared expert among the routed experts' GEMMs
  // (moe_shared_expert_in_experts) and LoRA: its LoRA kernels on a second side stream beside the
  // routed experts' (1 / 0), and the activation a programmatic launch after its LoRA events (1 /
  // 0); -1 = the layer's rules (ops::cuda::SideStreamScheduling::shared_lora_stream,
  // activation_pdl_with_shared_pairs).
  int moe_shared_lora_stream = -1;
  int moe_activation_pdl_with_shared_pairs = -1;
  // MoE layers: the grid cap of the decode LoRA kernels on the side stream (A/B runs): 0 = one CTA
  // per work unit (the default), -1 = one CTA per SM, -2 = the opt-in rule, N = at most N CTAs
  // (ops::cuda::SideStreamScheduling::lora_max_ctas).
  int moe_lora_side_ctas = 0;
  // MoE layers' stream GEMMs (A/B runs of the benchmarks): work items claimed from a counter (1) or
  // round-robin (0); -1 = the layer's rule (ops::cuda::StreamGemmSchedule::kAuto).
  int moe_stream_schedule = -1;
  // MoE layers with FP8 routed experts and an FP8 shared expert of the routed experts' size (the
  // published Qwen3.5 / DeepSeek-V3 FP8 checkpoints; random FP8 weights likewise): true runs the
  // shared expert as one more expert of the routed GEMMs (ops::cuda::MoeLayerConfig::
  // shared_in_experts; the default: it saves the three bf16 kernels after GEMM2, docs/gpu_moe.md
  // §1a); false keeps it a separate bf16 MLP.
  bool moe_shared_expert_in_experts = true;
  // Gated DeltaNet layers (Qwen3.5): at decode sizes, expand the in-projection's LoRA delta on the
  // side stream beside the base GEMM and let the mix kernels add it as they read their inputs,
  // instead of adding it in place after the GEMM (model::GpuModelOptions::gdn_lora_delta_in_mix;
  // off until measured, docs/gpu_engine.md §3a).
  bool gdn_lora_delta_in_mix = false;
};

struct SamplingParams {
  double temperature = 0.0;  // 0 = greedy
  double top_p = 1.0;        // (0, 1]
  int64_t top_k = 0;         // 0 = off
  uint64_t seed = 0;         // the request's own RNG: results do not depend on other requests
  int64_t max_new_tokens = 16;
  bool ignore_eos = false;              // do not stop at the model's end-of-sequence tokens
  std::vector<int32_t> stop_token_ids;  // also stop after any of these (always honoured)
  // Log-probabilities with each generated token (TokenEvent::logprobs): -1 = none; k in [0, 20]:
  // the chosen token's and the k most likely tokens' log-probabilities under the model's
  // distribution (log-softmax of the raw logits, before temperature / top-p / top-k, as vLLM
  // reports them by default). Costs a copy of the request's logits row per step on the GPU.
  int32_t logprobs = -1;
};

// The largest SamplingParams::logprobs (OpenAI's cap on top_logprobs).
inline constexpr int32_t kMaxTopLogprobs = 20;

struct Request {
  std::vector<int32_t> prompt;  // token ids, at least one
  std::string adapter;          // registered adapter name; "" = base model
  SamplingParams sampling;
};

enum class FinishReason {
  kNone,       // not finished
  kLength,     // max_new_tokens reached
  kStop,       // a stop token or an end-of-sequence token (kept as the last token)
  kCancelled,  // cancel()
  kError,      // see TokenEvent::error
};
const char* finish_reason_name(FinishReason reason);

// One callback invocation. Every request gets exactly one event with finished == true, its last
// (unless its callback threw: then it gets no further events).
struct TokenEvent {
  RequestId request_id = 0;
  int32_t token = -1;  // the generated token; -1 on a final event that carries none (cancel, error)
  int64_t index = -1;  // 0 for the first generated token, 1 for the next, ...; -1 without a token
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  std::string error;  // kError: what went wrong
  // With SamplingParams::logprobs >= 0 and a token: its log-probability and the top
  // alternatives (most likely first, ties by lower id; may include the chosen token).
  struct Logprobs {
    float logprob = 0.0f;
    std::vector<std::pair<int32_t, float>> top;
  };
  std::optional<Logprobs> logprobs;
};
using TokenCallback = std::function<void(const TokenEvent&)>;

struct ModelInfo {
  std::string model_type;  // config.json model_type
  int64_t vocab_size = 0;
  int64_t num_layers = 0;
  int64_t max_position_embeddings = 0;  // prompt + max_new_tokens may not exceed it
  // The backend's own limit on prompt + max_new_tokens (GPU: the KV page tables; 0 = none).
  int64_t max_sequence_length = 0;
  // The KV page pool that admission reserves from (see "KV cache reservation"): kv_cache_pages
  // pages of kv_page_size tokens; 0 = no fixed pool (CPU).
  int64_t kv_cache_pages = 0;
  int64_t kv_page_size = 0;
  // Linear-attention (Gated DeltaNet) state slots of the backend's fixed pool, one per running
  // sequence of such a model (GPU); 0 = none, or states allocated per sequence (CPU).
  int64_t state_slots = 0;
  std::vector<int32_t> eos_token_ids;
  // Attention kernels in use: "reference" (CPU), "flashinfer", "moelora" or "moelora-mla" (GPU).
  std::string attention_kernel;
  // MoE layers whose shared expert runs as one more expert of the routed FP8 GEMMs
  // (EngineOptions::moe_shared_expert_in_experts where the layer allows it; 0 on the CPU).
  int64_t moe_shared_experts_in_experts = 0;
};

struct AdapterInfo {
  std::string name;
  std::filesystem::path dir;
  bool pinned = false;
  int32_t slot = -1;             // pool slot while resident, else -1
  int32_t running_requests = 0;  // requests holding the slot
  bool in_host_cache = false;
};

struct EngineStats {
  int64_t steps = 0;             // forwards run
  int64_t prefill_steps = 0;     // steps with at least one prompt token
  int64_t prompt_tokens = 0;     // prompt tokens run through the model
  int64_t decode_tokens = 0;     // tokens fed by decode (one per generating request per step)
  int64_t generated_tokens = 0;  // tokens sampled (first tokens included)
  // Forward + sampling time of steps with prompt tokens (prefill_seconds) and of decode-only
  // steps (decode_seconds). A step that mixes both counts as prefill.
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  int64_t decode_only_tokens = 0;  // tokens generated by decode-only steps
  int32_t running = 0;             // now
  int32_t waiting = 0;             // now
  int32_t peak_running = 0;
  int64_t peak_step_tokens = 0;
  uint64_t kv_cache_bytes = 0;       // now
  uint64_t peak_kv_cache_bytes = 0;  // at the end of any step
  // Linear-attention states of live sequences (models with Gated DeltaNet layers): bytes and
  // sequences holding one, now.
  uint64_t state_cache_bytes = 0;
  int64_t state_sequences = 0;
  // KV pages reserved by running requests (prompt + max_new_tokens each; 0 without a page pool),
  // now and at most (as planned for a step, before its finished requests leave), and steps whose
  // admission stopped at a request that did not fit the unreserved pages.
  int64_t kv_pages_reserved = 0;
  int64_t peak_kv_pages_reserved = 0;
  int64_t kv_blocked_steps = 0;
  int64_t requests_finished = 0;  // stop or length
  int64_t requests_cancelled = 0;
  int64_t requests_failed = 0;
  // Adapter pool: acquisitions that found the adapter resident (hits) or loaded it into a slot
  // (misses), slots taken from an idle adapter (evictions), and loads into a slot served from the
  // host cache (host_hits) or read from disk (host_misses; registration reads count too).
  int64_t pool_hits = 0;
  int64_t pool_misses = 0;
  int64_t pool_evictions = 0;
  int64_t host_hits = 0;
  int64_t host_misses = 0;
  // How the backend ran the forwards (GPU: decode steps replay a CUDA graph per batch bucket,
  // captured at the bucket's first use; the CPU backend runs everything eagerly).
  int64_t eager_forwards = 0;
  int64_t graph_captures = 0;
  int64_t graph_replays = 0;
  int64_t graph_capture_failures = 0;
};

class Engine {
 public:
  // Loads options.model_dir onto options.device and checks the limits (kInvalidArgument naming
  // the option; kUnsupported for a device this build cannot run).
  static Result<std::unique_ptr<Engine>> create(const EngineOptions& options);
  // The same over an executor made elsewhere (tests, other backends); options.model_dir and
  // options.device are ignored.
  static Result<std::unique_ptr<Engine>> create(std::unique_ptr<runtime::Executor> executor,
                                                const EngineOptions& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const ModelInfo& model_info() const;
  const EngineOptions& options() const;

  // Reads dir (adapter_config.json + adapter_model.safetensors), checks it against the model and
  // max_lora_rank, and registers it as `name`. pin: load it into a slot now and keep it there.
  Status register_adapter(const std::string& name, const std::filesystem::path& dir,
                          bool pin = false);
  // Registers a seeded random adapter of `rank` on every target (shared_outer: the routed
  // experts share gate_up A and down B), with no files: it exists for benchmarks of models nobody
  // has on disk, together with EngineOptions::random_weights, and only on the GPU backend
  // (kUnsupported elsewhere). The backend draws the weights when the adapter gets a slot; the
  // same seed always gives the same adapter. kOutOfRange for a rank above max_lora_rank.
  Status register_random_adapter(const std::string& name, int64_t rank, bool shared_outer,
                                 uint64_t seed, bool pin = false);
  // kInvalidArgument while a waiting or running request names it; kNotFound for an unknown name.
  Status unregister_adapter(const std::string& name);
  std::vector<AdapterInfo> adapters() const;

  // Validates and queues a request; events go to `callback` (which may be empty). The id is also
  // the one cancel() takes. Nothing runs until step().
  Result<RequestId> submit(Request request, TokenCallback callback);
  // Ends a waiting or running request now: its KV cache and adapter slot are freed at once, and
  // the next step() delivers its final event (kCancelled). kNotFound for an unknown or finished id.
  Status cancel(RequestId id);

  // One scheduling iteration (see the top of this file). Returns an error only when the engine
  // itself failed; request failures go to the requests' callbacks.
  Status step();
  // Asks an idle backend whether it can still run (a multi-process backend notices a lost rank
  // here, between requests, not only at the next step): the error step() would return, else OK.
  // For the thread that steps, between steps.
  Status check_backend();
  // step() until no request waits or runs and every event has been delivered.
  Status run_until_idle();
  bool idle() const;

  EngineStats stats() const;

  struct Impl;

 private:
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace moelora
