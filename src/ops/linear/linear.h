// Dense fp32 building blocks of the CPU reference: y = x W^T, the SwiGLU activation and a dot
// product with a fixed summation order.
//
// Every output element is one call of dot_f32 on a row of x and a row of W, so the result does not
// depend on how the work is tiled or split over threads (the reference is deterministic and
// bit-identical for any MOELORA_NUM_THREADS). The row-pointer kernels in `detail` are serial: the
// MoE reference calls them from inside its own parallel loop over (expert, token block) items.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/tensor.h"

namespace moelora::ops {

// sum_i a[i] * b[i] in fp32: eight interleaved partial sums (lane l takes i = l mod 8 over the
// whole multiple of 8), combined as ((s0+s4)+(s1+s5))+((s2+s6)+(s3+s7)), then the tail added in
// order. Fixed order, so identical inputs give identical bits everywhere.
float dot_f32(const float* a, const float* b, int64_t n);

inline float sigmoid_f32(float v) {
  return 1.0f / (1.0f + std::exp(-v));
}
// silu(v) = v * sigmoid(v), written as v / (1 + exp(-v)) like torch's CPU kernel.
inline float silu_f32(float v) {
  return v / (1.0f + std::exp(-v));
}

// x: F32 [T, in]; w: F32 [out, in] -> F32 [T, out] = x W^T. Parallel over (token, row) tiles.
Tensor linear_ref(const Tensor& x, const Tensor& w);
// y: F32 [T, out] += x W^T (the product is formed first, then added: y + (x W^T)).
void linear_add_ref(const Tensor& x, const Tensor& w, Tensor& y);

// gate, up: F32 [T, I] -> F32 [T, I] = silu(gate) * up.
Tensor silu_mul_ref(const Tensor& gate, const Tensor& up);
// h: F32 [T, 2I] with gate columns [0, I) and up columns [I, 2I) -> F32 [T, I] (the fused W13 form).
Tensor silu_mul_fused_ref(const Tensor& h);

namespace detail {
// Serial kernel: y[r * y_stride + o] = dot_f32(x + r * x_stride, w + o * in, in) for r < rows,
// o < out (with accumulate: += instead). Rows are taken four at a time with the same per-element
// summation order as dot_f32, so the bits equal those of one dot_f32 per element.
void linear_rows_f32(const float* x, int64_t rows, int64_t x_stride, int64_t in, const float* w, int64_t out,
                     float* y, int64_t y_stride, bool accumulate);
// Throws kInvalidArgument unless t is a defined F32 tensor with `ndim` dimensions; `what` names it.
void check_f32(const Tensor& t, int ndim, const char* what);
}  // namespace detail

}  // namespace moelora::ops
