// bench/attention: moelora's paged GQA attention (ops/attention) against FlashInfer's kernels on
// the same paged KV cache, on the GPU. Answers "our attention or FlashInfer's?" with numbers.
//
// For each preset (attention shapes of a model), decode batch B x context S and prefill batch
// B x L (causal, no prior context), it fills one bf16 KV cache with random values in pages of
// --page-size tokens handed out in shuffled order, then runs on that cache:
//   moelora        launch_paged_attention, moelora's own kernel (split-KV at decode; the engine's
//                  fallback where FlashInfer is not built in or the head dim is not served)
//   fi-prefill     ops::cuda::FlashInferAttention: FlashInfer's BatchPrefillWithPagedKVCache
//                  (tensor cores, FA2; the kernel serving stacks take for decode when the GQA
//                  group is >= 4), planned as the engine plans it; the engine's GQA attention
//   fi-decode      FlashInfer's BatchDecodeWithPagedKVCache (CUDA cores; decode only)
//   moelora-flat   launch_gqa_decode_attention: moelora's flat split-KV decode kernel (the whole
//                  batch's KV tiles split evenly over one wave of CTAs; decode only)
// Every other kernel's output is compared with moelora's (max |diff| / max |moelora|, must be
// <= 2e-2 or the run fails). Times are CUDA-event medians of single launches, with L2 flushed
// before each, so every launch streams its KV from HBM; FlashInfer's host-side plan (once per
// step in a server, shared by all layers) is not timed. Decode reports the KV bytes read per
// second against the copy bandwidth measured in the same run; prefill reports TFLOP/s
// (2 x Hq x (D + Dv) per causal query-key pair).
//
//   bench_attention [--preset NAME|all] [--decode B:S,...] [--prefill B:L,...] [--reps N]
//                   [--page-size P] [--out DIR]
//
// FlashInfer is compiled in when CMake finds its headers (.deps/flashinfer, unpacked by
// scripts/setup); without them only moelora's kernel is timed.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "core/cuda_utils.h"
#include "core/dtype.h"
#include "ops/attention/attention_cuda.cuh"
#include "ops/attention/attention_flashinfer.cuh"
#include "ops/attention/gqa_decode_cuda.cuh"

#ifdef MOELORA_WITH_FLASHINFER
#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/default_decode_params.cuh>
#include <flashinfer/attention/default_prefill_params.cuh>
#include <flashinfer/attention/prefill.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>
#endif

// Inside moelora::bench so that `cuda::` names moelora::cuda, not CCCL's ::cuda.
namespace moelora::bench {
namespace {

struct Preset {
  std::string name;
  int hq, hkv, head_dim;
};

// Full-attention layers: Qwen3-30B-A3B (32 query heads, 4 KV heads, head_dim 128) and
// Qwen3.5-35B-A3B's gated full-attention layers (16 / 2 / 256; the output gate is applied
// after attention and is not part of this kernel).
const std::vector<Preset> kPresets = {
    {"qwen3-30b-a3b", 32, 4, 128},
    {"qwen3.5-35b-a3b", 16, 2, 256},
};

struct Shape {
  int batch, len;  // decode: B sequences of context len; prefill: B sequences of len new tokens
};

std::vector<Shape> parse_shapes(const std::string& s, const char* flag) {
  std::vector<Shape> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t colon = item.find(':');
    MOELORA_CHECK(colon != std::string::npos, ErrorCode::kInvalidArgument, flag,
                  ": expected BATCH:LENGTH items, got '", item, "'");
    const Shape shape{std::stoi(item.substr(0, colon)), std::stoi(item.substr(colon + 1))};
    MOELORA_CHECK(shape.batch >= 1 && shape.len >= 1, ErrorCode::kInvalidArgument, flag,
                  ": batch and length must be >= 1, got '", item, "'");
    out.push_back(shape);
  }
  return out;
}

// Uniform values in [-amplitude, amplitude] from a hash of (index, seed): fills GB-sized caches
// on the device in microseconds, reproducibly.
__global__ void fill_random_bf16(__nv_bfloat16* out, size_t n, uint32_t seed, float amplitude) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) ^ seed;
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    out[i] = __float2bfloat16(amplitude * (static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f));
  }
}

