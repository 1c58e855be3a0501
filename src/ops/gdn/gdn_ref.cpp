// CPU reference of Gated DeltaNet (see gdn.h). Heads are independent: each is computed by one
// call in a fixed order, so results do not depend on the thread split.
//
// The chunked form. With S_0 the state at the chunk's start, Gamma_t = exp(G_t), G_t = the sum of
// g over the chunk up to and including t, the recurrence unrolls to
//   S_t     = Gamma_t S_0 + sum_{j <= t} (Gamma_t / Gamma_j) k_j d_j^T
//   d_t     = beta_t (v_t - Gamma_t S_0^T k_t) - sum_{j < t} beta_t (Gamma_t / Gamma_j) (k_t . k_j)
//   d_j o_t     = Gamma_t S_0^T q_t + sum_{j <= t} (Gamma_t / Gamma_j) (q_t . k_j) d_j
// so the deltas d of a chunk solve a unit lower-triangular system (forward substitution), and the
// outputs and the next state S_L (t = L - 1) are sums over the chunk. Gamma_t / Gamma_j =
// exp(G_t - G_j) <= 1 for j <= t (g <= 0), computed from the difference so that long chunks of
// strong decay do not underflow.
#include "ops/gdn/gdn.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/threads.h"
#include "ops/linear/linear.h"

namespace moelora::ops {

namespace {

std::string describe(const Tensor& t) {
  return t.defined() ? std::string(dtype_name(t.dtype())) + " " + shape_str(t.shape())
                     : std::string("an undefined tensor");
}

void check_f32(const Tensor& t, const Shape& shape, const char* what) {
  MOELORA_CHECK(t.defined() && t.dtype() == DType::kF32 && t.shape() == shape,
                ErrorCode::kInvalidArgument, what, ": expected F32 ", shape_str(shape), ", got ",
                describe(t));
}

void check_float(const Tensor& t, const Shape& shape, const char* what) {
  MOELORA_CHECK(t.defined() && dtype_is_float(t.dtype()) && t.shape() == shape,
                ErrorCode::kInvalidArgument, what, ": expected a float tensor ", shape_str(shape),
                ", got ", describe(t));
}

float softplus_f32(float v) {  // torch's softplus (beta 1, threshold 20)
  return v > 20.f ? v : std::log1p(std::exp(v));
}

// Shapes of one gated delta rule call; returns {T, nv, dk, dv}.
struct RuleDims {
  int64_t T, nv, dk, dv;
};
RuleDims check_rule_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                           const Tensor& beta, const Tensor& state) {
  MOELORA_CHECK(q.defined() && q.ndim() == 3 && q.dtype() == DType::kF32,
                ErrorCode::kInvalidArgument, "gated delta rule q: expected F32 [T, nv, dk], got ",
                describe(q));
  const int64_t T = q.dim(0), nv = q.dim(1), dk = q.dim(2);
  MOELORA_CHECK(
      v.defined() && v.ndim() == 3 && v.dtype() == DType::kF32 && v.dim(0) == T && v.dim(1) == nv,
      ErrorCode::kInvalidArgument, "gated delta rule v: expected F32 [", T, ", ", nv, ", dv], got ",
      describe(v));
  const int64_t dv = v.dim(2);
  check_f32(k, {T, nv, dk}, "gated delta rule k");
  check_f32(g, {T, nv}, "gated delta rule g");
  check_f32(beta, {T, nv}, "gated delta rule beta");
  check_f32(state, {nv, dk, dv}, "gated delta rule state");
  return {T, nv, dk, dv};
}

}  // namespace

GdnState GdnState::zeros(const GdnShape& shape) {
  return {Tensor::zeros(DType::kF32, {shape.conv_dim(), shape.conv_kernel - 1}),
          Tensor::zeros(DType::kF32, {shape.num_v_heads, shape.head_k_dim, shape.head_v_dim})};
}

