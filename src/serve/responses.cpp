// Response and stream-chunk builders for the OpenAI-compatible endpoints (see responses.h).
#include "serve/responses.h"

#include <cstdio>
#include <utility>

#include "io/tokenizer.h"

namespace moelora::serve {
namespace {

using ojson = nlohmann::ordered_json;

// Generated text can hold invalid UTF-8 (a token that ends inside a character and nothing after
// it); nlohmann's dump() would throw on it, so every text is cleaned on the way in.
std::string clean(std::string_view s) {
  if (!io::find_invalid_utf8(s)) return std::string(s);
  return io::sanitize_utf8(s);
}

ojson finish_json(ChoiceFinish finish) {
  switch (finish) {
    case ChoiceFinish::kStop: return "stop";
    case ChoiceFinish::kLength: return "length";
    case ChoiceFinish::kNone: break;
  }
  return nullptr;
}

ojson usage_json(const Usage& usage) {
  return ojson{{"prompt_tokens", usage.prompt_tokens},
               {"completion_tokens", usage.completion_tokens},
               {"total_tokens", usage.prompt_tokens + usage.completion_tokens}};
}

ojson head(const ResponseMeta& meta, const char* object) {
  return ojson{{"id", clean(meta.id)},
               {"object", object},
               {"created", meta.created},
               {"model", clean(meta.model)}};
}

// The raw bytes of a token as integers (the chat API's "bytes": lets a client rebuild characters
// split across tokens).
ojson bytes_json(const std::string& token) {
  ojson out = ojson::array();
  for (unsigned char c : token) out.push_back(static_cast<int>(c));
  return out;
}

ojson chunk(const ResponseMeta& meta, const char* object, ojson choice, bool with_usage_field) {
  ojson out = head(meta, object);
  out["choices"] = ojson::array({std::move(choice)});
  if (with_usage_field) out["usage"] = nullptr;
  return out;
}

uint64_t mix64(uint64_t x) {  // splitmix64's finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

ChoiceFinish choice_finish(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop: return ChoiceFinish::kStop;
    case FinishReason::kLength: return ChoiceFinish::kLength;
    default: return ChoiceFinish::kNone;
  }
}

std::string make_response_id(std::string_view prefix, uint64_t sequence) {
  const uint64_t a = mix64(sequence);
  const uint64_t b = mix64(a ^ sequence);
  char hex[32];
  std::snprintf(hex, sizeof(hex), "%016llx%08llx", static_cast<unsigned long long>(a),
                static_cast<unsigned long long>(b >> 32));
  return std::string(prefix) + "-" + hex;
}

ojson completion_logprobs_json(const std::vector<TokenLogprob>& tokens, size_t text_offset) {
  ojson texts = ojson::array(), lps = ojson::array(), tops = ojson::array(),
        offsets = ojson::array();
  size_t offset = text_offset;
  for (const auto& t : tokens) {
    texts.push_back(clean(t.token));
    lps.push_back(t.logprob);
    ojson top = ojson::object();
    for (const auto& alt : t.top) top[clean(alt.token)] = alt.logprob;
    tops.push_back(std::move(top));
    offsets.push_back(offset);
    offset += t.token.size();
  }
  return ojson{{"tokens", std::move(texts)},
               {"token_logprobs", std::move(lps)},
               {"top_logprobs", std::move(tops)},
               {"text_offset", std::move(offsets)}};
}

ojson chat_logprobs_json(const std::vector<TokenLogprob>& tokens) {
  ojson content = ojson::array();
  for (const auto& t : tokens) {
    ojson top = ojson::array();
    for (const auto& alt : t.top) {
      top.push_back(ojson{
          {"token", clean(alt.token)}, {"logprob", alt.logprob}, {"bytes", bytes_json(alt.token)}});
    }
    content.push_back(ojson{{"token", clean(t.token)},
                            {"logprob", t.logprob},
                            {"bytes", bytes_json(t.token)},
                            {"top_logprobs", std::move(top)}});
  }
  return ojson{{"content", std::move(content)}};
}

ojson completion_response(const ResponseMeta& meta, const std::vector<CompletionChoice>& choices,
                          const Usage& usage) {
  ojson out = head(meta, "text_completion");
  ojson list = ojson::array();
  for (const auto& c : choices) {
    list.push_back(ojson{{"index", c.index},
                         {"text", clean(c.text)},
                         {"logprobs", c.logprobs ? completion_logprobs_json(*c.logprobs) : ojson()},
                         {"finish_reason", finish_json(c.finish)}});
  }
  out["choices"] = std::move(list);
  out["usage"] = usage_json(usage);
  return out;
}

ojson chat_completion_response(const ResponseMeta& meta, const std::vector<ChatChoice>& choices,
                               const Usage& usage) {
  ojson out = head(meta, "chat.completion");
  ojson list = ojson::array();
  for (const auto& c : choices) {
    ojson message = {{"role", "assistant"}, {"content", clean(c.content)}};
    if (c.reasoning_content) message["reasoning_content"] = clean(*c.reasoning_content);
    list.push_back(ojson{{"index", c.index},
                         {"message", std::move(message)},
                         {"logprobs", c.logprobs ? chat_logprobs_json(*c.logprobs) : ojson()},
                         {"finish_reason", finish_json(c.finish)}});
  }
  out["choices"] = std::move(list);
  out["usage"] = usage_json(usage);
  return out;
}

ojson completion_chunk(const ResponseMeta& meta, int32_t index, std::string_view text,
                       ChoiceFinish finish, bool with_usage_field,
                       const std::vector<TokenLogprob>* logprobs, size_t text_offset) {
  ojson choice = {
      {"index", index},
      {"text", clean(text)},
      {"logprobs", logprobs ? completion_logprobs_json(*logprobs, text_offset) : ojson()},
      {"finish_reason", finish_json(finish)}};
  return chunk(meta, "text_completion", std::move(choice), with_usage_field);
}

ojson chat_role_chunk(const ResponseMeta& meta, int32_t index, bool with_usage_field) {
  ojson choice = {{"index", index},
                  {"delta", {{"role", "assistant"}, {"content", ""}}},
                  {"logprobs", nullptr},
                  {"finish_reason", nullptr}};
  return chunk(meta, "chat.completion.chunk", std::move(choice), with_usage_field);
}

ojson chat_content_chunk(const ResponseMeta& meta, int32_t index, std::string_view content,
                         bool with_usage_field, const std::vector<TokenLogprob>* logprobs) {
  ojson choice = {{"index", index},
                  {"delta", {{"content", clean(content)}}},
                  {"logprobs", logprobs ? chat_logprobs_json(*logprobs) : ojson()},
                  {"finish_reason", nullptr}};
  return chunk(meta, "chat.completion.chunk", std::move(choice), with_usage_field);
}

ojson chat_finish_chunk(const ResponseMeta& meta, int32_t index, ChoiceFinish finish,
                        bool with_usage_field) {
  ojson choice = {{"index", index},
                  {"delta", ojson::object()},
                  {"logprobs", nullptr},
                  {"finish_reason", finish_json(finish)}};
  return chunk(meta, "chat.completion.chunk", std::move(choice), with_usage_field);
}

ojson usage_chunk(const ResponseMeta& meta, bool chat, const Usage& usage) {
  ojson out = head(meta, chat ? "chat.completion.chunk" : "text_completion");
  out["choices"] = ojson::array();
  out["usage"] = usage_json(usage);
  return out;
}

std::string sse_event(const ojson& payload) {
  return "data: " + payload.dump(-1, ' ', false, ojson::error_handler_t::replace) + "\n\n";
}

std::string sse_event(const nlohmann::json& payload) {
  return "data: " + payload.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n\n";
}

std::string sse_done() {
  return "data: [DONE]\n\n";
}

std::string sse_error(const ApiError& error) {
  return sse_event(error.to_json());
}

ojson models_response(const ModelRegistry& registry, int64_t created, int64_t max_model_len,
                      const std::string& owned_by) {
  const std::string base = clean(registry.base_model());
  ojson data = ojson::array();
  ojson base_entry = {{"id", base},           {"object", "model"}, {"created", created},
                      {"owned_by", owned_by}, {"root", base},      {"parent", nullptr}};
  if (max_model_len > 0) base_entry["max_model_len"] = max_model_len;
  data.push_back(std::move(base_entry));
  for (const auto& name : registry.adapter_names()) {
    const std::string id = clean(name);
    data.push_back(ojson{{"id", id},
                         {"object", "model"},
                         {"created", created},
                         {"owned_by", owned_by},
                         {"root", id},
                         {"parent", base}});
  }
  return ojson{{"object", "list"}, {"data", std::move(data)}};
}

}  // namespace moelora::serve
