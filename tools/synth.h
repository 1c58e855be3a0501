// What other subcommands use of `moelora synth` (synth.cpp): the model configurations of its
// presets, without writing any weights (e.g. `moelora bench --preset NAME --random-weights`,
// where the GPU draws the weights itself).
#pragma once

#include <cstdint>
#include <string>

#include "io/hf_config.h"

namespace moelora::cli {

// The configuration `moelora synth --preset preset --layers layers --quant quant` writes to
// config.json (layers 0 = the preset's own count; quant bf16, fp8 or nvfp4). kInvalidArgument
// naming the option for an unknown preset or quantization.
io::ModelConfig preset_config(const std::string& preset, int64_t layers, const std::string& quant);

}  // namespace moelora::cli
