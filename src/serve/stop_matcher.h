// Streaming text helpers for `moelora serve`: stop strings and token-by-token detokenization.
//
// The engine stops on token ids only; OpenAI's `stop` strings are found in the decoded text. A
// stop string can arrive split over several tokens ("</" + "answer>"), so text that might be the
// beginning of one is held back until the next increment decides: either the stop string
// completes (the output ends just before it, finish_reason "stop") or it cannot anymore (the
// held text is released). The client therefore never sees any part of a stop string.
//
// Both helpers only ever emit whole UTF-8 characters while streaming: a token of a byte-level BPE
// vocabulary can end in the middle of a multi-byte character, and an SSE chunk carrying half a
// character would be invalid JSON text. Bytes that never complete a character are released at
// the end as U+FFFD (what `tokenizers` decode gives for them).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "io/tokenizer.h"

namespace moelora::serve {

// Joins byte pieces (tokens' bytes) into text that ends on a character boundary.
class Utf8StreamJoiner {
 public:
  // Appends `bytes`; returns the text that is now complete (possibly empty). A byte sequence that
  // is invalid (not just incomplete) is released at once as U+FFFD.
  std::string push(std::string_view bytes);
  // The bytes still held (an unfinished character) as U+FFFD; empties the joiner.
  std::string finish();
  size_t pending_bytes() const { return pending_.size(); }

 private:
  std::string pending_;
};

// Token ids -> text increments, for streaming one generated sequence.
//
// Assumes decode(ids) is the concatenation of decode_token(id) over the ids, which holds for the
// ByteLevel decoder and for tiktoken vocabularies (io/tokenizer.h), i.e. every supported model
// family; a tokenizer.json with a null decoder (tokens joined with spaces) would lose the spaces.
// The tokenizer must outlive the detokenizer.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const io::Tokenizer& tokenizer, bool skip_special_tokens = true);
  // The text that `token` completes (may be empty while a character is unfinished).
  std::string add(int32_t token);
  // What is still held back, as U+FFFD; call once at the end of the sequence.
  std::string finish();

 private:
  const io::Tokenizer* tokenizer_;
  bool skip_special_;
  Utf8StreamJoiner joiner_;
};

// Finds stop strings in streamed text.
//
//   StopMatcher m({"\n\n", "</s>"});
//   for each text increment t:  auto r = m.feed(t); send(r.text); if (r.stopped) break;
//   at the end of generation:   send(m.flush());
//
// Invariants: generation stops as soon as the text holds a whole stop string, so the stop that
// wins is the occurrence that ends first (among those ending at the same byte, the longest), and
// the text returned by feed()/flush() over a whole stream equals the full text cut before it, or
// the full text when none occurs; this does not depend on how the text was split into
// increments. Held-back text is at most (longest stop string - 1) bytes plus an unfinished UTF-8
// character.
class StopMatcher {
 public:
  struct Step {
    std::string text;      // safe to send now
    bool stopped = false;  // a stop string was found: `text` is the last output
    std::string matched;   // that stop string
  };
  // Empty strings are ignored (they would match everywhere).
  explicit StopMatcher(std::vector<std::string> stops = {});

  // Adds an increment of decoded text. After a stop, further calls return nothing.
  Step feed(std::string_view text);
  // The held-back text once generation ended without a stop string (unfinished characters
  // become U+FFFD); empty after a stop. Empties the matcher.
  std::string flush();

  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }
  size_t held_bytes() const { return held_.size(); }

 private:
  std::vector<std::string> stops_;
  size_t max_stop_ = 0;
  std::string held_;
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace moelora::serve