Tensor causal_conv1d_silu_ref(const Tensor& x, const Tensor& weight, Tensor& state) {
  MOELORA_CHECK(x.defined() && x.ndim() == 2 && x.dtype() == DType::kF32,
                ErrorCode::kInvalidArgument, "causal conv1d input: expected F32 [T, C], got ",
                describe(x));
  const int64_t T = x.dim(0), C = x.dim(1);
  MOELORA_CHECK(weight.defined() && dtype_is_float(weight.dtype()) &&
                    (weight.ndim() == 2 || (weight.ndim() == 3 && weight.dim(1) == 1)) &&
                    weight.dim(0) == C && weight.dim(-1) >= 1,
                ErrorCode::kInvalidArgument, "causal conv1d weight: expected [", C, ", K] or [", C,
                ", 1, K] (depthwise), got ", describe(weight));
  const int64_t K = weight.dim(-1);
  check_f32(state, {C, K - 1}, "causal conv1d state");
  const Tensor w = weight.to_f32();
  const float* wp = w.data<float>();
  const float* xp = x.data<float>();
  float* sp = state.data<float>();
  Tensor y = Tensor::empty(DType::kF32, {T, C});
  float* yp = y.data<float>();
  parallel_for(C, [&](int64_t c0, int64_t c1) {
    std::vector<float> u(static_cast<size_t>(K - 1 + T));
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t j = 0; j < K - 1; ++j) u[j] = sp[c * (K - 1) + j];
      for (int64_t t = 0; t < T; ++t) u[K - 1 + t] = xp[t * C + c];
      for (int64_t t = 0; t < T; ++t) {
        float s = 0.f;
        for (int64_t j = 0; j < K; ++j) s += wp[c * K + j] * u[t + j];
        yp[t * C + c] = silu_f32(s);
      }
      for (int64_t j = 0; j < K - 1; ++j) sp[c * (K - 1) + j] = u[T + j];
    }
  });
  return y;
}

Tensor gated_delta_rule_recurrent_ref(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& g, const Tensor& beta, Tensor& state) {
  const RuleDims d = check_rule_inputs(q, k, v, g, beta, state);
  Tensor o = Tensor::empty(DType::kF32, {d.T, d.nv, d.dv});
  const float *qp = q.data<float>(), *kp = k.data<float>(), *vp = v.data<float>();
  const float *gp = g.data<float>(), *bp = beta.data<float>();
  float* op = o.data<float>();
  float* sp = state.data<float>();
  parallel_for(d.nv, [&](int64_t h0, int64_t h1) {
    std::vector<float> kv(static_cast<size_t>(d.dv));
    for (int64_t h = h0; h < h1; ++h) {
      float* S = sp + h * d.dk * d.dv;  // [dk, dv]
      for (int64_t t = 0; t < d.T; ++t) {
        const float decay = std::exp(gp[t * d.nv + h]);
        const float b = bp[t * d.nv + h];
        const float* kt = kp + (t * d.nv + h) * d.dk;
        const float* qt = qp + (t * d.nv + h) * d.dk;
        const float* vt = vp + (t * d.nv + h) * d.dv;
        for (int64_t i = 0; i < d.dk * d.dv; ++i) S[i] *= decay;
        std::fill(kv.begin(), kv.end(), 0.f);  // S^T k
        for (int64_t i = 0; i < d.dk; ++i)
          for (int64_t j = 0; j < d.dv; ++j) kv[j] += S[i * d.dv + j] * kt[i];
        for (int64_t j = 0; j < d.dv; ++j) kv[j] = b * (vt[j] - kv[j]);  // the delta
        for (int64_t i = 0; i < d.dk; ++i)
          for (int64_t j = 0; j < d.dv; ++j) S[i * d.dv + j] += kt[i] * kv[j];
        float* ot = op + (t * d.nv + h) * d.dv;
        std::fill(ot, ot + d.dv, 0.f);
        for (int64_t i = 0; i < d.dk; ++i)
          for (int64_t j = 0; j < d.dv; ++j) ot[j] += S[i * d.dv + j] * qt[i];
      }
    }
  });
  return o;
}

