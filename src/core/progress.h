// A progress bar on stderr for long work (loading a checkpoint, writing a synthetic model,
// running a benchmark). Redraws in place on a terminal; on a pipe or a log file it prints one
// line when done, so CI logs stay readable. Set MOELORA_NO_PROGRESS=1 to silence it.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace moelora {

class ProgressBar {
 public:
  // total: units of work (bytes, tensors, steps); unit: shown after the counts ("MB", "steps").
  ProgressBar(std::string label, uint64_t total, std::string unit = "");
  ~ProgressBar();
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  void advance(uint64_t n = 1);
  void set(uint64_t done);
  void finish();

 private:
  void draw(bool final_line);
  std::string label_, unit_;
  uint64_t total_, done_ = 0;
  bool interactive_, enabled_, finished_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace moelora