void fill_random(cuda::DeviceBuffer& buf, uint32_t seed, float amplitude) {
  const size_t n = buf.bytes() / sizeof(__nv_bfloat16);
  fill_random_bf16<<<1024, 256>>>(buf.as<__nv_bfloat16>(), n, seed, amplitude);
  MOELORA_CUDA_CHECK_LAUNCH();
}

// One batch on one cache, in both the moelora layout (page table rows) and FlashInfer's (CSR
// page list + last-page length); the pages are the same.
struct Problem {
  int batch = 0, q_len = 0, kv_len = 0, page_size = 0;
  int tokens = 0, pages_per_seq = 0;
  cuda::DeviceBuffer k, v, q;
  // moelora
  cuda::DeviceBuffer page_table, q_start, q_len_d, kv_len_d, token_seq, token_pos;
  // the same pages as a CSR list, for FlashInfer's CUDA-core decode kernel (fi-decode)
  std::vector<int32_t> page_indptr_h;
  cuda::DeviceBuffer page_indices, page_indptr, last_page_len;
  // host copies of the moelora batch (FlashInferAttention plans from them)
  std::vector<int32_t> page_table_h, q_start_h, q_len_h, kv_len_h;
  ops::cuda::PagedAttentionArgs moelora_args;  // out / workspace set per contender
};

template <typename T>
cuda::DeviceBuffer upload(const std::vector<T>& v) {
  cuda::DeviceBuffer b(std::max<size_t>(v.size() * sizeof(T), 16));
  b.upload(v.data(), v.size() * sizeof(T));
  return b;
}

Problem make_problem(const Preset& p, int batch, int q_len, int kv_len, int page_size,
                     uint32_t seed) {
  Problem pr;
  pr.batch = batch;
  pr.q_len = q_len;
  pr.kv_len = kv_len;
  pr.page_size = page_size;
  pr.tokens = batch * q_len;
  pr.pages_per_seq = (kv_len + page_size - 1) / page_size;
  const int num_pages = batch * pr.pages_per_seq;
  const size_t kv_elems = size_t(num_pages) * page_size * p.hkv * p.head_dim;
  pr.k = cuda::DeviceBuffer(kv_elems * 2);
  pr.v = cuda::DeviceBuffer(kv_elems * 2);
  pr.q = cuda::DeviceBuffer(size_t(pr.tokens) * p.hq * p.head_dim * 2);
  // q ~ U(-2, 2) and k ~ U(-1, 1) give scores with a standard deviation of ~0.7 after the D^-0.5
  // scale: softmax weights far from uniform, so a wrong key or position shows in the output.
  fill_random(pr.k, seed, 1.0f);
  fill_random(pr.v, seed + 1, 1.0f);
  fill_random(pr.q, seed + 2, 2.0f);

  std::vector<int32_t> pages(num_pages);
  std::iota(pages.begin(), pages.end(), 0);
  std::shuffle(pages.begin(), pages.end(), std::mt19937(seed));
  std::vector<int32_t> page_table(size_t(batch) * pr.pages_per_seq), q_start(batch),
      q_lens(batch, q_len), kv_lens(batch, kv_len), token_seq, token_pos, last_page(batch);
  pr.page_indptr_h = {0};
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < pr.pages_per_seq; ++i)
      page_table[size_t(b) * pr.pages_per_seq + i] = pages[size_t(b) * pr.pages_per_seq + i];
    q_start[b] = b * q_len;
    for (int t = 0; t < q_len; ++t) {
      token_seq.push_back(b);
      token_pos.push_back(kv_len - q_len + t);
    }
    pr.page_indptr_h.push_back((b + 1) * pr.pages_per_seq);
    last_page[b] = kv_len - (pr.pages_per_seq - 1) * page_size;
  }
  pr.page_table_h = page_table;
  pr.q_start_h = q_start;
  pr.q_len_h = q_lens;
  pr.kv_len_h = kv_lens;
  pr.page_table = upload(page_table);
  pr.q_start = upload(q_start);
  pr.q_len_d = upload(q_lens);
  pr.kv_len_d = upload(kv_lens);
  pr.token_seq = upload(token_seq);
  pr.token_pos = upload(token_pos);
  pr.page_indices = upload(page_table);  // rows of the page table back to back = the CSR list
  pr.page_indptr = upload(pr.page_indptr_h);
  pr.last_page_len = upload(last_page);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  return pr;
}

