// The rig of the Gated DeltaNet mix tests (gdn_test.cu, gdn_qwen35_shape_test.cu): one layer's
// weights, device states and buffers with the reference's states beside them; each call is staged
// (inputs uploaded, padding sequences added), launched and checked against gdn_mix_ref.
//
// Tolerances. The reference runs in fp32 on the same bf16 inputs and weights (bf16 values are
// exact in fp32), so the only differences are fp32 rounding orders (the S^T k / S^T q reductions,
// S^T q regrouped as decay S^T q + (k.q) delta, CUDA's expf) and the bf16 rounding of the output:
//   - recurrent state (fp32 on both sides): |x - ref| <= 1e-4 |ref| + 1e-4 max|ref| per slot;
//   - conv state: bitwise (it holds copies of bf16 inputs);
//   - output (bf16): |x - ref| <= (2^-8 + 1e-4) |ref| + 1e-5 max|ref|: bf16's rounding (half an
//     ulp, 2^-8 relative at most: 8 significant bits) plus the fp32 differences, and a floor for
//     outputs near zero (cancellation in o).
// The chunked rule kernel multiplies on the tensor cores in TF32 (operands rounded to 10 mantissa
// bits, relative 2^-11 each, fp32 sums), so a slot it has touched (its state, and every output
// computed from it later) is held to |x - ref| <= 4e-3 |ref| + 4e-3 max|ref| (outputs: plus bf16's
// 2^-8): each product's rounding is ~1e-3 of the operands' norms, the deltas take it into the
// state, where it decays with g like the state itself (measured on the H200: see the printed
// maxima).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "gpu/gpu_test_util.cuh"
#include "ops/gdn/gdn.h"
#include "ops/gdn/gdn_cuda.cuh"
#include "support/test_support.h"

namespace moelora::gdn_test {

using ops::GdnShape;
using ops::GdnState;
using ops::cuda::GdnMixArgs;
using test::download_vector;
using test::upload_vector;

constexpr uint16_t kSentinel = 0x7f7f;  // bf16 3.39e38: never a real output
constexpr double kTf32Tol = 4e-3;       // the chunked rule kernel's bounds (file comment)
// The tests' threshold of the chunked rule (any positive value works): low enough that 16-, 33-,
// 64- and 65-token sequences take it; the model's own default is kGdnChunkedMinTokens.
constexpr int kTestChunkedMin = 16;

struct GdnConfig {
  const char* name;
  int nk, nv, dk, dv, conv_kernel;
  int num_slots;
};

inline GdnShape shape_of(const GdnConfig& c) {
  GdnShape s;
  s.hidden = 64;  // unused by the mix
  s.num_k_heads = c.nk;
  s.num_v_heads = c.nv;
  s.head_k_dim = c.dk;
  s.head_v_dim = c.dv;
  s.conv_kernel = c.conv_kernel;
  s.norm_eps = 1e-6;
  return s;
}

inline std::vector<uint16_t> random_bf16(std::mt19937_64& rng, size_t n, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = f32_to_bf16_bits(dist(rng));
  return out;
}

inline Tensor bf16_rows_to_f32(const std::vector<uint16_t>& bits, int64_t rows, int64_t cols) {
  std::vector<float> f(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) f[i] = bf16_bits_to_f32(bits[i]);
  return Tensor::from_f32(f, {rows, cols});
}

// One sequence of a call: its slot and its new rows (bf16 bits, contiguous).
struct SeqInput {
  int slot = 0;
  int T = 0;
  std::vector<uint16_t> qkv, z, b, a;  // [T, conv_dim], [T, value_dim], [T, nv], [T, nv]
  // With a LoRA delta (GdnInputDelta): the rows the kernels read are base + delta, and the inputs
  // above (the reference's) are bf16(base + delta). Empty: no delta.
  std::vector<uint16_t> base_qkv, base_z, base_b, base_a, d_qkv, d_z, d_b, d_a;
  bool has_delta() const { return !d_qkv.empty(); }
};

// bf16(x + d) with fp32 addition and round-to-nearest-even, as the kernels compute it.
inline std::vector<uint16_t> bf16_sum(const std::vector<uint16_t>& x,
                                      const std::vector<uint16_t>& d) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i)
    out[i] = f32_to_bf16_bits(bf16_bits_to_f32(x[i]) + bf16_bits_to_f32(d[i]));
  return out;
}

