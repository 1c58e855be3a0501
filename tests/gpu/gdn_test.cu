// The Gated DeltaNet mix on the GPU (ops/gdn/gdn_cuda.cuh) against gdn_mix_ref (recurrent form)
// on random inputs (seed printed, MOELORA_TEST_SEED overrides):
//   - decode steps (one token per sequence) and prefill (T = 1, 7, 65, 130 per sequence, mixed
//     with decode rows), nv / nk = 1 and 2, (dk, dv) in {64, 128}^2, slots not in batch order,
//     strided rows (odd strides for qkv, z, b and a);
//   - every call also carries a sequence with slot -1, one with a slot past num_slots and an empty
//     one, and rows past the batch: their output rows keep a sentinel and no state they could
//     reach changes; the slots of sequences not in the batch stay bitwise as they were;
//   - the same with the chunked rule kernel on (sequences of 16 tokens or more, among them 15, 16,
//     64, 65 and 130 tokens: below, at, on and past its thresholds and chunk boundaries), and a
//     2048-token prompt at Qwen3.5's shape (32 chunks);
//   - a prompt fed in two calls, then decode steps, gives bitwise the outputs and states of one
//     call (and matches the reference); with the chunked kernel bitwise when the split falls on a
//     chunk boundary, within its bounds elsewhere;
//   - the rule kernel's grid alternates between two CTAs per SM, two CTAs in all and one per
//     (sequence, head), so its item loop and state prefetch run with one and with many items;
//   - LoRA deltas of the inputs read beside them (GdnInputDelta): sequences whose rows carry a
//     delta (base rows + delta rows, the reference given bf16(base + delta), what an in-place add
//     leaves) mixed with sequences without one (delta rows NaN, row slot -1), in decode steps and
//     in multi-row sequences of the recurrent rule (the conv taps of earlier rows and the rule
//     kernel's conv state update read deltas too); the conv states stay bitwise;
//   - can_implement_gdn_mix names the argument it rejects (no device needed);
//   - the decode step at Qwen3.5's shape (nv = 32, nk = 16, dk = dv = 128): checked, then timed for
//     B = 1 .. 64 with achieved GB/s printed (no timing assertion).
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
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "gpu/gpu_test_util.cuh"
#include "ops/gdn/gdn.h"
#include "ops/gdn/gdn_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

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