// A kernel under test: set up once, then `launch` enqueues one full attention call on a stream.
struct Contender {
  std::string name;
  std::function<void(cudaStream_t)> launch;
  cuda::DeviceBuffer out;  // [tokens, Hq, Dv] bf16
};

Contender make_moelora(const Preset& p, Problem& pr, cuda::DeviceBuffer& workspace) {
  Contender c;
  c.name = "moelora";
  c.out = cuda::DeviceBuffer(size_t(pr.tokens) * p.hq * p.head_dim * 2);
  ops::cuda::PagedAttentionArgs a;
  a.cache.k = pr.k.as<__nv_bfloat16>();
  a.cache.v = pr.v.as<__nv_bfloat16>();
  a.cache.page_size = pr.page_size;
  a.cache.num_kv_heads = p.hkv;
  a.cache.head_dim = p.head_dim;
  a.cache.v_head_dim = p.head_dim;
  a.batch.page_table = pr.page_table.as<int32_t>();
  a.batch.max_pages_per_seq = pr.pages_per_seq;
  a.batch.q_start = pr.q_start.as<int32_t>();
  a.batch.q_len = pr.q_len_d.as<int32_t>();
  a.batch.kv_len = pr.kv_len_d.as<int32_t>();
  a.batch.token_seq = pr.token_seq.as<int32_t>();
  a.batch.token_pos = pr.token_pos.as<int32_t>();
  a.batch.max_seqs = pr.batch;
  a.batch.max_tokens = pr.tokens;
  a.batch.max_q_len = pr.q_len;
  a.batch.max_kv_len = pr.kv_len;
  a.q = pr.q.as<__nv_bfloat16>();
  a.q_stride = int64_t(p.hq) * p.head_dim;
  a.num_q_heads = p.hq;
  a.out = c.out.as<__nv_bfloat16>();
  const size_t need = ops::cuda::paged_attention_workspace_bytes(pr.tokens, p.hq, p.head_dim, pr.batch);
  if (workspace.bytes() < need) workspace = cuda::DeviceBuffer(need);
  a.workspace = workspace.get();
  pr.moelora_args = a;
  c.launch = [a](cudaStream_t s) { ops::cuda::launch_paged_attention(a, s); };
  return c;
}

// The flat split-KV decode kernel on the same problem as make_moelora (its args), with its own
// workspace (tickets zeroed once, as the engine does).
Contender make_moelora_flat(const Preset& p, const Problem& pr, cuda::DeviceBuffer& workspace) {
  Contender c;
  c.name = "moelora-flat";
  c.out = cuda::DeviceBuffer(size_t(pr.tokens) * p.hq * p.head_dim * 2);
  ops::cuda::PagedAttentionArgs a = pr.moelora_args;
  a.out = c.out.as<__nv_bfloat16>();
  workspace = cuda::DeviceBuffer(
      ops::cuda::gqa_decode_workspace_bytes(pr.batch, p.hq, p.hkv, p.head_dim));
  ops::cuda::reset_gqa_decode_workspace(workspace.get(), pr.batch, p.hkv, nullptr);
  a.workspace = workspace.get();
  c.launch = [a](cudaStream_t s) { ops::cuda::launch_gqa_decode_attention(a, s); };
  return c;
}

#ifdef MOELORA_WITH_FLASHINFER
namespace fi = flashinfer;
using FiBf16 = nv_bfloat16;
using FiVariant = fi::DefaultAttention</*custom_mask=*/false, /*sliding_window=*/false,
                                       /*soft_cap=*/false, /*alibi=*/false>;

// FlashInfer's scheduler workspaces (the sizes its Python wrappers allocate).
struct FiWorkspace {
  cuda::DeviceBuffer float_buf{size_t(256) << 20}, int_buf{size_t(8) << 20};
  void* pinned = nullptr;
  FiWorkspace() { MOELORA_CUDA_CHECK(cudaMallocHost(&pinned, int_buf.bytes())); }
  ~FiWorkspace() { cudaFreeHost(pinned); }
  FiWorkspace(const FiWorkspace&) = delete;
  FiWorkspace& operator=(const FiWorkspace&) = delete;
};