// Layer weights, device states and buffers for one shape, with the reference's states beside the
// GPU's. Calls are staged (inputs uploaded, padding sequences added), launched, then checked.
class GdnRig {
 public:
  GdnRig(const GdnConfig& c, std::mt19937_64& rng, int max_tokens, int max_seqs)
      : cfg_(c), shape_(shape_of(c)), max_tokens_(max_tokens), max_seqs_(max_seqs) {
    conv_dim_ = static_cast<int>(shape_.conv_dim());
    vd_ = static_cast<int>(shape_.value_dim());
    k1_ = c.conv_kernel - 1;
    // Strided rows: the kernels must honour the strides.
    qkv_stride_ = conv_dim_ + 5;
    z_stride_ = vd_ + 3;  // z rows at any element offset (a slice of a fused projection)
    ba_stride_ = c.nv + 3;
    out_stride_ = vd_ + 12;

    conv_w_ = random_bf16(rng, static_cast<size_t>(conv_dim_) * c.conv_kernel, 0.4f);
    std::uniform_real_distribution<float> a_dist(0.02f, 2.0f), dt_dist(-3.0f, 0.5f),
        w_dist(0.5f, 1.5f);
    a_log_.resize(c.nv);
    dt_bias_.resize(c.nv);
    norm_w_.resize(c.dv);
    for (auto& v : a_log_) v = std::log(a_dist(rng));  // decays from ~0.3 to ~0.999 per token
    for (auto& v : dt_bias_) v = dt_dist(rng);
    for (auto& v : norm_w_) v = w_dist(rng);
    weights_.conv1d = bf16_rows_to_f32(conv_w_, conv_dim_, c.conv_kernel);
    weights_.a_log = Tensor::from_f32(a_log_, {c.nv});
    weights_.dt_bias = Tensor::from_f32(dt_bias_, {c.nv});
    weights_.norm = Tensor::from_f32(norm_w_, {c.dv});

    // States: odd slots start from zeros (a fresh sequence), even ones from random values (a
    // sequence with a history).
    conv_state_host_.assign(static_cast<size_t>(c.num_slots) * conv_dim_ * k1_, 0);
    rec_state_host_.assign(static_cast<size_t>(c.num_slots) * c.nv * c.dk * c.dv, 0.0f);
    std::normal_distribution<float> s_dist(0.0f, 0.1f);
    const size_t conv_per = static_cast<size_t>(conv_dim_) * k1_;
    const size_t rec_per = static_cast<size_t>(c.nv) * c.dk * c.dv;
    for (int s = 0; s < c.num_slots; ++s) {
      if (s % 2 == 0) {
        const auto bits = random_bf16(rng, conv_per, 1.0f);
        std::copy(bits.begin(), bits.end(), conv_state_host_.begin() + s * conv_per);
        for (size_t i = 0; i < rec_per; ++i) rec_state_host_[s * rec_per + i] = s_dist(rng);
      }
      GdnState st = GdnState::zeros(shape_);
      for (size_t i = 0; i < conv_per; ++i)
        st.conv.data<float>()[i] = bf16_bits_to_f32(conv_state_host_[s * conv_per + i]);
      std::copy(rec_state_host_.begin() + s * rec_per, rec_state_host_.begin() + (s + 1) * rec_per,
                st.recurrent.data<float>());
      ref_states_.push_back(std::move(st));
    }

    conv_w_d_ = upload_vector(conv_w_);
    a_log_d_ = upload_vector(a_log_);
    dt_bias_d_ = upload_vector(dt_bias_);
    norm_w_d_ = upload_vector(norm_w_);
    conv_state_d_ =
        upload_vector(conv_state_host_.empty() ? std::vector<uint16_t>(1) : conv_state_host_);
    rec_state_d_ = upload_vector(rec_state_host_);
    delta_stride_ = conv_dim_ + vd_ + 2 * c.nv + 7;
    delta_d_ = cuda::DeviceBuffer(static_cast<size_t>(max_tokens) * delta_stride_ * 2);
    row_slot_d_ = cuda::DeviceBuffer(static_cast<size_t>(max_tokens) * 4);
    qkv_d_ = cuda::DeviceBuffer(static_cast<size_t>(max_tokens) * qkv_stride_ * 2);
    z_d_ = cuda::DeviceBuffer(static_cast<size_t>(max_tokens) * z_stride_ * 2);
    b_d_ = cuda::DeviceBuffer(static_cast<size_t>(max_tokens) * ba_stride_ * 2);
    a_d_ = cuda::DeviceBuffer(static_cast<size_t>(max_tokens) * ba_stride_ * 2);
    out_d_ = cuda::DeviceBuffer(static_cast<size_t>(max_tokens) * out_stride_ * 2);
    cu_d_ = cuda::DeviceBuffer(static_cast<size_t>(max_seqs + 1) * 4);
    slots_d_ = cuda::DeviceBuffer(static_cast<size_t>(max_seqs) * 4);
    ws_bytes_ = ops::cuda::gdn_mix_workspace_bytes(shape_, max_tokens);
    ws_d_ = cuda::DeviceBuffer(ws_bytes_);
  }

