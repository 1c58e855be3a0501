// CPU reference of the LoRA delta on a plain linear layer (see lora.h): per token, the shrink
// u = x A^T (R values) and then the expand y += s * (u B^T), like PEFT's
// lora_B(lora_A(x)) * scaling. Tokens are independent, so the loop is parallel over tokens.
#include "ops/lora/lora.h"

#include <algorithm>
#include <string>

#include "core/threads.h"
#include "ops/linear/linear.h"

namespace moelora::ops {

namespace {

// A LoRA factor given as [R, in] or [1, R, in]: the expert-0 matrix as [rows, cols].
struct Matrix {
  const float* data;
  int64_t rows, cols;
};

Matrix factor_matrix(const Tensor& t, const char* what) {
  MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, what, " is undefined");
  check_dtype(t, DType::kF32, what);
  MOELORA_CHECK(t.ndim() == 2 || (t.ndim() == 3 && t.dim(0) >= 1), ErrorCode::kInvalidArgument, what,
                " must be [rows, cols] or [experts, rows, cols], got ", shape_str(t.shape()));
  return {t.data<float>(), t.dim(-2), t.dim(-1)};
}

// y[t] += scaling * (x[t] A^T) B^T for the tokens t in [begin, end) selected by `use`.
template <typename UseToken>
void add_delta(const float* x, int64_t in, const Matrix& a, const Matrix& b, float scaling, float* y,
               int64_t out, int64_t begin, int64_t end, UseToken use, std::vector<float>& u) {
  const int64_t rank = a.rows;
  u.resize(rank);
  for (int64_t t = begin; t < end; ++t) {
    if (!use(t)) continue;
    const float* xt = x + t * in;
    for (int64_t r = 0; r < rank; ++r) u[r] = dot_f32(xt, a.data + r * in, in);
    float* yt = y + t * out;
    for (int64_t o = 0; o < out; ++o) yt[o] += scaling * dot_f32(u.data(), b.data + o * rank, rank);
  }
}

void check_factors(const Matrix& a, const Matrix& b, int64_t in, int64_t out, const std::string& what) {
  MOELORA_CHECK(a.cols == in, ErrorCode::kInvalidArgument, what, ": lora A has ", a.cols,
                " input features, expected ", in);
  MOELORA_CHECK(b.rows == out, ErrorCode::kInvalidArgument, what, ": lora B has ", b.rows,
                " output features, expected ", out);
  MOELORA_CHECK(b.cols == a.rows, ErrorCode::kInvalidArgument, what, ": lora B rank ", b.cols,
                " differs from lora A rank ", a.rows);
}

int64_t min_tokens_per_thread(int64_t macs_per_token) {
  return std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, macs_per_token));
}

}  // namespace

void lora_add_ref(const Tensor& x, const Tensor& a, const Tensor& b, float scaling, Tensor& y) {
  detail::check_f32(x, 2, "lora input x");
  detail::check_f32(y, 2, "lora output y");
  const Matrix am = factor_matrix(a, "lora A");
  const Matrix bm = factor_matrix(b, "lora B");
  const int64_t tokens = x.dim(0), in = x.dim(1), out = y.dim(1);
  MOELORA_CHECK(y.dim(0) == tokens, ErrorCode::kInvalidArgument, "lora output y ", shape_str(y.shape()),
                " has ", y.dim(0), " rows but x has ", tokens, " tokens");
  check_factors(am, bm, in, out, "lora_add_ref");
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  parallel_for(
      tokens,
      [&](int64_t begin, int64_t end) {
        std::vector<float> u;
        add_delta(
            xp, in, am, bm, scaling, yp, out, begin, end, [](int64_t) { return true; }, u);
      },
      min_tokens_per_thread(am.rows * (in + out)));
}

void lora_add_slots_ref(const Tensor& x, const std::vector<int32_t>& slot,
                        const std::vector<const LoraFactors*>& adapters, Tensor& y) {
  detail::check_f32(x, 2, "lora input x");
  detail::check_f32(y, 2, "lora output y");
  const int64_t tokens = x.dim(0), in = x.dim(1), out = y.dim(1);
  MOELORA_CHECK(y.dim(0) == tokens, ErrorCode::kInvalidArgument, "lora output y ", shape_str(y.shape()),
                " has ", y.dim(0), " rows but x has ", tokens, " tokens");
  MOELORA_CHECK(static_cast<int64_t>(slot.size()) == tokens, ErrorCode::kInvalidArgument, "slot map has ",
                slot.size(), " entries for ", tokens, " tokens");
  const int64_t num_slots = static_cast<int64_t>(adapters.size());
  for (int64_t t = 0; t < tokens; ++t) {
    MOELORA_CHECK(slot[t] >= -1 && slot[t] < num_slots, ErrorCode::kOutOfRange, "slot of token ", t, " is ",
                  slot[t], "; valid: -1 (base) or [0, ", num_slots, ")");
  }
  const float* xp = x.data<float>();
  float* yp = y.data<float>();
  // One pass per slot that has this target: validates the factors once and keeps them in cache.
  for (int64_t s = 0; s < num_slots; ++s) {
    const LoraFactors* f = adapters[s];
    if (f == nullptr || !f->defined()) continue;
    if (std::none_of(slot.begin(), slot.end(), [s](int32_t v) { return v == s; })) continue;
    const std::string what = "lora of slot " + std::to_string(s);
    const Matrix am = factor_matrix(f->a, (what + " A").c_str());
    const Matrix bm = factor_matrix(f->b, (what + " B").c_str());
    check_factors(am, bm, in, out, what);
    parallel_for(
        tokens,
        [&](int64_t begin, int64_t end) {
          std::vector<float> u;
          add_delta(
              xp, in, am, bm, f->scaling, yp, out, begin, end, [&](int64_t t) { return slot[t] == s; }, u);
        },
        min_tokens_per_thread(am.rows * (in + out)));
  }
}

}  // namespace moelora::ops