fi::paged_kv_t<FiBf16, int32_t> fi_paged_kv(const Preset& p, const Problem& pr) {
  return fi::paged_kv_t<FiBf16, int32_t>(
      p.hkv, pr.page_size, p.head_dim, pr.batch, fi::QKVLayout::kNHD, pr.k.as<FiBf16>(),
      pr.v.as<FiBf16>(), pr.page_indices.as<int32_t>(), pr.page_indptr.as<int32_t>(),
      pr.last_page_len.as<int32_t>());
}

template <int D>
Contender make_fi_decode(const Preset& p, Problem& pr, FiWorkspace& ws, cudaStream_t stream) {
  using Params = fi::BatchDecodeParams<FiBf16, FiBf16, FiBf16, int32_t>;
  Contender c;
  c.name = "fi-decode";
  c.out = cuda::DeviceBuffer(size_t(pr.tokens) * p.hq * D * 2);
  Params params(pr.q.as<FiBf16>(), /*q_rope_offset=*/nullptr, fi_paged_kv(p, pr), c.out.as<FiBf16>(),
                /*lse=*/nullptr, /*alibi=*/nullptr, p.hq, p.hq * D, D, /*window_left=*/-1,
                /*soft_cap=*/0.0f, 1.0f / std::sqrt(float(D)), /*rope_scale=*/1.0f,
                /*rope_theta=*/1e4f);
  fi::DecodePlanInfo plan;
  const int group = p.hq / p.hkv;
  auto plan_with = [&](auto estimate) {
    return fi::DecodePlan<D, fi::PosEncodingMode::kNone, FiVariant, Params>(
        ws.float_buf.get(), ws.float_buf.bytes(), ws.int_buf.get(), ws.pinned, ws.int_buf.bytes(),
        plan, pr.page_indptr_h.data(), pr.batch, p.hq, pr.page_size, /*cuda_graph=*/false, stream,
        estimate);
  };
  cudaError_t st;
  if (group == 8) {
    st = plan_with(fi::BatchDecodeWithPagedKVCacheWorkEstimationDispatched<8, D, fi::PosEncodingMode::kNone, FiVariant, Params>);
  } else {
    MOELORA_CHECK(false, ErrorCode::kUnsupported, "bench_attention: FlashInfer decode is built for GQA group 8, preset ",
                  p.name, " has ", group);
  }
  MOELORA_CUDA_CHECK(st);
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(stream));
  params.request_indices = fi::GetPtrFromBaseOffset<int32_t>(ws.int_buf.get(), plan.request_indices_offset);
  params.kv_tile_indices = fi::GetPtrFromBaseOffset<int32_t>(ws.int_buf.get(), plan.kv_tile_indices_offset);
  params.o_indptr = fi::GetPtrFromBaseOffset<int32_t>(ws.int_buf.get(), plan.o_indptr_offset);
  params.kv_chunk_size_ptr = fi::GetPtrFromBaseOffset<int32_t>(ws.int_buf.get(), plan.kv_chunk_size_ptr_offset);
  params.padded_batch_size = plan.padded_batch_size;
  FiBf16* tmp_v = nullptr;
  float* tmp_s = nullptr;
  if (plan.split_kv) {
    tmp_v = fi::GetPtrFromBaseOffset<FiBf16>(ws.float_buf.get(), plan.v_offset);
    tmp_s = fi::GetPtrFromBaseOffset<float>(ws.float_buf.get(), plan.s_offset);
  }
  c.launch = [params, tmp_v, tmp_s](cudaStream_t s) {
    MOELORA_CUDA_CHECK((fi::BatchDecodeWithPagedKVCacheDispatched<D, fi::PosEncodingMode::kNone, FiVariant>(
        params, tmp_v, tmp_s, /*enable_pdl=*/false, s)));
  };
  return c;
}