  const GdnShape& shape() const { return shape_; }

  // Sequences of this many tokens or more run in the chunked rule kernel (0: none).
  void set_chunked_min_tokens(int tokens) { chunked_min_ = tokens; }

  // Whether two slots hold bitwise the same conv and recurrent states on the device.
  bool slots_equal(int x, int y) const {
    const size_t conv_per = static_cast<size_t>(conv_dim_) * k1_;
    const size_t rec_per = static_cast<size_t>(cfg_.nv) * cfg_.dk * cfg_.dv;
    const std::vector<uint16_t> conv = download_conv();
    const std::vector<float> rec = download_rec();
    return std::equal(conv.begin() + x * conv_per, conv.begin() + (x + 1) * conv_per,
                      conv.begin() + y * conv_per) &&
           std::memcmp(rec.data() + x * rec_per, rec.data() + y * rec_per, rec_per * 4) == 0;
  }
  int conv_dim() const { return conv_dim_; }

  // Random rows for a sequence of T tokens; with_delta: base rows and LoRA delta rows (about a
  // quarter of the base's size), the reference's inputs their bf16 sum.
  SeqInput random_seq(std::mt19937_64& rng, int slot, int T, bool with_delta = false) const {
    SeqInput s;
    s.slot = slot;
    s.T = T;
    s.qkv = random_bf16(rng, static_cast<size_t>(T) * conv_dim_, 1.0f);
    s.z = random_bf16(rng, static_cast<size_t>(T) * vd_, 1.0f);
    s.b = random_bf16(rng, static_cast<size_t>(T) * cfg_.nv, 1.0f);
    s.a = random_bf16(rng, static_cast<size_t>(T) * cfg_.nv, 1.0f);
    if (with_delta) {
      const std::pair<std::vector<uint16_t>*, std::vector<uint16_t>*> parts[] = {
          {&s.qkv, &s.d_qkv}, {&s.z, &s.d_z}, {&s.b, &s.d_b}, {&s.a, &s.d_a}};
      std::vector<uint16_t>* bases[] = {&s.base_qkv, &s.base_z, &s.base_b, &s.base_a};
      for (int i = 0; i < 4; ++i) {
        *parts[i].second = random_bf16(rng, parts[i].first->size(), 0.25f);
        *bases[i] = *parts[i].first;
        *parts[i].first = bf16_sum(*bases[i], *parts[i].second);
      }
    }
    return s;
  }

