// CPU reference of RoPE (see rope.h). The table construction mirrors the fp32/double split of
// transformers' code step by step: Python scalars (correction range, mscale) are doubles, tensor
// arithmetic is fp32 with the scalar operand rounded to fp32 first, as torch does.
#include "ops/rope/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>

#include "core/threads.h"

namespace moelora::ops {

const char* rope_type_name(RopeType type) {
  switch (type) {
    case RopeType::kDefault: return "default";
    case RopeType::kYarn: return "yarn";
  }
  return "unknown";
}

RopeType rope_type_from_name(std::string_view name) {
  if (name == "default") return RopeType::kDefault;
  if (name == "yarn") return RopeType::kYarn;
  MOELORA_THROW(ErrorCode::kUnsupported, "rope_type '", name, "' is not supported; supported: default, yarn");
}

double yarn_get_mscale(double scale, double m) {
  if (scale <= 1.0) return 1.0;
  return 0.1 * m * std::log(scale) + 1.0;
}

namespace {

// theta ^ (float(2j) / float(d)) in fp32. torch evaluates the power in fp32 with an accurate (<= 1
// ulp) pow; evaluating in double and rounding once gives the correctly rounded value.
std::vector<float> position_frequencies(double theta, int64_t dim) {
  const float base = static_cast<float>(theta);
  std::vector<float> pos_freq(static_cast<size_t>(dim / 2));
  for (int64_t j = 0; j < dim / 2; ++j) {
    const float exponent = static_cast<float>(2 * j) / static_cast<float>(dim);
    pos_freq[j] = static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(exponent)));
  }
  return pos_freq;
}

// Dimension index at which a frequency makes `num_rotations` turns over the original context
// (find_correction_dim in transformers; double, same operation order).
double correction_dim(double num_rotations, int64_t dim, double base, double max_positions) {
  return (static_cast<double>(dim) * std::log(max_positions / (num_rotations * 2.0 * std::numbers::pi))) /
         (2.0 * std::log(base));
}

RopeTable make_yarn_table(const RopeParams& p) {
  const int64_t dim = p.rotary_dim;
  MOELORA_CHECK(p.original_max_position_embeddings > 0, ErrorCode::kInvalidArgument,
                "yarn rope: original_max_position_embeddings must be > 0, got ",
                p.original_max_position_embeddings);
  double factor = p.factor;
  if (factor == 0.0) {
    MOELORA_CHECK(p.max_position_embeddings > 0, ErrorCode::kInvalidArgument,
                  "yarn rope: no factor given and max_position_embeddings (", p.max_position_embeddings,
                  ") cannot replace it; expected a factor > 0");
    factor = static_cast<double>(p.max_position_embeddings) /
             static_cast<double>(p.original_max_position_embeddings);
  }
  MOELORA_CHECK(factor > 0.0 && std::isfinite(factor), ErrorCode::kInvalidArgument,
                "yarn rope: factor must be a finite value > 0, got ", factor);

  RopeTable table;
  table.rotary_dim = dim;
  double attention_factor;
  if (p.attention_factor.has_value()) {
    attention_factor = *p.attention_factor;
  } else if (p.mscale != 0.0 && p.mscale_all_dim != 0.0) {
    attention_factor = yarn_get_mscale(factor, p.mscale) / yarn_get_mscale(factor, p.mscale_all_dim);
  } else {
    attention_factor = yarn_get_mscale(factor);
  }
  table.attention_factor = static_cast<float>(attention_factor);

  const double beta_fast = p.beta_fast != 0.0 ? p.beta_fast : 32.0;
  const double beta_slow = p.beta_slow != 0.0 ? p.beta_slow : 1.0;
  const double max_positions = static_cast<double>(p.original_max_position_embeddings);
  double low = correction_dim(beta_fast, dim, p.theta, max_positions);
  double high = correction_dim(beta_slow, dim, p.theta, max_positions);
  if (p.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // keeps the ramp finite (transformers does the same)

  const std::vector<float> pos_freq = position_frequencies(p.theta, dim);
  const float factor_f = static_cast<float>(factor);
  const float low_f = static_cast<float>(low);
  const float span_f = static_cast<float>(high - low);
  table.inv_freq.resize(static_cast<size_t>(dim / 2));
  for (int64_t j = 0; j < dim / 2; ++j) {
    const float extrapolation = 1.0f / pos_freq[j];
    const float interpolation = 1.0f / (factor_f * pos_freq[j]);
    const float ramp = std::clamp((static_cast<float>(j) - low_f) / span_f, 0.0f, 1.0f);
    const float extrapolation_weight = 1.0f - ramp;
    const float interpolation_part = interpolation * (1.0f - extrapolation_weight);
    const float extrapolation_part = extrapolation * extrapolation_weight;
    table.inv_freq[j] = interpolation_part + extrapolation_part;
  }
  return table;
}

}  // namespace

