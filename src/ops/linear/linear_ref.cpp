// CPU reference of the dense linear layer and the SwiGLU activation (see linear.h).
//
// linear_ref tiles the output into (8 tokens) x (rows worth ~64 KiB of W) blocks: inside a tile
// each weight row is read once from memory and reused from L1 for the 8 tokens, four tokens per
// pass of the micro-kernel. Tiles are independent, so parallel_for hands out contiguous runs of
// them; each element still gets dot_f32's exact summation order, which keeps the result
// independent of the tiling and the thread count.
#include "ops/linear/linear.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/threads.h"

namespace moelora::ops {

namespace {

// Four fp32 lanes (one SSE/NEON register). GCC/Clang vector extensions do elementwise IEEE
// operations, so lane l of `lo` (`hi`) is bit-identical to the scalar partial sum s[l] (s[l + 4])
// described in linear.h; the vectors only keep the partial sums in registers.
typedef float Lanes4 __attribute__((vector_size(16)));

inline Lanes4 load4(const float* p) {
  Lanes4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)) with lo = s0..s3, hi = s4..s7.
inline float combine8(Lanes4 lo, Lanes4 hi) {
  const Lanes4 pair = lo + hi;
  return (pair[0] + pair[1]) + (pair[2] + pair[3]);
}

// Four dot products of one weight row w with rows x0..x3, each in exactly the order of dot_f32.
void dot4_f32(const float* w, const float* x0, const float* x1, const float* x2, const float* x3, int64_t n,
              float out[4]) {
  Lanes4 a0 = {}, b0 = {}, a1 = {}, b1 = {}, a2 = {}, b2 = {}, a3 = {}, b3 = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const Lanes4 wl = load4(w + i), wh = load4(w + i + 4);
    a0 += load4(x0 + i) * wl;
    b0 += load4(x0 + i + 4) * wh;
    a1 += load4(x1 + i) * wl;
    b1 += load4(x1 + i + 4) * wh;
    a2 += load4(x2 + i) * wl;
    b2 += load4(x2 + i + 4) * wh;
    a3 += load4(x3 + i) * wl;
    b3 += load4(x3 + i + 4) * wh;
  }
  float t0 = combine8(a0, b0), t1 = combine8(a1, b1), t2 = combine8(a2, b2), t3 = combine8(a3, b3);
  for (; i < n; ++i) {
    t0 += x0[i] * w[i];
    t1 += x1[i] * w[i];
    t2 += x2[i] * w[i];
    t3 += x3[i] * w[i];
  }
  out[0] = t0;
  out[1] = t1;
  out[2] = t2;
  out[3] = t3;
}

}  // namespace

float dot_f32(const float* a, const float* b, int64_t n) {
  Lanes4 lo = {}, hi = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    lo += load4(a + i) * load4(b + i);
    hi += load4(a + i + 4) * load4(b + i + 4);
  }
  float total = combine8(lo, hi);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

namespace detail {

void check_f32(const Tensor& t, int ndim, const char* what) {
  MOELORA_CHECK(t.defined(), ErrorCode::kInvalidArgument, what, " is undefined");
  MOELORA_CHECK(t.dtype() == DType::kF32, ErrorCode::kInvalidArgument, what, " must be F32, got ",
                dtype_name(t.dtype()));
  MOELORA_CHECK(t.ndim() == ndim, ErrorCode::kInvalidArgument, what, " must have ", ndim,
                " dimensions, got shape ", shape_str(t.shape()));
}

void linear_rows_f32(const float* x, int64_t rows, int64_t x_stride, int64_t in, const float* w, int64_t out,
                     float* y, int64_t y_stride, bool accumulate) {
  for (int64_t o = 0; o < out; ++o) {
    const float* w_row = w + o * in;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      float d[4];
      dot4_f32(w_row, x + r * x_stride, x + (r + 1) * x_stride, x + (r + 2) * x_stride,
               x + (r + 3) * x_stride, in, d);
      for (int i = 0; i < 4; ++i) {
        float& dst = y[(r + i) * y_stride + o];
        dst = accumulate ? dst + d[i] : d[i];
      }
    }
    for (; r < rows; ++r) {
      const float d = dot_f32(x + r * x_stride, w_row, in);
      float& dst = y[r * y_stride + o];
      dst = accumulate ? dst + d : d;
    }
  }
}

}  // namespace detail

