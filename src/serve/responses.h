// OpenAI-compatible response bodies for `moelora serve`: completions and chat completions (whole
// and streamed as server-sent events), GET /v1/models, and error events.
//
// Builders take plain values (texts, token counts, logprobs the server computed) and return JSON;
// they do no I/O and hold no state, so the HTTP layer decides when each piece is sent. Objects are
// nlohmann::ordered_json so that keys go out in OpenAI's order (id, object, created, model, ...),
// which some clients' logs and tests read.
//
// Streaming shapes (one SSE event `data: <json>\n\n` each, then `data: [DONE]\n\n`):
//   chat:        first chunk per choice  {"delta": {"role": "assistant", "content": ""}}
//                then content chunks     {"delta": {"content": "..."}}
//                then a final chunk      {"delta": {}, "finish_reason": "stop" | "length"}
//   completions: text chunks             {"text": "...", "finish_reason": null}
//                then a final chunk      {"text": "", "finish_reason": ...}
//   with stream_options.include_usage: one more chunk with "choices": [] and "usage" before
//   [DONE]; the other chunks then carry "usage": null, as OpenAI sends them.
// Text that is not valid UTF-8 is written with U+FFFD in its place, never refused: serializing a
// response cannot fail.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "moelora/engine.h"
#include "serve/protocol.h"

namespace moelora::serve {

// Why a choice ended, as the API spells it. kNone is null (a stream chunk before the end).
enum class ChoiceFinish { kNone, kStop, kLength };
// The engine's reason mapped onto the API's: stop tokens / EOS -> kStop, max_new_tokens ->
// kLength; cancelled and failed requests have no API finish reason (kNone): the server answers
// those with an error instead.
ChoiceFinish choice_finish(FinishReason reason);

// One alternative at a position. `token` is the token's bytes (possibly part of a character).
struct TopLogprob {
  std::string token;
  double logprob = 0.0;
};
// The chosen token at a position and the top alternatives the request asked for.
struct TokenLogprob {
  std::string token;
  double logprob = 0.0;
  std::vector<TopLogprob> top;
};

// What every response and chunk of one request repeats.
struct ResponseMeta {
  std::string id;       // "cmpl-..." / "chatcmpl-..." (make_response_id)
  int64_t created = 0;  // Unix seconds
  std::string model;    // the model as the request named it (ModelSelection::requested)
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;  // over all choices
};

struct CompletionChoice {
  int32_t index = 0;
  std::string text;
  ChoiceFinish finish = ChoiceFinish::kNone;
  std::optional<std::vector<TokenLogprob>> logprobs;  // nullopt: "logprobs": null
};

struct ChatChoice {
  int32_t index = 0;
  std::string content;
  std::optional<std::string> reasoning_content;  // a reasoning parser's output, when any
  ChoiceFinish finish = ChoiceFinish::kNone;
  std::optional<std::vector<TokenLogprob>> logprobs;
};

// prefix + "-" + 24 hex digits of `sequence` mixed (so consecutive numbers do not look alike).
std::string make_response_id(std::string_view prefix, uint64_t sequence);

// ---- whole responses ----
nlohmann::ordered_json completion_response(const ResponseMeta& meta,
                                           const std::vector<CompletionChoice>& choices,
                                           const Usage& usage);
nlohmann::ordered_json chat_completion_response(const ResponseMeta& meta,
                                                const std::vector<ChatChoice>& choices,
                                                const Usage& usage);

// Logprobs in each API's shape.
//   completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: lp}, ...],
//                 "text_offset": [...]}, offsets counted in bytes from `text_offset`.
//   chat:        {"content": [{"token", "logprob", "bytes": [...], "top_logprobs": [{"token",
//                 "logprob", "bytes"}]}]}
nlohmann::ordered_json completion_logprobs_json(const std::vector<TokenLogprob>& tokens,
                                                size_t text_offset = 0);
nlohmann::ordered_json chat_logprobs_json(const std::vector<TokenLogprob>& tokens);

// ---- stream chunks ----
// `with_usage_field`: the request set include_usage, so every chunk carries "usage": null.
nlohmann::ordered_json completion_chunk(const ResponseMeta& meta, int32_t index,
                                        std::string_view text, ChoiceFinish finish,
                                        bool with_usage_field = false,
                                        const std::vector<TokenLogprob>* logprobs = nullptr,
                                        size_t text_offset = 0);
nlohmann::ordered_json chat_role_chunk(const ResponseMeta& meta, int32_t index,
                                       bool with_usage_field = false);
nlohmann::ordered_json chat_content_chunk(const ResponseMeta& meta, int32_t index,
                                          std::string_view content, bool with_usage_field = false,
                                          const std::vector<TokenLogprob>* logprobs = nullptr);
nlohmann::ordered_json chat_finish_chunk(const ResponseMeta& meta, int32_t index,
                                         ChoiceFinish finish, bool with_usage_field = false);
// The include_usage chunk: "choices": [] and the totals. `chat` picks the object name.
nlohmann::ordered_json usage_chunk(const ResponseMeta& meta, bool chat, const Usage& usage);

// SSE framing: "data: " + compact JSON + "\n\n"; the terminal "data: [DONE]\n\n".
std::string sse_event(const nlohmann::ordered_json& payload);
std::string sse_event(const nlohmann::json& payload);
std::string sse_done();
// An error in the middle of a stream (the status line has gone out already): the error object
// as one event; the server then sends sse_done().
std::string sse_error(const ApiError& error);

// GET /v1/models: the base model and every adapter ("parent" = the base; "root" = the base for
// itself and the adapter's name for an adapter). max_model_len > 0 adds it to the base entry.
nlohmann::ordered_json models_response(const ModelRegistry& registry, int64_t created,
                                       int64_t max_model_len = 0,
                                       const std::string& owned_by = "moelora");

}  // namespace moelora::serve
