// Loading a model with its adapters the way the command-line tools (and later the server) are
// told to: a checkpoint directory plus `NAME=DIR` adapter specs, and the optional tokenizer.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "io/tokenizer.h"
#include "model/model.h"

namespace moelora::model {

struct AdapterSpec {
  std::string name;
  std::filesystem::path dir;
};

// "NAME=DIR" -> {NAME, DIR}. kInvalidArgument for a missing '=', an empty name or an empty dir.
AdapterSpec parse_adapter_spec(const std::string& text);

// Model::load(dir) and every adapter in `adapters`, slots in the given order (0, 1, ...).
// kInvalidArgument for two adapters with the same name.
Model load_model(const std::filesystem::path& dir, const std::vector<AdapterSpec>& adapters,
                 const ModelOptions& options = {});

// The tokenizer of `dir` when it holds a tokenizer.json, else nullopt.
std::optional<io::Tokenizer> find_tokenizer(const std::filesystem::path& dir);

// Token ids at which generation stops: the config's eos_token_id(s) plus the tokenizer's eos
// token, when there is one, without duplicates.
std::vector<int32_t> stop_tokens(const io::ModelConfig& config, const io::Tokenizer* tokenizer);

}  // namespace moelora::model
