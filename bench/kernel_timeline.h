// Kernel timeline of graph replays through CUPTI's activity API: which kernel ran on which stream
// from when to when (GPU timestamps), so a reader sees what overlapped and what waited. The GPU
// host has no Nsight Systems; this is the part of it the MoE benchmark needs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moelora::bench {

struct KernelRecord {
  std::string name;  // demangled function name without namespaces or parameters
  uint64_t start_ns = 0, end_ns = 0;
  uint32_t stream = 0;
  int grid = 0;       // CTAs (x * y * z)
};

// Enables concurrent-kernel activity records while alive (one at a time per process). The kernels
// that ran between start() and stop() are returned by stop(), sorted by start time; both
// synchronize the device, so one start/stop pair around one graph launch gives that replay.
class KernelTimeline {
 public:
  KernelTimeline();
  ~KernelTimeline();
  KernelTimeline(const KernelTimeline&) = delete;
  KernelTimeline& operator=(const KernelTimeline&) = delete;
  void start();
  std::vector<KernelRecord> stop();
};

// One replay's records as a table: kernel, queue (the stream it ran on, named by first
// appearance), grid, start and end in µs from the first kernel's start, duration, and the time its
// queue sat idle before it.
std::string format_timeline(const std::vector<KernelRecord>& replay);

}  // namespace moelora::bench
