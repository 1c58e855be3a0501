// Hugging Face chat templates: messages (OpenAI chat format) -> prompt text, as
// transformers' tokenizer.apply_chat_template(messages, tokenize=False, ...) produces it.
//
// A template is Jinja2 source shipped with the model. ChatTemplate finds it the way transformers
// does and renders it with moelora's own Jinja2 interpreter (chat/jinja.h), which covers what
// the Qwen3, Qwen3.5, DeepSeek-V3 and Kimi-K2.5 templates use; a template that needs more fails
// when it is loaded (unknown filter, test or tag), not in the middle of a request.
//
// Loading from a model folder:
//   1. chat_template.jinja, if present, is the default template (it overrides the config, as in
//      transformers); additional_chat_templates/<name>.jinja are named templates;
//   2. otherwise tokenizer_config.json "chat_template": a string, or a list of {name, template}
//      whose "default" entry is the default;
//   3. otherwise chat_template.json {"chat_template": "..."} (processor templates).
// tokenizer_config.json also gives the special tokens the template sees: bos_token, eos_token,
// unk_token, pad_token, sep_token, cls_token, mask_token (strings or {"content": ...} objects),
// additional_special_tokens.
//
// Rendering passes the template what transformers passes: messages, tools (None when absent),
// documents (None), add_generation_prompt, the special tokens, then the caller's extra variables
// (enable_thinking, thinking, ...; they override special tokens). JSON objects keep their key
// order (nlohmann::ordered_json), which matters for tojson of tool schemas and arguments.
//
// Errors are moelora::Error. Their messages name where the template failed:
//   "<origin> line 87 column 12: No user query found in messages."
//   kInvalidFile    malformed template or config file (syntax error);
//   kUnsupported    a filter, test or statement this interpreter does not implement;
//   kNotFound       no template (or no template of that name) in the folder;
//   kInvalidArgument the template rejected the input: raise_exception(...) or a Python-level
//                   error on the data (undefined attribute chain, str + dict, ...);
//   kOutOfRange     a render limit was hit (RenderLimits).
//
// Thread safety: a loaded ChatTemplate is immutable; render() may run concurrently. Copies are
// cheap and share the parsed template.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace moelora::chat {

// Bounds on one render, so that a hostile template or request cannot exhaust the machine
// (jinja2 loops always end, but macros can recurse and strings can double in a loop).
struct RenderLimits {
  size_t max_output_bytes = size_t{64} << 20;  // rendered text, and any one string value
  int max_call_depth = 100;                    // nested macro calls
  uint64_t max_steps = 50'000'000;             // statements + expressions evaluated
};

class ChatTemplate {
 public:
  // Loads the default template (`name` empty or "default") or a named one from a model folder.
  static ChatTemplate load(const std::filesystem::path& model_dir, std::string_view name = {});

  // A template from source. `special_tokens` is an object of template variables such as
  // {"bos_token": "<s>", "eos_token": "</s>"}; `origin` names the template in messages.
  static ChatTemplate from_source(
      std::string_view source,
      const nlohmann::ordered_json& special_tokens = nlohmann::ordered_json::object(),
      std::string origin = "chat template");

  // Renders `messages` (a JSON array of message objects). `tools`: the request's tool schemas
  // (a JSON array), absent -> None in the template. `kwargs`: extra template variables (a JSON
  // object), e.g. {"enable_thinking": false}.
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     const std::optional<nlohmann::ordered_json>& tools = std::nullopt,
                     const nlohmann::ordered_json& kwargs = nlohmann::ordered_json::object()) const;

  const std::string& source() const;
  const std::string& origin() const;
  const nlohmann::ordered_json& special_tokens() const;
  // Names of the other templates found next to this one (named templates), sorted.
  const std::vector<std::string>& other_template_names() const;

  void set_limits(const RenderLimits& limits);
  const RenderLimits& limits() const;

  struct Impl;

 private:
  explicit ChatTemplate(std::shared_ptr<const Impl> impl);
  std::shared_ptr<const Impl> impl_;
  RenderLimits limits_;
};

}  // namespace moelora::chat