GdnShape shape_of(const GdnConfig& c) {
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

std::vector<uint16_t> random_bf16(std::mt19937_64& rng, size_t n, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = f32_to_bf16_bits(dist(rng));
  return out;
}

Tensor bf16_rows_to_f32(const std::vector<uint16_t>& bits, int64_t rows, int64_t cols) {
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
std::vector<uint16_t> bf16_sum(const std::vector<uint16_t>& x, const std::vector<uint16_t>& d) {
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

// ---------------------------------------------------------------- decode

TEST(Sm90_Gdn, DecodeStepsMatchReference) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(1101));
  const GdnConfig configs[] = {
      {"nk 2 nv 4 dk 128 dv 128", 2, 4, 128, 128, 4, 11},
      {"nk 3 nv 3 dk 64 dv 64", 3, 3, 64, 64, 4, 7},
      {"nk 1 nv 2 dk 64 dv 128", 1, 2, 64, 128, 4, 6},
      {"nk 2 nv 2 dk 128 dv 64, K 3", 2, 2, 128, 64, 3, 6},
  };
  for (const GdnConfig& c : configs) {
    GdnRig rig(c, rng, 64, 16);
    // Slots out of batch order; a slot left out of the batch each step.
    std::vector<int> slots = {c.num_slots - 1, 2, 0, 3, 4};
    for (int step = 0; step < 4; ++step) {
      std::vector<SeqInput> seqs;
      for (int slot : slots) seqs.push_back(rig.random_seq(rng, slot, 1));
      rig.run_and_check(rng, seqs, "decode step " + std::to_string(step));
      std::rotate(slots.begin(), slots.begin() + 1, slots.end());
      if (step == 1) slots.pop_back();
    }
  }
}

// ---------------------------------------------------------------- LoRA deltas of the inputs

// The in-projection's LoRA delta read beside the inputs (GdnInputDelta, the model's decode path):
// decode steps and recurrent-rule prefills (rows of earlier tokens in the conv taps, the rule
// kernel's conv state update) with sequences that carry a delta beside ones that do not.
TEST(Sm90_Gdn, InputDeltasAreAddedAsTheInputsAreRead) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(1104));
  const GdnConfig configs[] = {
      {"nk 2 nv 4 dk 128 dv 128", 2, 4, 128, 128, 4, 9},
      {"nk 2 nv 2 dk 64 dv 64, K 3", 2, 2, 64, 64, 3, 9},
  };
  for (const GdnConfig& c : configs) {
    GdnRig rig(c, rng, 64, 16);
    // Prefill of the recurrent rule (T = 1, 2, 9, 17; the second and fourth without a delta).
    const std::vector<std::pair<int, int>> prefill = {{3, 9}, {0, 2}, {5, 1}, {6, 17}};
    std::vector<SeqInput> seqs;
    for (size_t i = 0; i < prefill.size(); ++i)
      seqs.push_back(rig.random_seq(rng, prefill[i].first, prefill[i].second, i % 2 == 0));
    rig.run_and_check(rng, seqs, "prefill with deltas");
    // Decode steps: the delta moves from sequence to sequence; one step without any.
    for (int step = 0; step < 3; ++step) {
      seqs.clear();
      for (size_t i = 0; i < prefill.size(); ++i)
        seqs.push_back(rig.random_seq(rng, prefill[i].first, 1, step < 2 && (i + step) % 2 == 1));
      rig.run_and_check(rng, seqs, "decode step " + std::to_string(step) + " with deltas");
    }
  }
}

// ---------------------------------------------------------------- prefill

TEST(Sm90_Gdn, PrefillMatchesReference) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(1102));
  const GdnConfig configs[] = {
      {"nk 2 nv 4 dk 64 dv 128", 2, 4, 64, 128, 4, 7},
      {"nk 2 nv 2 dk 128 dv 64", 2, 2, 128, 64, 4, 7},
      {"nk 1 nv 2 dk 128 dv 128", 1, 2, 128, 128, 4, 7},
      {"nk 2 nv 4 dk 64 dv 64, K 2", 2, 4, 64, 64, 2, 7},
  };
  for (const int chunked_min : {0, kTestChunkedMin}) {
    for (const GdnConfig& c : configs) {
      SCOPED_TRACE(chunked_min ? "chunked rule from 16 tokens" : "recurrent rule only");
      GdnRig rig(c, rng, 320, 16);
      rig.set_chunked_min_tokens(chunked_min);
      // T = 1 (shorter than the conv window), 130 and 65 (past a 64-token chunk), 64 (one whole
      // chunk), 16 and 15 (at and below the chunked form's threshold); slots out of order, odd
      // slots fresh and even ones with a history.
      const std::vector<std::pair<int, int>> prefill = {{3, 1},  {0, 130}, {5, 65},
                                                        {6, 64}, {4, 16},  {2, 15}};
      std::vector<SeqInput> seqs;
      for (const auto& [slot, T] : prefill) seqs.push_back(rig.random_seq(rng, slot, T));
      rig.run_and_check(rng, seqs, "prefill");
      // Decode steps after the prefill, one of them batched with a new prompt on slot 1.
      for (int step = 0; step < 2; ++step) {
        seqs.clear();
        for (const auto& [slot, T] : prefill) seqs.push_back(rig.random_seq(rng, slot, 1));
        if (step == 1) seqs.insert(seqs.begin() + 2, rig.random_seq(rng, 1, 33));
        rig.run_and_check(rng, seqs, "decode step " + std::to_string(step) + " after prefill");
      }
    }
  }
}

