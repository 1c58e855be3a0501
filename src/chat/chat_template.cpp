// ChatTemplate (chat_template.h): finding a model's chat template the way transformers does,
// and rendering it with the render variables transformers passes.
#include "chat/chat_template.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "chat/jinja.h"
#include "core/error.h"

namespace moelora::chat {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

struct ChatTemplate::Impl {
  std::string source;
  std::string origin;
  ordered_json special_tokens = ordered_json::object();
  std::vector<std::string> other_names;
  std::shared_ptr<const jinja::Template> parsed;
};

namespace {

[[noreturn]] void rethrow(const jinja::TemplateError& e, const std::string& origin) {
  std::string message = origin;
  if (e.line > 0)
    message += " line " + std::to_string(e.line) + " column " + std::to_string(e.column);
  message += ": " + e.message;
  throw Error(e.code, std::move(message), __FILE__, __LINE__);
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  MOELORA_CHECK(in.good(), ErrorCode::kNotFound, "cannot open ", path.string());
  std::ostringstream text;
  text << in.rdbuf();
  MOELORA_CHECK(!in.bad(), ErrorCode::kInvalidFile, "error reading ", path.string());
  return text.str();
}

ordered_json read_json(const fs::path& path) {
  const std::string text = read_text(path);
  try {
    return ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    MOELORA_THROW(ErrorCode::kInvalidFile, path.string(), ": invalid JSON: ", e.what());
  }
}

// tokenizer_config.json special tokens: "<s>" or {"__type": "AddedToken", "content": "<s>", ...}.
ordered_json special_tokens_of(const ordered_json& config, const std::string& where) {
  ordered_json tokens = ordered_json::object();
  if (!config.is_object()) return tokens;
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                          "cls_token", "mask_token"}) {
    const auto it = config.find(key);
    if (it == config.end() || it->is_null()) continue;
    if (it->is_string()) {
      tokens[key] = *it;
    } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
      tokens[key] = (*it)["content"];
    } else {
      MOELORA_THROW(ErrorCode::kInvalidFile, where, ": ", key,
                    " must be a string or {\"content\": string}, got ", it->dump());
    }
  }
  if (const auto it = config.find("additional_special_tokens");
      it != config.end() && it->is_array()) {
    ordered_json extra = ordered_json::array();
    for (const auto& t : *it) {
      if (t.is_string()) {
        extra.push_back(t);
      } else if (t.is_object() && t.contains("content") && t["content"].is_string()) {
        extra.push_back(t["content"]);
      }
    }
    tokens["additional_special_tokens"] = std::move(extra);
  }
  return tokens;
}

struct Found {
  std::string source;
  std::string origin;
};

}  // namespace

ChatTemplate::ChatTemplate(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}

ChatTemplate ChatTemplate::from_source(std::string_view source, const ordered_json& special_tokens,
                                       std::string origin) {
  MOELORA_CHECK(special_tokens.is_object(), ErrorCode::kInvalidArgument,
                "special tokens must be a JSON object, got ", special_tokens.type_name());
  auto impl = std::make_shared<Impl>();
  impl->source = std::string(source);
  impl->origin = std::move(origin);
  impl->special_tokens = special_tokens;
  try {
    impl->parsed = jinja::parse(impl->source);
  } catch (const jinja::TemplateError& e) {
    rethrow(e, impl->origin);
  }
  return ChatTemplate(std::move(impl));
}

