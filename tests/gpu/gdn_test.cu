// The Gated DeltaNet mix on the GPU (ops/gdn/gdn_cuda.cuh) against gdn_mix_ref (recurrent form)
// on random inputs (seed printed, MOELORA_TEST_SEED overrides), through the rig of gdn_rig.cuh
// (which states the tolerances):
//   - decode steps (one token per sequence) and prefill (T = 1, 7, 65, 130 per sequence, mixed
//     with decode rows), nv / nk = 1 and 2, (dk, dv) in {64, 128}^2, slots not in batch order,
//     strided rows (odd strides for qkv, z, b and a);
//   - every call also carries a sequence with slot -1, one with a slot past num_slots and an empty
//     one, and rows past the batch: their output rows keep a sentinel and no state they could
//     reach changes; the slots of sequences not in the batch stay bitwise as they were;
//   - the same with the chunked rule kernel on (sequences of 16 tokens or more, among them 15, 16,
//     64, 65 and 130 tokens: below, at, on and past its thresholds and chunk boundaries);
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
//   - can_implement_gdn_mix names the argument it rejects (no device needed).
// Qwen3.5's real shape (checked, then timed): gdn_qwen35_shape_test.cu.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "gpu/gdn_rig.cuh"

namespace moelora::gdn_test {
namespace {

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
  std::mt19937_64 rng(test::test_seed(1106));
  const GdnConfig configs[] = {
      {"nk 2 nv 4 dk 128 dv 128", 2, 4, 128, 128, 4, 9},
      {"nk 2 nv 2 dk 64 dv 64, K 3", 2, 2, 64, 64, 3, 9},
      {"nk 1 nv 2 dk 64 dv 128, K 2", 1, 2, 64, 128, 2, 9},
      {"nk 2 nv 2 dk 128 dv 64", 2, 2, 128, 64, 4, 9},
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
          {"delta needs all of qkv, z, b, a and row_slot", "null: delta.row_slot"});
  rejects("delta stride", [](GdnMixArgs& a) { a.delta.stride = 100; },
          {"delta.stride 100", "conv_dim 8192"});
  rejects("delta with the chunked rule", [](GdnMixArgs& a) { a.chunked_min_tokens = 64; },
          {"chunked_min_tokens = 64", "recurrent kernels only"});
}

}  // namespace
}  // namespace moelora::gdn_test