Tensor gated_delta_rule_chunked_ref(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& g, const Tensor& beta, Tensor& state,
                                    int64_t chunk) {
  const RuleDims d = check_rule_inputs(q, k, v, g, beta, state);
  MOELORA_CHECK(chunk >= 1, ErrorCode::kInvalidArgument, "gated delta rule: chunk = ", chunk,
                " must be >= 1");
  Tensor o = Tensor::empty(DType::kF32, {d.T, d.nv, d.dv});
  const float *qp = q.data<float>(), *kp = k.data<float>(), *vp = v.data<float>();
  const float *gp = g.data<float>(), *bp = beta.data<float>();
  float* op = o.data<float>();
  float* sp = state.data<float>();
  const int64_t dk = d.dk, dv = d.dv, nv = d.nv;
  parallel_for(nv, [&](int64_t h0, int64_t h1) {
    std::vector<float> G(static_cast<size_t>(chunk)), delta(static_cast<size_t>(chunk * dv)),
        s0k(static_cast<size_t>(dv)), next(static_cast<size_t>(dk * dv));
    for (int64_t h = h0; h < h1; ++h) {
      float* S = sp + h * dk * dv;  // S_0 of the current chunk, [dk, dv]
      auto kv_ptr = [&](const float* base, int64_t t, int64_t width) {
        return base + (t * nv + h) * width;
      };
      for (int64_t c0 = 0; c0 < d.T; c0 += chunk) {
        const int64_t L = std::min(chunk, d.T - c0);
        float run = 0.f;
        for (int64_t i = 0; i < L; ++i) G[i] = run += gp[(c0 + i) * nv + h];
        // deltas: forward substitution of the unit lower-triangular system
        for (int64_t i = 0; i < L; ++i) {
          const float* ki = kv_ptr(kp, c0 + i, dk);
          const float* vi = kv_ptr(vp, c0 + i, dv);
          const float b = bp[(c0 + i) * nv + h], gamma = std::exp(G[i]);
          std::fill(s0k.begin(), s0k.end(), 0.f);
          for (int64_t a = 0; a < dk; ++a)
            for (int64_t j = 0; j < dv; ++j) s0k[j] += S[a * dv + j] * ki[a];
          float* di = delta.data() + i * dv;
          for (int64_t j = 0; j < dv; ++j) di[j] = b * (vi[j] - gamma * s0k[j]);
          for (int64_t jj = 0; jj < i; ++jj) {
            const float coef =
                b * std::exp(G[i] - G[jj]) * dot_f32(ki, kv_ptr(kp, c0 + jj, dk), dk);
            const float* dj = delta.data() + jj * dv;
            for (int64_t j = 0; j < dv; ++j) di[j] -= coef * dj[j];
          }
        }
        // outputs
        for (int64_t i = 0; i < L; ++i) {
          const float* qi = kv_ptr(qp, c0 + i, dk);
          float* oi = op + ((c0 + i) * nv + h) * dv;
          const float gamma = std::exp(G[i]);
          std::fill(oi, oi + dv, 0.f);
          for (int64_t a = 0; a < dk; ++a)
            for (int64_t j = 0; j < dv; ++j) oi[j] += S[a * dv + j] * qi[a];
          for (int64_t j = 0; j < dv; ++j) oi[j] *= gamma;
          for (int64_t jj = 0; jj <= i; ++jj) {
            const float coef = std::exp(G[i] - G[jj]) * dot_f32(qi, kv_ptr(kp, c0 + jj, dk), dk);
            const float* dj = delta.data() + jj * dv;
            for (int64_t j = 0; j < dv; ++j) oi[j] += coef * dj[j];
          }
        }
        // the next chunk's S_0
        const float gamma_end = std::exp(G[L - 1]);
        for (int64_t i = 0; i < dk * dv; ++i) next[i] = gamma_end * S[i];
        for (int64_t jj = 0; jj < L; ++jj) {
          const float* kj = kv_ptr(kp, c0 + jj, dk);
          const float f = std::exp(G[L - 1] - G[jj]);
          const float* dj = delta.data() + jj * dv;
          for (int64_t a = 0; a < dk; ++a)
            for (int64_t j = 0; j < dv; ++j) next[a * dv + j] += f * kj[a] * dj[j];
        }
        std::copy(next.begin(), next.end(), S);
      }
    }
  });
  return o;
}