// A prompt fed in one call (slot 1) and in two calls (slot 3, from the same initial state), then
// decode steps on both: equal outputs and states, and both match the reference. Bitwise with the
// recurrent rule (any split) and with the chunked rule split on a chunk boundary; with the chunked
// rule split inside a chunk only the reference bounds hold.
TEST(Sm90_Gdn, SplitPrefillEqualsOneCall) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(1103));
  struct Split {
    int chunked_min, first;
    bool bitwise;
  };
  const Split splits[] = {{0, 67, true},
                          {kTestChunkedMin, ops::cuda::kGdnChunkTokens, true},
                          {kTestChunkedMin, 67, false}};
  for (const Split& split : splits) {
    for (const GdnConfig& c : {GdnConfig{"nk 2 nv 4 dk 128 dv 128", 2, 4, 128, 128, 4, 4},
                               GdnConfig{"nk 2 nv 2 dk 64 dv 64", 2, 2, 64, 64, 4, 4}}) {
      SCOPED_TRACE("chunked_min_tokens " + std::to_string(split.chunked_min) + ", split at " +
                   std::to_string(split.first));
      GdnRig rig(c, rng, 256, 8);
      rig.set_chunked_min_tokens(split.chunked_min);
      // Slots 1 and 3 both start from zeros (the rig's odd slots): a new prompt.
      const int one = 1, two = 3, T = 150, first = split.first;
      const SeqInput prompt = rig.random_seq(rng, one, T);
      auto part = [&](int slot, int from, int to) {
        SeqInput s;
        s.slot = slot;
        s.T = to - from;
        const int cd = rig.conv_dim(), vd = static_cast<int>(rig.shape().value_dim());
        const int nv = c.nv;
        s.qkv.assign(prompt.qkv.begin() + from * cd, prompt.qkv.begin() + to * cd);
        s.z.assign(prompt.z.begin() + from * vd, prompt.z.begin() + to * vd);
        s.b.assign(prompt.b.begin() + from * nv, prompt.b.begin() + to * nv);
        s.a.assign(prompt.a.begin() + from * nv, prompt.a.begin() + to * nv);
        return s;
      };
      const SeqInput other = rig.random_seq(rng, 0, 1);  // a decode row batched with the prompt
      const auto whole = rig.run_and_check(rng, {other, part(one, 0, T)}, "whole prompt");
      const auto head = rig.run_and_check(rng, {part(two, 0, first)}, "prompt part 1");
      const auto tail =
          rig.run_and_check(rng, {part(two, first, T), rig.random_seq(rng, 0, 1)}, "prompt part 2");
      if (!split.bitwise) continue;  // the reference checks above are the contract
      std::vector<uint16_t> joined = head[0];
      joined.insert(joined.end(), tail[0].begin(), tail[0].end());
      EXPECT_TRUE(whole[1] == joined) << "prompt outputs differ between one call and two";
      EXPECT_TRUE(rig.slots_equal(one, two)) << "states differ after one call and after two";
      for (int step = 0; step < 3; ++step) {
        SeqInput a = rig.random_seq(rng, one, 1), b = a;
        b.slot = two;
        const auto got = rig.run_and_check(rng, {b, a}, "decode step " + std::to_string(step));
        EXPECT_TRUE(got[0] == got[1]) << "decode step " << step << " differs after a split prompt";
      }
      EXPECT_TRUE(rig.slots_equal(one, two)) << "states differ after the decode steps";
    }
  }
}

// ---------------------------------------------------------------- argument checks