namespace {

constexpr int64_t kTokenTile = 8;
constexpr int64_t kWeightTileBytes = 64 * 1024;
// Below this many multiply-adds per thread, spawning threads costs more than it saves.
constexpr int64_t kMinMacsPerThread = int64_t{1} << 18;

void check_linear_shapes(const Tensor& x, const Tensor& w) {
  detail::check_f32(x, 2, "linear input x");
  detail::check_f32(w, 2, "linear weight w");
  MOELORA_CHECK(x.dim(1) == w.dim(1), ErrorCode::kInvalidArgument, "linear: x ", shape_str(x.shape()),
                " has ", x.dim(1), " input features but the weight ", shape_str(w.shape()), " expects ",
                w.dim(1));
}

// y [T, out] (= or +=) x [T, in] w [out, in]^T, tiled and parallel.
void linear_tiled(const Tensor& x, const Tensor& w, Tensor& y, bool accumulate) {
  const int64_t tokens = x.dim(0), in = x.dim(1), out = w.dim(0);
  if (tokens == 0 || out == 0) return;
  const float* xp = x.data<float>();
  const float* wp = w.data<float>();
  float* yp = y.data<float>();
  const int64_t row_tile =
      std::clamp<int64_t>(kWeightTileBytes / std::max<int64_t>(1, in * int64_t{sizeof(float)}), 1, out);
  const int64_t token_tiles = (tokens + kTokenTile - 1) / kTokenTile;
  const int64_t row_tiles = (out + row_tile - 1) / row_tile;
  const int64_t macs_per_tile = std::max<int64_t>(1, kTokenTile * row_tile * in);
  parallel_for(
      token_tiles * row_tiles,
      [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t t0 = (item / row_tiles) * kTokenTile;
          const int64_t o0 = (item % row_tiles) * row_tile;
          const int64_t rows = std::min(kTokenTile, tokens - t0);
          const int64_t cols = std::min(row_tile, out - o0);
          // y rows are `out` apart: the tile is a [rows, cols] window of y.
          detail::linear_rows_f32(xp + t0 * in, rows, in, in, wp + o0 * in, cols, yp + t0 * out + o0, out,
                                  accumulate);
        }
      },
      std::max<int64_t>(1, kMinMacsPerThread / macs_per_tile));
}

}  // namespace

Tensor linear_ref(const Tensor& x, const Tensor& w) {
  check_linear_shapes(x, w);
  Tensor y = Tensor::empty(DType::kF32, {x.dim(0), w.dim(0)});
  linear_tiled(x, w, y, /*accumulate=*/false);
  return y;
}

void linear_add_ref(const Tensor& x, const Tensor& w, Tensor& y) {
  check_linear_shapes(x, w);
  detail::check_f32(y, 2, "linear output y");
  check_shape(y, {x.dim(0), w.dim(0)}, "linear output y");
  linear_tiled(x, w, y, /*accumulate=*/true);
}

Tensor silu_mul_ref(const Tensor& gate, const Tensor& up) {
  detail::check_f32(gate, 2, "silu_mul gate");
  detail::check_f32(up, 2, "silu_mul up");
  check_shape(up, gate.shape(), "silu_mul up (must match gate)");
  Tensor out = Tensor::empty(DType::kF32, gate.shape());
  const float* g = gate.data<float>();
  const float* u = up.data<float>();
  float* o = out.data<float>();
  for (int64_t i = 0; i < gate.numel(); ++i) o[i] = silu_f32(g[i]) * u[i];
  return out;
}

Tensor silu_mul_fused_ref(const Tensor& h) {
  detail::check_f32(h, 2, "silu_mul fused input h");
  MOELORA_CHECK(h.dim(1) % 2 == 0, ErrorCode::kInvalidArgument, "silu_mul fused input h ",
                shape_str(h.shape()), " must have an even number of columns (gate then up)");
  const int64_t tokens = h.dim(0), inter = h.dim(1) / 2;
  Tensor out = Tensor::empty(DType::kF32, {tokens, inter});
  const float* hp = h.data<float>();
  float* o = out.data<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = hp + t * 2 * inter;
    for (int64_t i = 0; i < inter; ++i) o[t * inter + i] = silu_f32(row[i]) * row[inter + i];
  }
  return out;
}

}  // namespace moelora::ops