Tensor rms_norm_gated_ref(const Tensor& x, const Tensor& z, const Tensor& w, double eps) {
  MOELORA_CHECK(x.defined() && x.ndim() >= 1 && x.dtype() == DType::kF32,
                ErrorCode::kInvalidArgument, "gated rms_norm input: expected F32 [..., D], got ",
                describe(x));
  check_f32(z, x.shape(), "gated rms_norm gate z");
  const int64_t D = x.dim(-1);
  check_float(w, {D}, "gated rms_norm weight");
  MOELORA_CHECK(eps >= 0.0, ErrorCode::kInvalidArgument, "gated rms_norm eps must be >= 0, got ",
                eps);
  const Tensor wf = w.to_f32();
  const float* wp = wf.data<float>();
  const float *xp = x.data<float>(), *zp = z.data<float>();
  Tensor y = Tensor::empty(DType::kF32, x.shape());
  float* yp = y.data<float>();
  const int64_t rows = D == 0 ? 0 : x.numel() / D;
  const float e = static_cast<float>(eps);
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * D;
      double sum_sq = 0.0;  // squares in fp32, summed in double and rounded once (as rms_norm_ref)
      for (int64_t i = 0; i < D; ++i) sum_sq += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(static_cast<float>(sum_sq) / static_cast<float>(D) + e);
      for (int64_t i = 0; i < D; ++i)
        yp[r * D + i] = wp[i] * (xr[i] * inv) * silu_f32(zp[r * D + i]);
    }
  });
  return y;
}

namespace {

void check_gdn_shape(const GdnShape& s) {
  MOELORA_CHECK(s.hidden > 0 && s.num_k_heads > 0 && s.num_v_heads > 0 && s.head_k_dim > 0 &&
                    s.head_v_dim > 0 && s.conv_kernel >= 1 && s.num_v_heads % s.num_k_heads == 0,
                ErrorCode::kInvalidArgument, "gated deltanet shape: H = ", s.hidden,
                ", nk = ", s.num_k_heads, ", nv = ", s.num_v_heads,
                " (a multiple of nk), dk = ", s.head_k_dim, ", dv = ", s.head_v_dim,
                ", conv kernel = ", s.conv_kernel);
}

}  // namespace

