// Model + adapters + tokenizer loading for the tools (see model_setup.h).
#include "model/model_setup.h"

#include <algorithm>
#include <set>

namespace moelora::model {

AdapterSpec parse_adapter_spec(const std::string& text) {
  const size_t eq = text.find('=');
  MOELORA_CHECK(eq != std::string::npos, ErrorCode::kInvalidArgument, "adapter '", text,
                "' must be given as NAME=DIR");
  AdapterSpec spec{text.substr(0, eq), text.substr(eq + 1)};
  MOELORA_CHECK(!spec.name.empty(), ErrorCode::kInvalidArgument, "adapter '", text,
                "': the NAME before '=' is empty");
  MOELORA_CHECK(!spec.dir.empty(), ErrorCode::kInvalidArgument, "adapter '", text,
                "': the DIR after '=' is empty");
  return spec;
}

Model load_model(const std::filesystem::path& dir, const std::vector<AdapterSpec>& adapters,
                 const ModelOptions& options) {
  std::set<std::string> names;
  for (const AdapterSpec& spec : adapters) {
    MOELORA_CHECK(names.insert(spec.name).second, ErrorCode::kInvalidArgument, "adapter name '", spec.name,
                  "' is given twice");
  }
  Model model = Model::load(dir, options);
  for (const AdapterSpec& spec : adapters) model.load_adapter(spec.name, spec.dir);
  return model;
}

std::optional<io::Tokenizer> find_tokenizer(const std::filesystem::path& dir) {
  if (!std::filesystem::exists(dir / "tokenizer.json")) return std::nullopt;
  return io::Tokenizer::load(dir);
}

std::vector<int32_t> stop_tokens(const io::ModelConfig& config, const io::Tokenizer* tokenizer) {
  std::vector<int32_t> out;
  auto add = [&out](int64_t id) {
    if (id >= 0 && std::find(out.begin(), out.end(), id) == out.end())
      out.push_back(static_cast<int32_t>(id));
  };
  for (int64_t id : config.eos_token_ids) add(id);
  if (tokenizer != nullptr && tokenizer->eos_token_id()) add(*tokenizer->eos_token_id());
  return out;
}

}  // namespace moelora::model