TEST(Gdn, CanImplementNamesTheProblem) {
  // Fake, aligned addresses: the checks never dereference them.
  auto fake = [](uintptr_t a) { return reinterpret_cast<void*>(a); };
  GdnMixArgs ok;
  ok.shape = shape_of({"qwen3.5", 16, 32, 128, 128, 4, 8});
  ok.cu_seqlens = static_cast<const int32_t*>(fake(0x1000));
  ok.slots = static_cast<const int32_t*>(fake(0x2000));
  ok.max_seqs = 4;
  ok.max_tokens = 4;
  ok.qkv = ok.z = ok.b = ok.a = ok.conv_weight = static_cast<const __nv_bfloat16*>(fake(0x3000));
  ok.qkv_stride = ok.shape.conv_dim();
  ok.z_stride = ok.shape.value_dim();
  ok.b_stride = ok.a_stride = 32;
  ok.a_log = ok.dt_bias = ok.norm_weight = static_cast<const float*>(fake(0x4000));
  ok.conv_state = static_cast<__nv_bfloat16*>(fake(0x5000));
  ok.recurrent_state = static_cast<float*>(fake(0x6000));
  ok.num_slots = 8;
  ok.out = static_cast<__nv_bfloat16*>(fake(0x7000));
  ok.out_stride = ok.shape.value_dim();
  ok.workspace = fake(0x8000);
  ok.workspace_bytes = ops::cuda::gdn_mix_workspace_bytes(ok.shape, 4);
  EXPECT_TRUE(ops::cuda::can_implement_gdn_mix(ok).is_ok())
      << ops::cuda::can_implement_gdn_mix(ok).message();

  auto rejects = [&](const char* what, auto edit, const std::vector<std::string>& needles) {
    SCOPED_TRACE(what);
    GdnMixArgs a = ok;
    edit(a);
    const Status s = ops::cuda::can_implement_gdn_mix(a);
    ASSERT_FALSE(s.is_ok());
    for (const auto& n : needles) EXPECT_NE(s.message().find(n), std::string::npos) << s.message();
    const std::string thrown = test::error_message([&] { ops::cuda::launch_gdn_mix(a, nullptr); });
    EXPECT_EQ(thrown, s.message());
  };
  rejects("dk 96", [](GdnMixArgs& a) { a.shape.head_k_dim = 96; },
          {"dk = 96", "supported: 64, 128"});
  rejects("dv 256", [](GdnMixArgs& a) { a.shape.head_v_dim = 256; }, {"dv = 256"});
  rejects("nv % nk", [](GdnMixArgs& a) { a.shape.num_v_heads = 24; },
          {"num_v_heads 24", "num_k_heads 16"});
  rejects("conv 5", [](GdnMixArgs& a) { a.shape.conv_kernel = 5; }, {"width 5", "2 .. 4"});
  rejects("no state", [](GdnMixArgs& a) { a.recurrent_state = nullptr; }, {"recurrent_state"});
  rejects("qkv stride", [](GdnMixArgs& a) { a.qkv_stride = 100; }, {"qkv_stride 100", "8192"});
  rejects("z stride", [](GdnMixArgs& a) { a.z_stride = 4000; }, {"z_stride 4000", "4096"});
  rejects("out stride", [](GdnMixArgs& a) { a.out_stride = 4098; }, {"out_stride 4098"});
  rejects("workspace", [](GdnMixArgs& a) { a.workspace_bytes -= 1; }, {"workspace", "too small"});
  rejects("slots", [](GdnMixArgs& a) { a.num_slots = 0; }, {"num_slots"});
  GdnMixArgs with_delta = ok;
  with_delta.delta.qkv = with_delta.delta.z = with_delta.delta.b = with_delta.delta.a =
      static_cast<const __nv_bfloat16*>(fake(0x9000));
  with_delta.delta.stride = ok.shape.conv_dim() + ok.shape.value_dim() + 64;
  with_delta.delta.row_slot = static_cast<const int32_t*>(fake(0xa000));
  EXPECT_TRUE(ops::cuda::can_implement_gdn_mix(with_delta).is_ok())
      << ops::cuda::can_implement_gdn_mix(with_delta).message();
  ok = with_delta;
  rejects("delta without row slots", [](GdnMixArgs& a) { a.delta.row_slot = nullptr; },
          {"delta needs all of qkv, z, b, a and row_slot"});
  rejects("delta stride", [](GdnMixArgs& a) { a.delta.stride = 100; },
          {"delta.stride 100", "conv_dim 8192"});
  rejects("delta with the chunked rule", [](GdnMixArgs& a) { a.chunked_min_tokens = 64; },
          {"chunked_min_tokens = 64", "recurrent kernels only"});
}