Tensor gdn_mix_ref(const Tensor& qkv, const Tensor& z, const Tensor& b, const Tensor& a,
                   const GdnWeights& wt, const GdnShape& s, GdnState& state, bool chunked) {
  check_gdn_shape(s);
  MOELORA_CHECK(
      qkv.defined() && qkv.ndim() == 2 && qkv.dtype() == DType::kF32 && qkv.dim(1) == s.conv_dim(),
      ErrorCode::kInvalidArgument, "gated deltanet qkv: expected F32 [T, ", s.conv_dim(), "], got ",
      describe(qkv));
  const int64_t T = qkv.dim(0), nk = s.num_k_heads, nv = s.num_v_heads;
  const int64_t dk = s.head_k_dim, dv = s.head_v_dim, kd = s.key_dim(), vd = s.value_dim();
  check_f32(z, {T, vd}, "gated deltanet z");
  check_f32(b, {T, nv}, "gated deltanet b");
  check_f32(a, {T, nv}, "gated deltanet a");
  check_float(wt.a_log, {nv}, "gated deltanet A_log");
  check_float(wt.dt_bias, {nv}, "gated deltanet dt_bias");
  check_float(wt.norm, {dv}, "gated deltanet norm");

  const Tensor conv = causal_conv1d_silu_ref(qkv, wt.conv1d, state.conv);
  const Tensor a_log = wt.a_log.to_f32(), dt_bias = wt.dt_bias.to_f32();

  // q, k normalised and repeated to the value heads; v, beta, g per value head
  Tensor q = Tensor::empty(DType::kF32, {T, nv, dk}), k = Tensor::empty(DType::kF32, {T, nv, dk});
  Tensor v = Tensor::empty(DType::kF32, {T, nv, dv});
  Tensor beta = Tensor::empty(DType::kF32, {T, nv}), g = Tensor::empty(DType::kF32, {T, nv});
  const float* src = conv.data<float>();
  const int64_t group = nv / nk;
  const float q_scale = 1.f / std::sqrt(static_cast<float>(dk));
  auto l2norm = [&](const float* in, float* out, float scale) {
    float ss = 0.f;
    for (int64_t i = 0; i < dk; ++i) ss += in[i] * in[i];
    const float inv = 1.f / std::sqrt(ss + 1e-6f);
    for (int64_t i = 0; i < dk; ++i) out[i] = in[i] * inv * scale;
  };
  for (int64_t t = 0; t < T; ++t) {
    const float* row = src + t * s.conv_dim();
    for (int64_t h = 0; h < nv; ++h) {
      const int64_t kh = h / group;
      l2norm(row + kh * dk, q.data<float>() + (t * nv + h) * dk, q_scale);
      l2norm(row + kd + kh * dk, k.data<float>() + (t * nv + h) * dk, 1.f);
      std::copy(row + 2 * kd + h * dv, row + 2 * kd + (h + 1) * dv,
                v.data<float>() + (t * nv + h) * dv);
      beta.data<float>()[t * nv + h] = sigmoid_f32(b.data<float>()[t * nv + h]);
      g.data<float>()[t * nv + h] =
          -std::exp(a_log.data<float>()[h]) *
          softplus_f32(a.data<float>()[t * nv + h] + dt_bias.data<float>()[h]);
    }
  }
  const Tensor o = chunked ? gated_delta_rule_chunked_ref(q, k, v, g, beta, state.recurrent)
                           : gated_delta_rule_recurrent_ref(q, k, v, g, beta, state.recurrent);
  return rms_norm_gated_ref(o, z.reshape({T, nv, dv}), wt.norm, s.norm_eps).reshape({T, vd});
}

Tensor gdn_forward_ref(const Tensor& x, const GdnWeights& wt, const GdnShape& s, GdnState& state,
                       bool chunked) {
  check_gdn_shape(s);
  MOELORA_CHECK(x.defined() && x.ndim() == 2 && x.dtype() == DType::kF32 && x.dim(1) == s.hidden,
                ErrorCode::kInvalidArgument, "gated deltanet input: expected F32 [T, ", s.hidden,
                "], got ", describe(x));
  const int64_t H = s.hidden, nv = s.num_v_heads, vd = s.value_dim();
  check_float(wt.in_proj_qkv, {s.conv_dim(), H}, "gated deltanet in_proj_qkv");
  check_float(wt.in_proj_z, {vd, H}, "gated deltanet in_proj_z");
  check_float(wt.in_proj_b, {nv, H}, "gated deltanet in_proj_b");
  check_float(wt.in_proj_a, {nv, H}, "gated deltanet in_proj_a");
  check_float(wt.out_proj, {H, vd}, "gated deltanet out_proj");
  const Tensor normed =
      gdn_mix_ref(linear_ref(x, wt.in_proj_qkv.to_f32()), linear_ref(x, wt.in_proj_z.to_f32()),
                  linear_ref(x, wt.in_proj_b.to_f32()), linear_ref(x, wt.in_proj_a.to_f32()), wt, s,
                  state, chunked);
  return linear_ref(normed, wt.out_proj.to_f32());
}

}  // namespace moelora::ops
