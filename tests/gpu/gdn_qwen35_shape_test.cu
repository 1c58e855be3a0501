// Gated DeltaNet mix at Qwen3.5's shape (nv = 32, nk = 16, dk = dv = 128), through the rig of
// gdn_rig.cuh: the decode step checked at B = 64 against the reference, then timed for B = 1 .. 64
// with the achieved GB/s printed; a 2048-token prompt (32 chunks) checked with the chunked rule,
// then prefill calls of 2048 tokens timed with the recurrent and the chunked rule (what
// kGdnChunkedMinTokens is chosen from). No timing assertion.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "gpu/gdn_rig.cuh"

namespace moelora::gdn_test {
namespace {

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
}  // namespace moelora::gdn_test
