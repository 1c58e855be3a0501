#include "core/progress.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

namespace moelora {

ProgressBar::ProgressBar(std::string label, uint64_t total, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total) {
  const char* off = std::getenv("MOELORA_NO_PROGRESS");
  enabled_ = !(off && *off && *off != '0');
  interactive_ = isatty(STDERR_FILENO) != 0;
  start_ = last_draw_ = std::chrono::steady_clock::now();
}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::advance(uint64_t n) { set(done_ + n); }

void ProgressBar::set(uint64_t done) {
  done_ = done;
  if (!enabled_ || !interactive_ || finished_) return;
  auto now = std::chrono::steady_clock::now();
  if (now - last_draw_ < std::chrono::milliseconds(100) && done_ < total_) return;
  last_draw_ = now;
  draw(false);
}

void ProgressBar::finish() {
  if (finished_) return;
  finished_ = true;
  if (enabled_) draw(true);
}

void ProgressBar::draw(bool final_line) {
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double fraction = total_ ? static_cast<double>(done_) / static_cast<double>(total_) : 1.0;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(fraction * kWidth + 0.5);
  std::string bar(static_cast<size_t>(std::min(filled, kWidth)), '#');
  bar.resize(kWidth, '.');
  const double eta = fraction > 0 && !final_line ? seconds / fraction - seconds : 0.0;
  char line[512];
  std::snprintf(line, sizeof line, "%s [%s] %3.0f%% %llu/%llu%s%s %.1fs%s", label_.c_str(), bar.c_str(),
                fraction * 100, static_cast<unsigned long long>(done_), static_cast<unsigned long long>(total_),
                unit_.empty() ? "" : " ", unit_.c_str(), seconds, final_line ? "" : "");
  if (interactive_) {
    std::fprintf(stderr, "\r%s", line);
    if (!final_line && eta > 0) std::fprintf(stderr, " eta %.0fs   ", eta);
    if (final_line) std::fprintf(stderr, "\n");
  } else if (final_line) {
    std::fprintf(stderr, "%s\n", line);
  }
  std::fflush(stderr);
}

}  // namespace moelora