// The engine's path: ops::cuda::FlashInferAttention (FlashInfer's paged-prefill kernel), planned
// the way the engine plans it (decode: the CUDA-graph-stable uniform plan).
Contender make_fi_prefill(const Preset& p, Problem& pr, bool decode, cudaStream_t stream) {
  Contender c;
  c.name = "fi-prefill";
  c.out = cuda::DeviceBuffer(size_t(pr.tokens) * p.hq * p.head_dim * 2);
  ops::cuda::FlashInferAttentionShape shape;
  shape.num_q_heads = p.hq;
  shape.num_kv_heads = p.hkv;
  shape.head_dim = p.head_dim;
  shape.page_size = pr.page_size;
  shape.max_seqs = pr.batch;
  shape.max_tokens = pr.tokens;
  shape.max_pages_per_seq = pr.pages_per_seq;
  auto op = std::make_shared<ops::cuda::FlashInferAttention>(shape);
  ops::cuda::FlashInferHostBatch hb;
  hb.q_start = pr.q_start_h.data();
  hb.q_len = pr.q_len_h.data();
  hb.kv_len = pr.kv_len_h.data();
  hb.page_table = pr.page_table_h.data();
  hb.seqs = pr.batch;
  op->plan(hb, decode, stream);
  MOELORA_CUDA_CHECK(cudaStreamSynchronize(stream));
  ops::cuda::PagedAttentionArgs a = pr.moelora_args;
  a.out = c.out.as<__nv_bfloat16>();
  c.launch = [op, a](cudaStream_t s) { op->launch(a, s); };
  return c;
}
#endif  // MOELORA_WITH_FLASHINFER

struct Row {
  std::string preset, mode, kernel;
  int batch, q_len, kv_len;
  double us_median = 0, us_min = 0;
  double kv_bytes = 0, tbps = 0, pct_copy = 0, tflops = 0;
  double rel_diff = 0;  // vs moelora's output (0 for moelora itself)
  double vs_moelora = 1;  // this kernel's time / moelora's
};

// max |a - b| / max |b| over bf16 outputs of the same shape.
double relative_difference(const cuda::DeviceBuffer& a, const cuda::DeviceBuffer& b) {
  const size_t n = b.bytes() / 2;
  std::vector<uint16_t> ha(n), hb(n);
  a.download(ha.data(), n * 2);
  b.download(hb.data(), n * 2);
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = bf16_bits_to_f32(ha[i]), y = bf16_bits_to_f32(hb[i]);
    if (!std::isfinite(x)) return INFINITY;
    max_diff = std::max(max_diff, std::abs(x - y));
    max_ref = std::max(max_ref, std::abs(y));
  }
  return max_ref > 0 ? max_diff / max_ref : max_diff;
}

struct Options {
  std::string preset = "all";
  std::vector<Shape> decode = {{1, 4096}, {16, 1024}, {16, 4096}, {32, 1024}, {32, 2048},
                               {64, 1024}, {64, 2048}, {64, 4096}, {128, 2048}};
  std::vector<Shape> prefill = {{1, 2048}, {1, 8192}, {4, 2048}, {16, 512}};
  int reps = 30;
  int page_size = 64;
  std::string out_dir;
};

void usage() {
  std::printf(
      "bench_attention: moelora's paged GQA attention against FlashInfer's kernels on one cache\n\n"
      "  --preset NAME|all    qwen3-30b-a3b (32/4 heads, D 128), qwen3.5-35b-a3b (16/2, D 256)\n"
      "  --decode B:S,...     decode batches: B sequences with S tokens of context (one new each)\n"
      "  --prefill B:L,...    prefill batches: B sequences of L new tokens, causal, no prior context\n"
      "                       ('' skips decode or prefill)\n"
      "  --reps N             timed launches per kernel (median reported; default 30)\n"
      "  --page-size P        KV tokens per page (default 64, the engine's)\n"
      "  --out DIR            write attention.json and attention.md there\n"
      "FlashInfer kernels: %s\n",
#ifdef MOELORA_WITH_FLASHINFER
      "compiled in"
#else
      "not compiled in (scripts/setup, then reconfigure)"
#endif
  );
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      MOELORA_CHECK(i + 1 < argc, ErrorCode::kInvalidArgument, arg, " needs a value");
      return argv[++i];
    };
    if (arg == "--preset") o.preset = value();
    else if (arg == "--decode") o.decode = parse_shapes(value(), "--decode");
    else if (arg == "--prefill") o.prefill = parse_shapes(value(), "--prefill");
    else if (arg == "--reps") o.reps = std::stoi(value());
    else if (arg == "--page-size") o.page_size = std::stoi(value());
    else if (arg == "--out") o.out_dir = value();
    else if (arg == "-h" || arg == "--help") { usage(); std::exit(0); }
    else MOELORA_CHECK(false, ErrorCode::kInvalidArgument, "unknown option ", arg, " (see --help)");
  }
  MOELORA_CHECK(o.reps >= 1, ErrorCode::kInvalidArgument, "--reps must be >= 1, got ", o.reps);
  MOELORA_CHECK(o.page_size >= 16 && (o.page_size & (o.page_size - 1)) == 0,
                ErrorCode::kInvalidArgument, "--page-size must be a power of two >= 16, got ",
                o.page_size);
  return o;
}