  // Uploads the call's rows and metadata; with `padding`, appends a sequence with slot -1 (2
  // rows), an empty one and one with a slot past num_slots (1 row), and leaves 3 rows past the
  // batch. Returns the arguments (max_seqs / max_tokens: what the call uses).
  GdnMixArgs stage(std::mt19937_64& rng, const std::vector<SeqInput>& seqs, bool padding) {
    std::vector<int32_t> cu{0}, slots;
    for (const auto& s : seqs) {
      cu.push_back(cu.back() + s.T);
      slots.push_back(s.slot);
    }
    if (padding) {
      const std::pair<int, int> pads[] = {{-1, 2}, {cfg_.num_slots, 0}, {cfg_.num_slots, 1}};
      for (const auto& [slot, T] : pads) {
        cu.push_back(cu.back() + T);
        slots.push_back(slot);
      }
    }
    const int seq_count = static_cast<int>(slots.size());
    const int rows = cu.back() + (padding ? 3 : 0);
    EXPECT_LE(seq_count, max_seqs_);
    EXPECT_LE(rows, max_tokens_);

    // Rows: the sequences' inputs (their base rows where they carry a delta); padding rows random
    // (they must not be read into any result).
    bool any_delta = false;
    for (const SeqInput& s : seqs) any_delta = any_delta || s.has_delta();
    auto fill = [&](std::vector<uint16_t> SeqInput::*field, std::vector<uint16_t> SeqInput::*base,
                    int width, int64_t stride, cuda::DeviceBuffer& dst) {
      std::vector<uint16_t> host = random_bf16(rng, static_cast<size_t>(rows) * stride, 1.0f);
      for (size_t i = 0; i < seqs.size(); ++i)
        for (int t = 0; t < seqs[i].T; ++t)
          std::copy_n((seqs[i].has_delta() ? seqs[i].*base : seqs[i].*field).begin() +
                          static_cast<size_t>(t) * width,
                      width, host.begin() + static_cast<size_t>(cu[i] + t) * stride);
      dst.upload(host.data(), host.size() * 2);
    };
    fill(&SeqInput::qkv, &SeqInput::base_qkv, conv_dim_, qkv_stride_, qkv_d_);
    fill(&SeqInput::z, &SeqInput::base_z, vd_, z_stride_, z_d_);
    fill(&SeqInput::b, &SeqInput::base_b, cfg_.nv, ba_stride_, b_d_);
    fill(&SeqInput::a, &SeqInput::base_a, cfg_.nv, ba_stride_, a_d_);
    // Deltas: one row-major buffer [rows, delta_stride_] with the four inputs' column blocks;
    // NaN in the rows of sequences without a delta (row slot -1) and of the padding, which must
    // never be read.
    if (any_delta) {
      std::vector<uint16_t> delta(static_cast<size_t>(rows) * delta_stride_, 0x7fc0);
      std::vector<int32_t> row_slot(rows, -1);
      const int offsets[] = {0, conv_dim_, conv_dim_ + vd_, conv_dim_ + vd_ + cfg_.nv};
      const int widths[] = {conv_dim_, vd_, cfg_.nv, cfg_.nv};
      for (size_t i = 0; i < seqs.size(); ++i) {
        if (!seqs[i].has_delta()) continue;
        const std::vector<uint16_t>* parts[] = {&seqs[i].d_qkv, &seqs[i].d_z, &seqs[i].d_b,
                                                &seqs[i].d_a};
        for (int t = 0; t < seqs[i].T; ++t) {
          row_slot[cu[i] + t] = static_cast<int32_t>(i % 3);  // any adapter slot >= 0
          for (int p = 0; p < 4; ++p)
            std::copy_n(
                parts[p]->begin() + static_cast<size_t>(t) * widths[p], widths[p],
                delta.begin() + static_cast<size_t>(cu[i] + t) * delta_stride_ + offsets[p]);
        }
      }
      delta_d_.upload(delta.data(), delta.size() * 2);
      row_slot_d_.upload(row_slot.data(), row_slot.size() * 4);
    }
    const std::vector<uint16_t> sentinel(static_cast<size_t>(rows) * out_stride_, kSentinel);
    out_d_.upload(sentinel.data(), sentinel.size() * 2);
    cu_d_.upload(cu.data(), cu.size() * 4);
    slots_d_.upload(slots.data(), slots.size() * 4);
    cu_ = cu;
    rows_ = rows;

    GdnMixArgs a;
    a.shape = shape_;
    a.cu_seqlens = cu_d_.as<int32_t>();
    a.slots = slots_d_.as<int32_t>();
    a.max_seqs = seq_count;
    a.max_tokens = rows;
    a.qkv = qkv_d_.as<__nv_bfloat16>();
    a.qkv_stride = qkv_stride_;
    a.z = z_d_.as<__nv_bfloat16>();
    a.z_stride = z_stride_;
    a.b = b_d_.as<__nv_bfloat16>();
    a.b_stride = ba_stride_;
    a.a = a_d_.as<__nv_bfloat16>();
    a.a_stride = ba_stride_;
    if (any_delta) {
      const __nv_bfloat16* d = delta_d_.as<__nv_bfloat16>();
      a.delta.qkv = d;
      a.delta.z = d + conv_dim_;
      a.delta.b = d + conv_dim_ + vd_;
      a.delta.a = d + conv_dim_ + vd_ + cfg_.nv;
      a.delta.stride = delta_stride_;
      a.delta.row_slot = row_slot_d_.as<int32_t>();
    }
    a.conv_weight = conv_w_d_.as<__nv_bfloat16>();
    a.a_log = a_log_d_.as<float>();
    a.dt_bias = dt_bias_d_.as<float>();
    a.norm_weight = norm_w_d_.as<float>();
    a.conv_state = k1_ > 0 ? conv_state_d_.as<__nv_bfloat16>() : nullptr;
    a.recurrent_state = rec_state_d_.as<float>();
    a.num_slots = cfg_.num_slots;
    a.out = out_d_.as<__nv_bfloat16>();
    a.out_stride = out_stride_;
    a.workspace = ws_d_.get();
    a.workspace_bytes = ws_bytes_;
    a.chunked_min_tokens = chunked_min_;
    // The rule kernel's grid, in turn: two CTAs per SM looping over the items, two CTAs in all
    // (each loops over many items), one CTA per item.
    const int sms[] = {cuda::device_info(0).num_sms, 1, 0};
    a.num_sms = sms[calls_++ % 3];
    return a;
  }

