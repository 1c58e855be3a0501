#include "kernel_timeline.h"

#include <cuda_runtime.h>
#include <cxxabi.h>
#ifdef MOELORA_HAVE_CUPTI
#include <cupti.h>
#endif

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>

namespace moelora::bench {
namespace {

#ifdef MOELORA_HAVE_CUPTI
std::mutex g_mutex;
std::vector<KernelRecord> g_records;
bool g_collect = false;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  throw std::runtime_error(std::string("kernel timeline: ") + what + " failed: " + (msg ? msg : "?") +
                           " (is libcupti from the CUDA toolkit on LD_LIBRARY_PATH?)");
}

// "moelora::ops::cuda::(anonymous namespace)::moe_gemm_fp8_stream_kernel(CUtensorMap_st, ...)"
// -> "moe_gemm_fp8_stream_kernel"; template arguments are kept ("lora_expand_segment_kernel<2>").
std::string short_name(const char* mangled) {
  if (!mangled) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = (status == 0 && d) ? d : mangled;
  std::free(d);
  int depth = 0;
  size_t cut = s.size();
  for (size_t i = 0; i < s.size(); ++i) {  // the parameter list: the first '(' outside <>
    if (s[i] == '<') ++depth;
    else if (s[i] == '>') --depth;
    else if (s[i] == '(' && depth == 0 && s.compare(i, 11, "(anonymous ") != 0) {
      cut = i;
      break;
    }
  }
  s.resize(cut);
  depth = 0;
  size_t begin = 0;
  for (size_t i = 0; i + 1 < s.size(); ++i) {  // drop namespaces: the last "::" outside <>
    if (s[i] == '<') ++depth;
    else if (s[i] == '>') --depth;
    else if (depth == 0 && s[i] == ':' && s[i + 1] == ':') begin = i + 2;
  }
  return s.substr(begin);
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t(8) << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* record = nullptr;
  std::lock_guard<std::mutex> lock(g_mutex);
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || !g_collect) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
    g_records.push_back({short_name(k->name), k->start, k->end, k->streamId,
                         k->gridX * k->gridY * k->gridZ});
  }
  std::free(buffer);
}

}  // namespace

KernelTimeline::KernelTimeline() {
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable");
}

KernelTimeline::~KernelTimeline() {
  cuptiActivityFlushAll(1);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
}

void KernelTimeline::start() {
  cudaDeviceSynchronize();
  cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_records.clear();
  g_collect = true;
}

std::vector<KernelRecord> KernelTimeline::stop() {
  cudaDeviceSynchronize();
  check(cuptiActivityFlushAll(1), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(g_mutex);
  g_collect = false;
  std::vector<KernelRecord> out;
  out.swap(g_records);
  std::sort(out.begin(), out.end(), [](const KernelRecord& a, const KernelRecord& b) { return a.start_ns < b.start_ns; });
  return out;
}

#else
}  // namespace

KernelTimeline::KernelTimeline() {
  throw std::runtime_error(
      "kernel timeline: this bench_moe_layer was built without CUPTI (CMake found no CUDA::cupti); "
      "rebuild with the CUDA toolkit's CUPTI (extras/CUPTI) to use --timeline");
}
KernelTimeline::~KernelTimeline() = default;
void KernelTimeline::start() {}
std::vector<KernelRecord> KernelTimeline::stop() { return {}; }
#endif

std::string format_timeline(const std::vector<KernelRecord>& replay) {
  if (replay.empty()) return "(no kernels)\n";
  const uint64_t t0 = replay.front().start_ns;
  std::map<uint32_t, std::string> stream_names;
  std::map<uint32_t, uint64_t> stream_last_end;
  std::string out;
  char line[256];
  std::snprintf(line, sizeof line, "| %-36s | %-6s | %6s | %8s | %8s | %8s | %9s |\n", "kernel", "queue", "CTAs",
                "start us", "end us", "dur us", "idle us");
  out += line;
  out += "|---|---|---|---|---|---|---|\n";
  uint64_t end = 0;
  for (const auto& r : replay) {
    // A graph replay runs its branches on hardware queues of the driver's choosing: name them by
    // first appearance (q0 = the first kernel's) rather than by the capturing streams.
    if (!stream_names.count(r.stream)) {
      char name[16];
      std::snprintf(name, sizeof name, "q%zu", stream_names.size());
      stream_names[r.stream] = name;
    }
    // time the stream sat between its previous kernel's end and this one's start
    const double idle = stream_last_end.count(r.stream) && r.start_ns > stream_last_end[r.stream]
                            ? (r.start_ns - stream_last_end[r.stream]) / 1e3
                            : 0.0;
    stream_last_end[r.stream] = std::max(stream_last_end[r.stream], r.end_ns);
    end = std::max(end, r.end_ns);
    std::snprintf(line, sizeof line, "| %-36s | %-6s | %6d | %8.1f | %8.1f | %8.1f | %9.1f |\n", r.name.substr(0, 36).c_str(),
                  stream_names[r.stream].c_str(), r.grid, (r.start_ns - t0) / 1e3, (r.end_ns - t0) / 1e3,
                  (r.end_ns - r.start_ns) / 1e3, idle);
    out += line;
  }
  std::snprintf(line, sizeof line, "span %.1f us (first kernel start to last kernel end)\n", (end - t0) / 1e3);
  out += line;
  return out;
}

}  // namespace moelora::bench
