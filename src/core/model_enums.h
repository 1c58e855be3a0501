// Small enums shared by the config parser (io) and the operators (ops), kept in core so neither
// layer depends on the other.
#pragma once

namespace moelora {

enum class RouterKind {
  kSoftmaxTopK,     // softmax(fp32 logits) -> top-k -> optional renormalize (Qwen)
  kSigmoidNoauxTc,  // sigmoid + correction bias, group top-k, unbiased weights, renorm, scaling (DeepSeek)
};

enum class RopeStyle {
  kRotateHalf,   // pairs (x_j, x_{j + rot/2}) (NeoX; Qwen)
  kInterleaved,  // pairs (x_{2j}, x_{2j+1}) (GPT-J; DeepSeek rope_interleave=True)
};

enum class NormStyle {
  kWeight,         // y = w * norm(x)
  kOnePlusWeight,  // y = (1 + w) * norm(x) (Qwen3-Next / Qwen3.5 zero-centred)
};

}  // namespace moelora