  // Stages, launches and checks one call against the reference (which advances its states).
  // Returns the GPU output rows of each sequence (bf16 bits, [T, value_dim]).
  std::vector<std::vector<uint16_t>> run_and_check(std::mt19937_64& rng,
                                                   const std::vector<SeqInput>& seqs,
                                                   const std::string& what) {
    SCOPED_TRACE(std::string(cfg_.name) + ": " + what);
    const std::vector<uint16_t> conv_before = download_conv();
    const std::vector<float> rec_before = download_rec();
    const GdnMixArgs args = stage(rng, seqs, /*padding=*/true);
    cuda::Stream stream;
    ops::cuda::launch_gdn_mix(args, stream.get());
    stream.synchronize();
    const std::vector<uint16_t> out =
        download_vector<uint16_t>(out_d_, static_cast<size_t>(rows_) * out_stride_);
    const std::vector<uint16_t> conv_after = download_conv();
    const std::vector<float> rec_after = download_rec();

    // Outputs.
    std::vector<std::vector<uint16_t>> result;
    std::vector<bool> touched(cfg_.num_slots, false);
    for (const SeqInput& s : seqs)
      if (chunked_min_ > 0 && s.T >= chunked_min_) tf32_slots_.insert(s.slot);
    for (size_t i = 0; i < seqs.size(); ++i) {
      const SeqInput& s = seqs[i];
      touched[s.slot] = true;
      const Tensor want =
          ops::gdn_mix_ref(bf16_rows_to_f32(s.qkv, s.T, conv_dim_), bf16_rows_to_f32(s.z, s.T, vd_),
                           bf16_rows_to_f32(s.b, s.T, cfg_.nv), bf16_rows_to_f32(s.a, s.T, cfg_.nv),
                           weights_, shape_, ref_states_[s.slot], /*chunked=*/false);
      std::vector<uint16_t> got(static_cast<size_t>(s.T) * vd_);
      for (int t = 0; t < s.T; ++t)
        std::copy_n(out.begin() + static_cast<size_t>(cu_[i] + t) * out_stride_, vd_,
                    got.begin() + static_cast<size_t>(t) * vd_);
      check_output(got, want, i, s);
      result.push_back(std::move(got));
    }
    // Rows of skipped sequences and past the batch, and the padding columns of every row.
    int64_t written = 0;
    for (int r = 0; r < rows_; ++r) {
      const bool in_batch = r < cu_[seqs.size()];
      for (int c = in_batch ? vd_ : 0; c < out_stride_; ++c)
        written += out[static_cast<size_t>(r) * out_stride_ + c] != kSentinel;
    }
    EXPECT_EQ(written, 0) << "outputs written outside the batch's rows and columns";

    // States: the batch's slots against the reference, the others untouched (bitwise).
    const size_t conv_per = static_cast<size_t>(conv_dim_) * k1_;
    const size_t rec_per = static_cast<size_t>(cfg_.nv) * cfg_.dk * cfg_.dv;
    for (int slot = 0; slot < cfg_.num_slots; ++slot) {
      const size_t c0 = slot * conv_per, r0 = slot * rec_per;
      if (!touched[slot]) {
        EXPECT_TRUE(std::equal(conv_after.begin() + c0, conv_after.begin() + c0 + conv_per,
                               conv_before.begin() + c0))
            << "conv state of slot " << slot << " (not in the batch) changed";
        EXPECT_EQ(std::memcmp(rec_after.data() + r0, rec_before.data() + r0, rec_per * 4), 0)
            << "recurrent state of slot " << slot << " (not in the batch) changed";
        continue;
      }
      const GdnState& want = ref_states_[slot];
      int64_t conv_bad = 0, first = -1;
      for (size_t i = 0; i < conv_per; ++i) {
        if (bf16_bits_to_f32(conv_after[c0 + i]) != want.conv.data<float>()[i]) {
          if (first < 0) first = static_cast<int64_t>(i);
          ++conv_bad;
        }
      }
      EXPECT_EQ(conv_bad, 0) << "conv state of slot " << slot << ": " << conv_bad
                             << " entries differ; first at channel " << first / std::max(k1_, 1)
                             << " tap " << first % std::max(k1_, 1);
      check_recurrent(rec_after.data() + r0, want.recurrent.data<float>(), slot);
    }
    return result;
  }

