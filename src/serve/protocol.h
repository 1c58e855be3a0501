// OpenAI-compatible request protocol for `moelora serve`: JSON bodies of POST /v1/completions and
// POST /v1/chat/completions -> validated request structs, and adapter selection by model name.
//
// This layer knows no HTTP and no engine threads: the server hands it a parsed body and gets back
// either a request or an ApiError that already carries the HTTP status and OpenAI's error JSON
// ({"error": {"message", "type", "param", "code"}}). Every message names the field, what it
// expects and what it got ("'temperature' must be a number in [0, 2]; got 3.5"), so a client can
// fix the request from one line. Nothing here throws past the public functions on bad input: the
// parsers catch everything and bound what a body can make them walk (array lengths, nesting,
// integer ranges; see ProtocolLimits).
//
// Fields the engine cannot honour yet are still parsed and validated, so that a request is either
// served as asked or refused with a clear 400; never silently changed:
//   - stop strings and n > 1: parsed into GenerationParams; the server implements them above
//     the engine (stop_matcher.h cuts stop strings from the text; n choices are n engine
//     requests with seeds seed, seed + 1, ...);
//   - logprobs / top_logprobs: parsed into GenerationParams (the engine reports them with each
//     token, SamplingParams::logprobs); a server without them sets
//     ProtocolLimits::logprobs_supported to false and such requests get a 400 naming the field;
//   - min_p, presence_penalty, frequency_penalty, repetition_penalty: the engine has no such
//     sampler stage, so only their neutral value is accepted (0, or 1 for repetition_penalty);
//   - echo, suffix, best_of != n, non-empty logit_bias: refused ("unsupported_parameter").
// Unknown fields are ignored, as OpenAI-compatible servers do (clients send vendor extras).
//
// Adapter selection (resolve_model): `model` = the base name -> base model; `model` = an adapter
// name (vLLM form); `model` = "BASE:ADAPTER" (SGLang form); `lora_path` = an adapter name in the
// body (SGLang form; `model` may then be absent, the base name, or name the same adapter).
// A name that is none of these -> 404 with code "model_not_found". An absent or null `model`
// selects the base model (the server serves exactly one).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include "moelora/engine.h"

namespace moelora::serve {

// An error answer: the HTTP status and the fields of OpenAI's error object. `param` names the
// offending field ("messages[2].content"), empty = null; `code` is a short machine-readable
// reason ("invalid_type", "out_of_range", "invalid_value", "unsupported_parameter",
// "missing_required_parameter", "model_not_found", "invalid_json"), empty = null.
struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;
  std::string code;
  // {"error": {"message": ..., "type": ..., "param": ... | null, "code": ... | null}}
  nlohmann::json to_json() const;
};

// A value or an ApiError. Access value() only when is_ok().
template <typename T>
class ApiResult {
 public:
  ApiResult(T value) : v_(std::move(value)) {}         // NOLINT: implicit by design
  ApiResult(ApiError error) : v_(std::move(error)) {}  // NOLINT
  bool is_ok() const { return std::holds_alternative<T>(v_); }
  T& value() { return std::get<T>(v_); }
  const T& value() const { return std::get<T>(v_); }
  const ApiError& error() const { return std::get<ApiError>(v_); }

 private:
  std::variant<T, ApiError> v_;
};

// Bounds on what one request may ask for. The defaults are far above real use and keep a hostile
// body from making the server allocate or loop without bound.
struct ProtocolLimits {
  int32_t max_n = 1;               // choices per request the server generates
  int32_t max_logprobs = 20;       // OpenAI's cap on logprobs / top_logprobs
  bool logprobs_supported = true;  // false: any logprobs request is a 400
  // Stop strings: OpenAI allows 4; vLLM and SGLang take any number. 16 covers the templates of
  // every supported model family with room to spare.
  size_t max_stop_strings = 16;
  size_t max_stop_bytes = 256;  // one stop string, UTF-8 bytes
  size_t max_stop_token_ids = 256;
  size_t max_prompt_tokens = size_t{1} << 20;  // token ids in one prompt
  size_t max_prompt_bytes = size_t{64} << 20;  // prompt text / all message text together
  size_t max_messages = 16384;
  size_t max_content_parts = 4096;              // parts of one message's content array
  int64_t max_tokens_limit = int64_t{1} << 30;  // max_tokens above this is refused outright
  int64_t vocab_size = 0;                       // > 0: prompt and stop token ids must be below it
  int max_json_depth = 64;                      // nesting of any value (tools, kwargs, ...)
  size_t max_body_bytes = size_t{256} << 20;    // parse_json_body
};

