// Stop-string matching and incremental detokenization for streamed output (see stop_matcher.h).
#include "serve/stop_matcher.h"

#include <algorithm>
#include <utility>

namespace moelora::serve {

std::string Utf8StreamJoiner::push(std::string_view bytes) {
  pending_.append(bytes);
  // Everything up to the last unfinished (but so far valid) character can go; invalid bytes in
  // that prefix will never become valid, so they go out replaced.
  const size_t n = io::utf8_complete_prefix(pending_);
  std::string out = io::sanitize_utf8(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string Utf8StreamJoiner::finish() {
  std::string out = io::sanitize_utf8(pending_);
  pending_.clear();
  return out;
}

IncrementalDetokenizer::IncrementalDetokenizer(const io::Tokenizer& tokenizer,
                                               bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_(skip_special_tokens) {}

std::string IncrementalDetokenizer::add(int32_t token) {
  return joiner_.push(tokenizer_->decode_token(token, skip_special_));
}

std::string IncrementalDetokenizer::finish() {
  return joiner_.finish();
}

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (auto& s : stops) {
    if (s.empty()) continue;
    max_stop_ = std::max(max_stop_, s.size());
    stops_.push_back(std::move(s));
  }
}

StopMatcher::Step StopMatcher::feed(std::string_view text) {
  Step step;
  if (stopped_) return step;
  held_.append(text);

  // Generation stops as soon as the text holds a whole stop string: the occurrence that ends
  // first wins (among those ending at the same byte, the longest). The held text never contains
  // a whole one (an earlier call would have found it), so a hit always ends in the new text.
  size_t best_end = std::string::npos;
  size_t best_pos = 0;
  const std::string* best = nullptr;
  for (const auto& s : stops_) {
    const size_t pos = held_.find(s);
    if (pos == std::string::npos) continue;
    const size_t end = pos + s.size();
    if (end < best_end || (end == best_end && s.size() > best->size())) {
      best_end = end;
      best_pos = pos;
      best = &s;
    }
  }
  if (best) {
    stopped_ = true;
    matched_ = *best;
    step.stopped = true;
    step.matched = *best;
    step.text = io::sanitize_utf8(std::string_view(held_).substr(0, best_pos));
    held_.clear();
    return step;
  }

  // Hold back the longest suffix that is a proper prefix of some stop string: it may still
  // complete one. A stop string starting before that suffix cannot complete later (its part in
  // the buffer would be a longer such suffix), so everything before the held suffix is safe.
  size_t hold = 0;
  const size_t max_hold = std::min(held_.size(), max_stop_ > 0 ? max_stop_ - 1 : 0);
  for (size_t k = max_hold; k > 0 && hold == 0; --k) {
    const std::string_view suffix = std::string_view(held_).substr(held_.size() - k);
    for (const auto& s : stops_) {
      if (s.size() > k && s.compare(0, k, suffix) == 0) {
        hold = k;
        break;
      }
    }
  }
  // Never cut inside a character: its remaining bytes stay held with it.
  const std::string_view ready = std::string_view(held_).substr(0, held_.size() - hold);
  const size_t emit = io::utf8_complete_prefix(ready);
  step.text = io::sanitize_utf8(ready.substr(0, emit));
  held_.erase(0, emit);
  return step;
}

std::string StopMatcher::flush() {
  std::string out = stopped_ ? std::string() : io::sanitize_utf8(held_);
  held_.clear();
  return out;
}

}  // namespace moelora::serve