 private:
  std::vector<uint16_t> download_conv() const {
    return download_vector<uint16_t>(conv_state_d_,
                                     static_cast<size_t>(cfg_.num_slots) * conv_dim_ * k1_);
  }
  std::vector<float> download_rec() const {
    return download_vector<float>(
        rec_state_d_, static_cast<size_t>(cfg_.num_slots) * cfg_.nv * cfg_.dk * cfg_.dv);
  }

  void check_output(const std::vector<uint16_t>& got, const Tensor& want, size_t seq,
                    const SeqInput& s) const {
    const float* w = want.data<float>();
    double max_ref = 0;
    for (int64_t i = 0; i < want.numel(); ++i) max_ref = std::max(max_ref, std::fabs(double(w[i])));
    const bool tf32 = tf32_slots_.count(s.slot) > 0;
    const double rtol = std::ldexp(1.0, -8) + (tf32 ? kTf32Tol : 1e-4);
    const double atol = (tf32 ? kTf32Tol : 1e-5) * max_ref;
    int64_t bad = 0;
    double max_err = 0;
    int64_t max_at = 0;
    std::ostringstream rows;
    for (int64_t i = 0; i < want.numel(); ++i) {
      const double x = bf16_bits_to_f32(got[i]), r = w[i];
      const double err = std::fabs(x - r);
      if (!(err <= max_err)) {
        max_err = err;
        max_at = i;
      }
      if (!(std::isfinite(x) && err <= atol + rtol * std::fabs(r))) {
        if (bad < 10)
          rows << "\n  token " << i / vd_ << " head " << (i % vd_) / cfg_.dv << " dim "
               << i % cfg_.dv << ": got " << x << ", want " << r;
        ++bad;
      }
    }
    if (tf32)
      std::printf("  chunked-rule slot %d (T %d): output max error %.2e of max|ref| %.3g\n", s.slot,
                  s.T, max_err / std::max(max_ref, 1e-30), max_ref);
    EXPECT_EQ(bad, 0) << "output of sequence " << seq << " (slot " << s.slot << ", T " << s.T
                      << "): " << bad << " of " << want.numel() << " differ (rtol " << rtol
                      << ", atol " << atol << "); max abs error " << max_err << " at token "
                      << max_at / vd_ << " column " << max_at % vd_ << rows.str();
  }