RopeTable make_rope_table(const RopeParams& params) {
  MOELORA_CHECK(params.rotary_dim > 0 && params.rotary_dim % 2 == 0, ErrorCode::kInvalidArgument,
                "rope: rotary_dim must be even and > 0, got ", params.rotary_dim);
  MOELORA_CHECK(params.theta > 0.0 && std::isfinite(params.theta), ErrorCode::kInvalidArgument,
                "rope: rope_theta must be a finite value > 0, got ", params.theta);
  if (params.type == RopeType::kYarn) return make_yarn_table(params);
  RopeTable table;
  table.rotary_dim = params.rotary_dim;
  table.attention_factor = 1.0f;  // the default type never scales cos/sin
  const std::vector<float> pos_freq = position_frequencies(params.theta, params.rotary_dim);
  table.inv_freq.resize(pos_freq.size());
  for (size_t j = 0; j < pos_freq.size(); ++j) table.inv_freq[j] = 1.0f / pos_freq[j];
  return table;
}

void rope_cos_sin(const RopeTable& table, int64_t position, float* cos_out, float* sin_out) {
  // position_ids.float(): positions beyond 2^24 round like they do in transformers.
  const float pos = static_cast<float>(position);
  const int64_t half = table.rotary_dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float angle = pos * table.inv_freq[j];
    cos_out[j] = std::cos(angle) * table.attention_factor;
    sin_out[j] = std::sin(angle) * table.attention_factor;
  }
}

void apply_rope_inplace_ref(Tensor& x, std::span<const int64_t> positions, const RopeTable& table,
                            const RopeApplyParams& params) {
  MOELORA_CHECK(x.defined() && x.dtype() == DType::kF32 && (x.ndim() == 2 || x.ndim() == 3),
                ErrorCode::kInvalidArgument,
                "rope input: expected F32 [tokens, heads, head_dim] or [tokens, head_dim], got ",
                x.defined() ? std::string(dtype_name(x.dtype())) + " " + shape_str(x.shape())
                            : std::string("an undefined tensor"));
  const int64_t tokens = x.dim(0);
  const int64_t heads = x.ndim() == 3 ? x.dim(1) : 1;
  const int64_t head_dim = x.dim(-1);
  const int64_t rot = table.rotary_dim;
  MOELORA_CHECK(rot > 0 && static_cast<int64_t>(table.inv_freq.size()) * 2 == rot,
                ErrorCode::kInvalidArgument, "rope table: rotary_dim ", rot, " does not match its ",
                table.inv_freq.size(), " frequencies (build it with make_rope_table)");
  MOELORA_CHECK(params.dim_offset >= 0 && params.dim_offset + rot <= head_dim, ErrorCode::kInvalidArgument,
                "rope: rotated dims [", params.dim_offset, ", ", params.dim_offset + rot,
                ") do not fit in a head of ", head_dim, " dims (input ", shape_str(x.shape()), ")");
  MOELORA_CHECK(static_cast<int64_t>(positions.size()) == tokens, ErrorCode::kInvalidArgument,
                "rope: ", positions.size(), " positions for ", tokens, " tokens (input ",
                shape_str(x.shape()), ")");
  for (int64_t t = 0; t < tokens; ++t) {
    MOELORA_CHECK(positions[t] >= 0, ErrorCode::kInvalidArgument, "rope: position ", positions[t],
                  " of token ", t, " is negative");
  }
  float* data = x.data<float>();
  const int64_t half = rot / 2;
  parallel_for(
      tokens,
      [&](int64_t begin, int64_t end) {
        std::vector<float> cos_v(static_cast<size_t>(half)), sin_v(static_cast<size_t>(half));
        for (int64_t t = begin; t < end; ++t) {
          rope_cos_sin(table, positions[t], cos_v.data(), sin_v.data());
          for (int64_t h = 0; h < heads; ++h) {
            float* v = data + (t * heads + h) * head_dim + params.dim_offset;
            for (int64_t j = 0; j < half; ++j) {
              // The pair's two elements: (j, j + half) for rotate-half, (2j, 2j + 1) for interleaved.
              float& a = params.style == RopeStyle::kRotateHalf ? v[j] : v[2 * j];
              float& b = params.style == RopeStyle::kRotateHalf ? v[j + half] : v[2 * j + 1];
              const float a0 = a, b0 = b;
              a = a0 * cos_v[j] - b0 * sin_v[j];
              b = b0 * cos_v[j] + a0 * sin_v[j];
            }
          }
        }
      },
      /*min_chunk=*/16);
}

}  // namespace moelora::ops