ChatTemplate ChatTemplate::load(const fs::path& model_dir, std::string_view name) {
  std::error_code ec;
  MOELORA_CHECK(fs::is_directory(model_dir, ec), ErrorCode::kNotFound, "model folder ",
                model_dir.string(), " does not exist");
  const fs::path config_path = model_dir / "tokenizer_config.json";
  ordered_json config = ordered_json::object();
  if (fs::is_regular_file(config_path, ec)) config = read_json(config_path);
  MOELORA_CHECK(config.is_object(), ErrorCode::kInvalidFile, config_path.string(),
                ": expected a JSON object");

  std::optional<Found> default_template;
  std::map<std::string, Found> named;
  const fs::path jinja_path = model_dir / "chat_template.jinja";
  if (fs::is_regular_file(jinja_path, ec)) {
    default_template = Found{read_text(jinja_path), jinja_path.string()};
  } else if (const auto it = config.find("chat_template"); it != config.end() && !it->is_null()) {
    const std::string where = config_path.string() + " chat_template";
    if (it->is_string()) {
      default_template = Found{it->get<std::string>(), where};
    } else {
      MOELORA_CHECK(it->is_array(), ErrorCode::kInvalidFile, where,
                    " must be a string or a list of {name, template}, got ", it->type_name());
      for (size_t i = 0; i < it->size(); ++i) {
        const ordered_json& entry = (*it)[i];
        MOELORA_CHECK(entry.is_object() && entry.contains("name") && entry["name"].is_string() &&
                          entry.contains("template") && entry["template"].is_string(),
                      ErrorCode::kInvalidFile, where, "[", i,
                      "] must be {\"name\": string, \"template\": string}");
        const std::string entry_name = entry["name"].get<std::string>();
        Found found{entry["template"].get<std::string>(), where + "[" + entry_name + "]"};
        if (entry_name == "default") {
          default_template = std::move(found);
        } else {
          named[entry_name] = std::move(found);
        }
      }
    }
  } else if (const fs::path processor = model_dir / "chat_template.json";
             fs::is_regular_file(processor, ec)) {
    const ordered_json j = read_json(processor);
    MOELORA_CHECK(j.is_object() && j.contains("chat_template") && j["chat_template"].is_string(),
                  ErrorCode::kInvalidFile, processor.string(),
                  ": expected {\"chat_template\": string}");
    default_template = Found{j["chat_template"].get<std::string>(), processor.string()};
  }
  const fs::path extra_dir = model_dir / "additional_chat_templates";
  if (fs::is_directory(extra_dir, ec)) {
    for (const auto& entry : fs::directory_iterator(extra_dir, ec)) {
      if (entry.path().extension() == ".jinja") {
        named[entry.path().stem().string()] = Found{read_text(entry.path()), entry.path().string()};
      }
    }
  }

  std::vector<std::string> names;
  for (const auto& [n, found] : named) names.push_back(n);
  const std::string available = names.empty() ? "none" : [&] {
    std::string s;
    for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
    return s;
  }();
  const Found* chosen = nullptr;
  if (name.empty() || name == "default") {
    MOELORA_CHECK(default_template.has_value(), ErrorCode::kNotFound,
                  "no default chat template in ", model_dir.string(),
                  " (looked for chat_template.jinja, tokenizer_config.json \"chat_template\", ",
                  "chat_template.json); named templates: ", available);
    chosen = &*default_template;
  } else {
    const auto it = named.find(std::string(name));
    MOELORA_CHECK(it != named.end(), ErrorCode::kNotFound, "no chat template named '", name,
                  "' in ", model_dir.string(), "; named templates: ", available);
    chosen = &it->second;
  }
  ChatTemplate t =
      from_source(chosen->source, special_tokens_of(config, config_path.string()), chosen->origin);
  auto impl = std::make_shared<Impl>(*t.impl_);
  impl->other_names = std::move(names);
  return ChatTemplate(std::move(impl));
}

std::string ChatTemplate::render(const ordered_json& messages, bool add_generation_prompt,
                                 const std::optional<ordered_json>& tools,
                                 const ordered_json& kwargs) const {
  MOELORA_CHECK(messages.is_array(), ErrorCode::kInvalidArgument,
                "messages must be a JSON array, got ", messages.type_name());
  MOELORA_CHECK(!tools || tools->is_array() || tools->is_null(), ErrorCode::kInvalidArgument,
                "tools must be a JSON array, got ", tools ? tools->type_name() : "");
  MOELORA_CHECK(kwargs.is_object(), ErrorCode::kInvalidArgument,
                "template kwargs must be a JSON object, got ", kwargs.type_name());
  try {
    jinja::Object vars;
    vars.set("messages", jinja::from_json(messages));
    vars.set("tools", tools ? jinja::from_json(*tools) : jinja::Value::none());
    vars.set("documents", jinja::Value::none());
    vars.set("add_generation_prompt", jinja::Value(add_generation_prompt));
    for (const auto& [key, value] : impl_->special_tokens.items())
      vars.set(key, jinja::from_json(value));
    for (const auto& [key, value] : kwargs.items()) {
      MOELORA_CHECK(key != "messages" && key != "tools" && key != "documents" &&
                        key != "add_generation_prompt",
                    ErrorCode::kInvalidArgument, "template kwarg '", key,
                    "' collides with a variable set by render(); pass it as the argument instead");
      vars.set(key, jinja::from_json(value));
    }
    return jinja::render(*impl_->parsed, vars, limits_);
  } catch (const jinja::TemplateError& e) {
    rethrow(e, impl_->origin);
  } catch (const Error&) {
    throw;
  } catch (const std::bad_alloc&) {
    MOELORA_THROW(ErrorCode::kOutOfRange, impl_->origin, ": out of memory while rendering");
  } catch (const std::exception& e) {
    MOELORA_THROW(ErrorCode::kInternal, impl_->origin, ": ", e.what());
  }
}

const std::string& ChatTemplate::source() const {
  return impl_->source;
}
const std::string& ChatTemplate::origin() const {
  return impl_->origin;
}
const ordered_json& ChatTemplate::special_tokens() const {
  return impl_->special_tokens;
}
const std::vector<std::string>& ChatTemplate::other_template_names() const {
  return impl_->other_names;
}
void ChatTemplate::set_limits(const RenderLimits& limits) {
  limits_ = limits;
}
const RenderLimits& ChatTemplate::limits() const {
  return limits_;
}

}  // namespace moelora::chat