  void check_recurrent(const float* got, const float* want, int slot) const {
    const size_t n = static_cast<size_t>(cfg_.nv) * cfg_.dk * cfg_.dv;
    double max_ref = 0;
    for (size_t i = 0; i < n; ++i) max_ref = std::max(max_ref, std::fabs(double(want[i])));
    const bool tf32 = tf32_slots_.count(slot) > 0;
    const double rtol = tf32 ? kTf32Tol : 1e-4, atol = (tf32 ? kTf32Tol : 1e-4) * max_ref;
    int64_t bad = 0;
    double max_err = 0, max_rel = 0;
    size_t max_at = 0;
    std::ostringstream rows;
    auto where = [&](size_t i) {
      std::ostringstream os;
      const size_t per = static_cast<size_t>(cfg_.dk) * cfg_.dv;
      os << "head " << i / per << " [" << (i % per) / cfg_.dv << ", " << i % cfg_.dv << "]";
      return os.str();
    };
    for (size_t i = 0; i < n; ++i) {
      const double err = std::fabs(double(got[i]) - want[i]);
      if (!(err <= max_err)) {
        max_err = err;
        max_at = i;
      }
      max_rel = std::max(max_rel, err / (max_ref > 0 ? max_ref : 1.0));
      if (!(std::isfinite(got[i]) && err <= atol + rtol * std::fabs(want[i]))) {
        if (bad < 10) rows << "\n  " << where(i) << ": got " << got[i] << ", want " << want[i];
        ++bad;
      }
    }
    if (tf32)
      std::printf("  chunked-rule slot %d: state max error %.2e of max|ref| %.3g\n", slot, max_rel,
                  max_ref);
    EXPECT_EQ(bad, 0) << "recurrent state of slot " << slot << ": " << bad << " of " << n
                      << " differ (rtol " << rtol << ", atol " << atol << "); max abs error "
                      << max_err << " at " << where(max_at) << rows.str();
  }

  GdnConfig cfg_;
  GdnShape shape_;
  int max_tokens_, max_seqs_;
  int conv_dim_ = 0, vd_ = 0, k1_ = 0;
  int64_t qkv_stride_ = 0, z_stride_ = 0, ba_stride_ = 0, out_stride_ = 0, delta_stride_ = 0;
  std::vector<uint16_t> conv_w_;
  std::vector<float> a_log_, dt_bias_, norm_w_;
  ops::GdnWeights weights_;
  std::vector<uint16_t> conv_state_host_;
  std::vector<float> rec_state_host_;
  std::vector<GdnState> ref_states_;
  cuda::DeviceBuffer conv_w_d_, a_log_d_, dt_bias_d_, norm_w_d_, conv_state_d_, rec_state_d_;
  cuda::DeviceBuffer qkv_d_, z_d_, b_d_, a_d_, out_d_, cu_d_, slots_d_, ws_d_, delta_d_,
      row_slot_d_;
  size_t ws_bytes_ = 0;
  std::vector<int32_t> cu_;
  int rows_ = 0;
  int calls_ = 0;
  int chunked_min_ = 0;
  std::set<int>
      tf32_slots_;  // slots the chunked rule kernel has updated (TF32 bounds from then on)
};

}  // namespace moelora::gdn_test
