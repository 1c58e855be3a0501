// Rotary position embedding (RoPE): the frequency table (plain and YaRN) and its application to
// query/key heads, computed the way transformers 5.17 does so that fp32 results agree to ~1e-6.
//
// Frequency table (make_rope_table), d = rotary_dim, j = 0 .. d/2 - 1, all in fp32 unless noted:
//   pos_freq[j] = theta ^ (float(2j) / d)
//   default:  inv_freq[j] = 1 / pos_freq[j];  attention_factor = 1
//   YaRN (modeling_rope_utils._compute_yarn_parameters):
//     factor   = rope factor, or max_position_embeddings / original_max_position_embeddings when
//                the config has none (DeepSeek-V3's files always carry it)
//     corr(n)  = d * ln(L0 / (2 pi n)) / (2 ln theta)        (double; L0 = original_max_pos)
//     low      = max(floor(corr(beta_fast)), 0), high = min(ceil(corr(beta_slow)), d - 1)
//                (no floor/ceil when truncate is false; high += 0.001 when low == high)
//     ramp[j]  = clamp((j - low) / (high - low), 0, 1);  e[j] = 1 - ramp[j]
//     inv_freq[j] = (1 / (factor * pos_freq[j])) * (1 - e[j]) + (1 / pos_freq[j]) * e[j]
//     attention_factor = the explicit value when given, else
//                mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are non-zero,
//                else mscale(factor, 1), with mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1.
//     beta_fast / beta_slow of 0 (or absent) mean 32 / 1, like HF's `beta_fast or 32`.
//   Worked values: DeepSeek-V3 and Kimi-K2.5 (mscale = mscale_all_dim = 1) give attention_factor 1;
//   without mscale keys, factor 4 gives 1 + 0.1 ln 4 = 1.1386.
//
// Application (apply_rope_inplace_ref), for a token at position p:
//   angle[j] = float(p) * inv_freq[j] (one fp32 product, as HF's fp32 matmul of a K=1 outer product)
//   c[j] = cos(angle[j]) * attention_factor, s[j] = sin(angle[j]) * attention_factor
//   each pair (a, b) -> (a c - b s, b c + a s), where the pairs within the rotated range
//   [offset, offset + d) of every head are
//     RopeStyle::kRotateHalf  (x[offset + j], x[offset + j + d/2])    Qwen3, Qwen3-Next, Qwen3.5
//     RopeStyle::kInterleaved (x[offset + 2j], x[offset + 2j + 1])    DeepSeek-V3 / Kimi (rope dims)
//   and the dims outside the range pass through (partial rotary: Qwen3.5 rotates 64 of 256).
//   kInterleaved keeps each rotated pair in place. transformers instead writes the result
//   de-interleaved (all rotated even elements, then all odd ones) for q and k alike; that is the
//   same permutation on both sides, so q.k dot products, and with them attention, are identical.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "core/model_enums.h"
#include "core/tensor.h"

namespace moelora::ops {

enum class RopeType {
  kDefault,  // rope_type "default"
  kYarn,     // rope_type "yarn"
};

const char* rope_type_name(RopeType type);
// "default" or "yarn"; anything else throws kUnsupported listing the supported names.
RopeType rope_type_from_name(std::string_view name);

// The RoPE settings of a model, as they appear in config.json (rope_parameters / rope_scaling).
// Zero stands for "absent" wherever HF tests a value for truthiness, so a config parser can pass the
// JSON values through unchanged.
struct RopeParams {
  RopeType type = RopeType::kDefault;
  double theta = 10000.0;  // rope_theta
  // Dims rotated per head: int(head_dim * partial_rotary_factor); MLA: qk_rope_head_dim. Even.
  int64_t rotary_dim = 0;
  // ---- YaRN only ----
  double factor = 0.0;  // 0 = absent: max_position_embeddings / original_max_position_embeddings
  int64_t original_max_position_embeddings = 0;  // required
  int64_t max_position_embeddings = 0;           // only read when factor is absent
  double beta_fast = 0.0;                        // 0 = absent: 32
  double beta_slow = 0.0;                        // 0 = absent: 1
  double mscale = 0.0;                           // 0 = absent
  double mscale_all_dim = 0.0;                   // 0 = absent
  std::optional<double> attention_factor;        // explicit value wins over the derived one
  bool truncate = true;
};

// The precomputed part of RoPE for one model (shared by all layers).
struct RopeTable {
  int64_t rotary_dim = 0;
  std::vector<float> inv_freq;    // [rotary_dim / 2]
  float attention_factor = 1.0f;  // multiplies cos and sin
};

// Throws kInvalidArgument (naming the field) for an odd or non-positive rotary_dim, theta <= 0, or a
// YaRN config without original_max_position_embeddings or a usable factor.
RopeTable make_rope_table(const RopeParams& params);

// YaRN's mscale: 0.1 * m * ln(scale) + 1 for scale > 1, else 1 (yarn_get_mscale in transformers).
double yarn_get_mscale(double scale, double m = 1.0);

// cos[j], sin[j] for j < rotary_dim / 2 at `position`, already multiplied by attention_factor.
void rope_cos_sin(const RopeTable& table, int64_t position, float* cos_out, float* sin_out);

struct RopeApplyParams {
  RopeStyle style = RopeStyle::kRotateHalf;
  // First dim of the rotated range inside each head: 0 for Qwen (the rotary dims lead the head),
  // qk_nope_head_dim for MLA queries [q_nope | q_rope].
  int64_t dim_offset = 0;
};

// x: F32 [T, heads, head_dim] (or [T, head_dim], one head: MLA's shared k_rope), rotated in place
// on dims [dim_offset, dim_offset + rotary_dim) of every head; positions: [T], position of token t.
void apply_rope_inplace_ref(Tensor& x, std::span<const int64_t> positions, const RopeTable& table,
                            const RopeApplyParams& params);

}  // namespace moelora::ops