// ---------------------------------------------------------------- Qwen3.5 decode bandwidth

// Median and minimum time in us of one launch_gdn_mix call (CUDA events around each, L2 flushed
// before each), over `timed` calls after `warmup` untimed ones. The states change from call to
// call; only the time is used.
std::pair<double, double> time_mix(const GdnMixArgs& args, const cuda::DeviceBuffer& flush,
                                   cuda::Stream& stream, int warmup, int timed) {
  std::vector<cuda::Event> start, stop;
  for (int i = 0; i < warmup + timed; ++i) {
    start.emplace_back(true);
    stop.emplace_back(true);
  }
  for (int i = 0; i < warmup + timed; ++i) {
    MOELORA_CUDA_CHECK(cudaMemsetAsync(flush.get(), i & 0xff, flush.bytes(), stream.get()));
    start[i].record(stream.get());
    ops::cuda::launch_gdn_mix(args, stream.get());
    stop[i].record(stream.get());
  }
  stream.synchronize();
  std::vector<float> ms;
  for (int i = warmup; i < warmup + timed; ++i)
    ms.push_back(cuda::Event::elapsed_ms(start[i], stop[i]));
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2] * 1e3, ms.front() * 1e3};
}

// The real shape: checked at B = 64 against the reference, then the decode step timed (CUDA
// events around each launch, L2 flushed before each, 20 warm-ups, 100 timed, median and min) for
// B = 1 .. 64. Prints the state bytes per step and the achieved GB/s (state only and all bytes)
// against the device's peak. No timing assertion.
TEST(Sm90_Gdn, DecodeBandwidthQwen35Shape) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(1104));
  const int max_b = 64;
  const GdnConfig c{"qwen3.5 nk 16 nv 32 dk 128 dv 128", 16, 32, 128, 128, 4, max_b};
  GdnRig rig(c, rng, max_b + 8, max_b + 4);
  std::vector<int> order(max_b);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<SeqInput> seqs;
  for (int slot : order) seqs.push_back(rig.random_seq(rng, slot, 1));
  rig.run_and_check(rng, seqs, "decode at B = 64");

  const cuda::DeviceInfo info = cuda::device_info(0);
  const double peak_gbs =
      2.0 * info.memory_clock_khz * 1e3 * (info.memory_bus_width_bits / 8.0) / 1e9;
  cuda::DeviceBuffer flush(static_cast<size_t>(std::max(info.l2_bytes, 1 << 20)) * 4);
  cuda::Stream stream;
  const GdnShape& s = rig.shape();
  std::printf("gdn decode, nv %lld nk %lld dk %lld dv %lld; peak %.0f GB/s (%s)\n",
              static_cast<long long>(s.num_v_heads), static_cast<long long>(s.num_k_heads),
              static_cast<long long>(s.head_k_dim), static_cast<long long>(s.head_v_dim), peak_gbs,
              info.name.c_str());
  for (int B : {1, 8, 16, 32, 64}) {
    std::vector<SeqInput> batch(seqs.begin(), seqs.begin() + B);
    GdnMixArgs args = rig.stage(rng, batch, /*padding=*/false);
    args.num_sms = info.num_sms;
    const double state_bytes = 2.0 * B * s.num_v_heads * s.head_k_dim * s.head_v_dim * 4;
    const double other_bytes =
        B * (2.0 * s.conv_dim() * (s.conv_kernel - 1) * 2    // conv state read twice
             + 1.0 * s.conv_dim() * (s.conv_kernel - 1) * 2  // and written
             + s.conv_dim() * 2.0 + s.value_dim() * 2.0 * 2  // qkv, z, out
             + 2.0 * (2 * s.key_dim() + s.value_dim() + 2 * s.num_v_heads + s.num_k_heads) *
                   4);  // the workspace row, written and read
    const auto [med_us, min_us] = time_mix(args, flush, stream, 20, 100);
    const double state_gbs = state_bytes / (med_us * 1e-6) / 1e9;
    const double all_gbs = (state_bytes + other_bytes) / (med_us * 1e-6) / 1e9;
    std::printf(
        "  B %3d: median %7.2f us, min %7.2f us; state %6.1f MB -> %6.0f GB/s (%4.1f%% of peak), "
        "all bytes %6.0f GB/s (%4.1f%%)\n",
        B, med_us, min_us, state_bytes / 1e6, state_gbs, 100.0 * state_gbs / peak_gbs, all_gbs,
        100.0 * all_gbs / peak_gbs);
  }
}