// The base model and the adapters the server can serve. The server implements it over the
// engine's adapter list (adapters may come and go while it runs); StaticModelRegistry is a fixed
// one.
class ModelRegistry {
 public:
  virtual ~ModelRegistry() = default;
  virtual std::string base_model() const = 0;
  virtual bool has_adapter(std::string_view name) const = 0;
  // Sorted, for GET /v1/models.
  virtual std::vector<std::string> adapter_names() const = 0;
};

class StaticModelRegistry final : public ModelRegistry {
 public:
  StaticModelRegistry(std::string base, std::vector<std::string> adapters);
  std::string base_model() const override { return base_; }
  bool has_adapter(std::string_view name) const override;
  std::vector<std::string> adapter_names() const override { return adapters_; }

 private:
  std::string base_;
  std::vector<std::string> adapters_;  // sorted, unique
};

// Which model a request runs on.
struct ModelSelection {
  std::string requested;  // the `model` field as sent (the base name when absent); echoed back
  std::string base;
  std::string adapter;  // "" = base model only
};

// Sampling and output settings shared by both endpoints.
struct GenerationParams {
  std::optional<int64_t> max_tokens;  // nullopt: the server's default (context left)
  double temperature = 1.0;           // OpenAI's default; 0 = greedy
  double top_p = 1.0;                 // (0, 1]
  int64_t top_k = 0;                  // 0 = off (-1, vLLM's "off", is mapped to 0)
  std::optional<uint64_t> seed;       // nullopt: the server picks one
  std::vector<std::string> stop;      // stop strings, non-empty, cut from the output
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  int32_t n = 1;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // Top alternatives to report per token: nullopt = no logprobs at all; 0 = only the chosen
  // token's logprob (completions logprobs=0, chat logprobs=true without top_logprobs).
  std::optional<int32_t> logprobs;
  bool skip_special_tokens = true;
};

struct CompletionRequest {
  ModelSelection model;
  // Exactly one of the two holds the prompt (prompt_is_tokens says which).
  bool prompt_is_tokens = false;
  std::string prompt_text;
  std::vector<int32_t> prompt_tokens;
  GenerationParams params;
};

struct ChatCompletionRequest {
  ModelSelection model;
  // The messages normalized for chat::ChatTemplate::render: every content is a string (text
  // parts joined with "\n", as vLLM does) or null; name, tool_calls, tool_call_id and
  // reasoning_content kept when present. Key order of the body is kept (ordered_json), which
  // tojson in templates depends on.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  std::optional<nlohmann::ordered_json> tools;  // array of tool schemas, as sent
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
  bool add_generation_prompt = true;
  GenerationParams params;
};

// Body text -> JSON: 400 "invalid_json" for bad syntax, a body larger than max_body_bytes or
// nesting deeper than max_json_depth (checked before parsing, so no deep recursion).
ApiResult<nlohmann::ordered_json> parse_json_body(std::string_view body,
                                                  const ProtocolLimits& limits = {});

// The model named by `model` / `lora_path` of `body` (see the file comment).
ApiResult<ModelSelection> resolve_model(const nlohmann::ordered_json& body,
                                        const ModelRegistry& registry);

ApiResult<CompletionRequest> parse_completion_request(const nlohmann::ordered_json& body,
                                                      const ModelRegistry& registry,
                                                      const ProtocolLimits& limits = {});
ApiResult<ChatCompletionRequest> parse_chat_completion_request(const nlohmann::ordered_json& body,
                                                               const ModelRegistry& registry,
                                                               const ProtocolLimits& limits = {});

// The engine's sampling settings for one choice. `default_max_tokens` applies when the request
// gave none; `choice` (0..n-1) offsets the seed so that n choices differ. The engine stops on
// token ids only: stop strings stay with the server (StopMatcher).
moelora::SamplingParams to_engine_sampling(const GenerationParams& params,
                                           int64_t default_max_tokens, uint64_t default_seed,
                                           int32_t choice = 0);

}  // namespace moelora::serve