// Median and min microseconds of `reps` single launches, each after an L2 flush.
std::pair<double, double> time_launches(const Contender& c, int reps, cudaStream_t stream,
                                        cuda::DeviceBuffer& flush) {
  for (int i = 0; i < 3; ++i) c.launch(stream);
  cuda::Event e0(true), e1(true);
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    MOELORA_CUDA_CHECK(cudaMemsetAsync(flush.get(), r & 0xff, flush.bytes(), stream));
    e0.record(stream);
    c.launch(stream);
    e1.record(stream);
    ms.push_back(cuda::Event::elapsed_ms(e0, e1));
  }
  return {median(ms) * 1e3, *std::min_element(ms.begin(), ms.end()) * 1e3};
}

}  // namespace

int run(int argc, char** argv) {
  const Options opt = parse_options(argc, argv);
  MOELORA_CHECK(cuda::device_count() > 0, ErrorCode::kUnsupported, "bench_attention needs a CUDA device");
  const cuda::DeviceInfo dev = cuda::device_info();
  const double copy_bw = measure_copy_bandwidth();
  std::printf("# %s, %d SMs, copy bandwidth %.2f TB/s, page size %d, %d reps\n", dev.name.c_str(),
              dev.num_sms, copy_bw / 1e12, opt.page_size, opt.reps);
  cuda::Stream stream;
  cuda::DeviceBuffer flush(size_t(256) << 20), workspace(16), flat_workspace(16);
#ifdef MOELORA_WITH_FLASHINFER
  FiWorkspace fi_ws;
#endif
  std::vector<Row> rows;
  bool all_match = true;
  std::printf("\n| preset | mode | B | q_len | kv_len | kernel | µs (median) | µs (min) | TB/s | %% copy | TFLOP/s | time / moelora | rel. diff |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Preset& p : kPresets) {
    if (opt.preset != "all" && opt.preset != p.name) continue;
    for (const bool decode : {true, false}) {
      for (const Shape& shape : decode ? opt.decode : opt.prefill) {
        const int q_len = decode ? 1 : shape.len;
        Problem pr = make_problem(p, shape.batch, q_len, shape.len, opt.page_size,
                                  static_cast<uint32_t>(rows.size() * 7919 + 1));
        std::vector<Contender> cs;
        cs.push_back(make_moelora(p, pr, workspace));
        if (decode && ops::cuda::gqa_decode_supports(p.hq, p.hkv, p.head_dim, p.head_dim))
          cs.push_back(make_moelora_flat(p, pr, flat_workspace));
        if (ops::cuda::FlashInferAttention::supports(p.hq, p.hkv, p.head_dim))
          cs.push_back(make_fi_prefill(p, pr, decode, stream.get()));
#ifdef MOELORA_WITH_FLASHINFER
        if (decode) {
          if (p.head_dim == 128) cs.push_back(make_fi_decode<128>(p, pr, fi_ws, stream.get()));
          else cs.push_back(make_fi_decode<256>(p, pr, fi_ws, stream.get()));
        }
#endif
        double moelora_us = 0;
        for (size_t ci = 0; ci < cs.size(); ++ci) {
          Contender& c = cs[ci];
          Row r;
          r.preset = p.name;
          r.mode = decode ? "decode" : "prefill";
          r.kernel = c.name;
          r.batch = shape.batch;
          r.q_len = q_len;
          r.kv_len = shape.len;
          c.launch(stream.get());
          stream.synchronize();
          r.rel_diff = ci == 0 ? 0.0 : relative_difference(c.out, cs[0].out);
          if (!(r.rel_diff <= 2e-2)) all_match = false;
          std::tie(r.us_median, r.us_min) = time_launches(c, opt.reps, stream.get(), flush);
          if (ci == 0) moelora_us = r.us_median;
          r.vs_moelora = r.us_median / moelora_us;
          r.kv_bytes = double(shape.batch) * shape.len * p.hkv * 2.0 * p.head_dim * 2;
          r.tbps = r.kv_bytes / (r.us_median * 1e-6) / 1e12;
          r.pct_copy = 100.0 * r.kv_bytes / (r.us_median * 1e-6) / copy_bw;
          // causal pairs: query t of q_len new tokens at position kv_len - q_len + t sees t' <= it
          const double pairs = double(shape.batch) *
                               (double(q_len) * (shape.len - q_len) + double(q_len) * (q_len + 1) / 2);
          r.tflops = 2.0 * p.hq * (2.0 * p.head_dim) * pairs / (r.us_median * 1e-6) / 1e12;
          std::printf("| %s | %s | %d | %d | %d | %s | %.1f | %.1f | %.2f | %.0f | %.0f | %.2f | %.1e |\n",
                      r.preset.c_str(), r.mode.c_str(), r.batch, r.q_len, r.kv_len, r.kernel.c_str(),
                      r.us_median, r.us_min, r.tbps, r.pct_copy, r.tflops, r.vs_moelora, r.rel_diff);
          std::fflush(stdout);
          rows.push_back(r);
        }
      }
    }
  }
  if (!opt.out_dir.empty()) {
    std::filesystem::create_directories(opt.out_dir);
    std::ofstream j(opt.out_dir + "/attention.json");
    char stamp[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    j << "{\n  \"benchmark\": \"bench_attention\",\n  \"date\": \"" << stamp << "\",\n  \"device\": \""
      << json_escape(dev.name) << "\",\n  \"copy_bandwidth_tbps\": " << copy_bw / 1e12
      << ",\n  \"page_size\": " << opt.page_size << ",\n  \"reps\": " << opt.reps
      << ",\n  \"flashinfer\": "
#ifdef MOELORA_WITH_FLASHINFER
      << "true"
#else
      << "false"
#endif
      << ",\n  \"rows\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      j << "    {\"preset\": \"" << r.preset << "\", \"mode\": \"" << r.mode << "\", \"kernel\": \""
        << r.kernel << "\", \"batch\": " << r.batch << ", \"q_len\": " << r.q_len
        << ", \"kv_len\": " << r.kv_len << ", \"us_median\": " << r.us_median
        << ", \"us_min\": " << r.us_min << ", \"kv_bytes\": " << r.kv_bytes << ", \"tbps\": " << r.tbps
        << ", \"pct_copy\": " << r.pct_copy << ", \"tflops\": " << r.tflops
        << ", \"time_vs_moelora\": " << r.vs_moelora << ", \"rel_diff\": " << r.rel_diff << "}"
        << (i + 1 < rows.size() ? ",\n" : "\n");
    }
    j << "  ]\n}\n";
    std::ofstream md(opt.out_dir + "/attention.md");
    md << "# Paged GQA attention: moelora vs FlashInfer\n\n" << dev.name << ", copy bandwidth "
       << copy_bw / 1e12 << " TB/s, page size " << opt.page_size << ", " << opt.reps
       << " launches per kernel (median, L2 flushed before each). Decode: TB/s of KV read; prefill: causal TFLOP/s.\n\n"
       << "| preset | mode | B | q_len | kv_len | kernel | µs | TB/s | % copy | TFLOP/s | time / moelora | rel. diff |\n"
       << "|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (const Row& r : rows) {
      char line[320];
      std::snprintf(line, sizeof line, "| %s | %s | %d | %d | %d | %s | %.1f | %.2f | %.0f | %.0f | %.2f | %.1e |\n",
                    r.preset.c_str(), r.mode.c_str(), r.batch, r.q_len, r.kv_len, r.kernel.c_str(),
                    r.us_median, r.tbps, r.pct_copy, r.tflops, r.vs_moelora, r.rel_diff);
      md << line;
    }
  }
  if (!all_match) {
    std::fprintf(stderr, "bench_attention: an output differs from moelora's by more than 2e-2 (rel. diff column)\n");
    return 1;
  }
  return 0;
}

}  // namespace moelora::bench

int main(int argc, char** argv) try {
  return moelora::bench::run(argc, argv);
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_attention: %s\n", e.what());
  return 1;
}