// ---------------------------------------------------------------- Qwen3.5 prefill

// The real shape: a 2048-token prompt (32 chunks) checked against the reference with the chunked
// rule, one of 200 tokens with the recurrent rule; then a prefill call of 2048 tokens timed (as the
// decode test does: 3 warm-ups, 10 timed) split as 1 x 2048, 4 x 512, 16 x 128, 32 x 64 and 64 x 32
// prompts, with the recurrent rule alone and with the chunked rule from 1 token on (every prompt
// chunked), printing each's time and the speedup (what kGdnChunkedMinTokens is chosen from).
// The chunked rule's products cost 2 C (2 dk + dv) + 2 dk dv (2 + 1) flops per token and head (C =
// 64): ~0.3 Gflop per 2048 tokens and head; the time printed is the whole call (conv kernel
// included). No timing assertion.
TEST(Sm90_Gdn, PrefillQwen35Shape) {
  MOELORA_REQUIRE_SM90();
  std::mt19937_64 rng(test::test_seed(1105));
  const int total = 2048;
  const GdnConfig c{"qwen3.5 nk 16 nv 32 dk 128 dv 128", 16, 32, 128, 128, 4, 66};
  GdnRig rig(c, rng, total + 8, 68);
  rig.set_chunked_min_tokens(kTestChunkedMin);
  rig.run_and_check(rng, {rig.random_seq(rng, 1, total)}, "2048-token prompt, chunked rule");
  rig.set_chunked_min_tokens(0);
  rig.run_and_check(rng, {rig.random_seq(rng, 3, 200)}, "200-token prompt, recurrent rule");

  const cuda::DeviceInfo info = cuda::device_info(0);
  cuda::DeviceBuffer flush(static_cast<size_t>(std::max(info.l2_bytes, 1 << 20)) * 4);
  cuda::Stream stream;
  std::printf("gdn prefill of %d tokens, nv 32 nk 16 dk 128 dv 128 (%s)\n", total,
              info.name.c_str());
  for (int prompts : {1, 4, 16, 32, 64}) {
    std::vector<SeqInput> batch;
    for (int i = 0; i < prompts; ++i) batch.push_back(rig.random_seq(rng, i, total / prompts));
    GdnMixArgs args = rig.stage(rng, batch, /*padding=*/false);
    args.num_sms = info.num_sms;
    args.chunked_min_tokens = 0;
    const double recurrent_us = time_mix(args, flush, stream, 3, 10).first;
    args.chunked_min_tokens = 1;
    const double chunked_us = time_mix(args, flush, stream, 3, 10).first;
    std::printf("  %2d x %4d tokens: recurrent rule %8.1f us, chunked rule %8.1f us (%.2fx)\n",
                prompts, total / prompts, recurrent_us, chunked_us, recurrent_us / chunked_us);
  }
}

}  // namespace
}  // namespace moelora
