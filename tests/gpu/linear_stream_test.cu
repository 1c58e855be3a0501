// The dense decode projection's weight-streaming kernel (ops/linear/linear_stream_cuda.cuh) against
// the CPU reference ops::linear_ref on random bf16 inputs (seed printed):
//   - the shapes of the engine's projections at decode sizes (Qwen3-30B-A3B qkv and o_proj,
//     Qwen3.5 in-projection, a Kimi-K2.5-like K = 7168) and odd ones: rows 1 .. 64 (every wgmma
//     width), n not a multiple of 64, a single tile cut over many CTAs, strided x and y;
//   - PERF.md's bf16 rule against the reference, y's padding rows and columns untouched, the
//     tickets back at zero, the same bits on a second launch and in a graph replay, any grid
//     size (1, 7 and all SMs) within the rule;
//   - a programmatic launch after a kernel that lets its dependents start at once and writes x
//     late: the projection reads the written x (its x copies wait for the previous grid);
//   - refusals before anything is enqueued (rows, k, workspace, strides).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "core/cuda_launch.cuh"
#include "core/cuda_utils.h"
#include "core/dtype.h"
#include "core/sm90_ptx.cuh"
#include "gpu/gpu_test_util.cuh"
#include "ops/linear/linear.h"
#include "ops/linear/linear_stream_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

struct Shape {
  int rows, n, k;
  int64_t ldx = 0, ldy = 0;  // 0: dense
  const char* what;
};

std::vector<uint16_t> random_bf16(std::mt19937_64& rng, size_t n, float stddev) {
  std::normal_distribution<float> dist(0.f, stddev);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = f32_to_bf16_bits(dist(rng));
  return out;
}

constexpr uint16_t kSentinel = 0x7fc1;  // a NaN no kernel writes

// Inputs, workspace and output of one shape on the device, and the CPU reference.
struct Case {
  Shape s;
  int64_t ldx, ldy;
  std::vector<uint16_t> x, w;
  cuda::DeviceBuffer x_d, w_d, y_d, partials_d, tickets_d;
  ops::cuda::LinearStreamWorkspace ws;
  Tensor reference;

  Case(const Shape& shape, uint64_t seed, int num_sms) : s(shape) {
    ldx = s.ldx ? s.ldx : s.k;
    ldy = s.ldy ? s.ldy : s.n;
    std::mt19937_64 rng(seed);
    x = random_bf16(rng, static_cast<size_t>(s.rows) * ldx, 1.f);
    w = random_bf16(rng, static_cast<size_t>(s.n) * s.k, 0.03f);
    x_d = upload_vector(x);
    w_d = upload_vector(w);
    y_d = upload_vector(std::vector<uint16_t>(static_cast<size_t>(s.rows + 1) * ldy, kSentinel));
    partials_d = cuda::DeviceBuffer(ops::cuda::linear_stream_partial_floats(num_sms) * 4);
    ws.max_tiles = ops::cuda::linear_stream_tickets(s.n);
    tickets_d = upload_vector(std::vector<int32_t>(ws.max_tiles, 0));
    ws.partials = partials_d.as<float>();
    ws.tickets = tickets_d.as<int32_t>();
    std::vector<float> xf(static_cast<size_t>(s.rows) * s.k), wf(w.size());
    for (int t = 0; t < s.rows; ++t)
      for (int c = 0; c < s.k; ++c)
        xf[static_cast<size_t>(t) * s.k + c] =
            bf16_bits_to_f32(x[static_cast<size_t>(t) * ldx + c]);
    for (size_t i = 0; i < w.size(); ++i) wf[i] = bf16_bits_to_f32(w[i]);
    reference =
        ops::linear_ref(Tensor::from_f32(xf, {s.rows, s.k}), Tensor::from_f32(wf, {s.n, s.k}));
  }

  ops::cuda::LinearStreamArgs args() const {
    ops::cuda::LinearStreamArgs a;
    a.x = x_d.as<__nv_bfloat16>();
    a.ldx = ldx;
    a.w = w_d.as<__nv_bfloat16>();
    a.y = y_d.as<__nv_bfloat16>();
    a.ldy = ldy;
    a.rows = s.rows;
    a.n = s.n;
    a.k = s.k;
    a.ws = ws;
    return a;
  }

  std::vector<uint16_t> output() const {
    return download_vector<uint16_t>(y_d, static_cast<size_t>(s.rows + 1) * ldy);
  }

  // The rule against the reference, and every element outside [rows, n] still the sentinel.
  void check(const std::vector<uint16_t>& y, const char* when) const {
    SCOPED_TRACE(::testing::Message() << s.what << " (rows " << s.rows << ", n " << s.n << ", k "
                                      << s.k << "), " << when);
    std::vector<float> got(static_cast<size_t>(s.rows) * s.n);
    size_t touched = 0;
    for (int t = 0; t <= s.rows; ++t)
      for (int64_t c = 0; c < ldy; ++c) {
        const uint16_t v = y[static_cast<size_t>(t) * ldy + c];
        if (t < s.rows && c < s.n)
          got[static_cast<size_t>(t) * s.n + c] = bf16_bits_to_f32(v);
        else
          touched += v != kSentinel;
      }
    EXPECT_EQ(touched, 0u) << "elements outside the rows x n output were written";
    EXPECT_TRUE(test::close_bf16(Tensor::from_f32(got, {s.rows, s.n}), reference));
  }

  void expect_tickets_zero() const {
    const auto tickets = download_vector<int32_t>(tickets_d, ws.max_tiles);
    EXPECT_EQ(std::count(tickets.begin(), tickets.end(), 0), ws.max_tiles)
        << "a ticket was left non-zero";
  }
};

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> list = {
      {1, 64, 64, 0, 0, "one tile, one k block"},
      {5, 100, 192, 0, 0, "n past a tile, rows < 8"},
      {16, 5120, 2048, 0, 0, "Qwen3-30B-A3B qkv"},
      {16, 2048, 4096, 0, 0, "Qwen3-30B-A3B o_proj"},
      {32, 12352, 2048, 0, 0, "Qwen3.5-35B-A3B in-projection"},
      {8, 32, 2048, 0, 0, "one half tile cut over many CTAs"},
      {24, 576, 7168, 0, 0, "K = 7168 (Kimi-K2.5 kv_a)"},
      {64, 1000, 640, 0, 0, "64 rows, odd n"},
      {33, 200, 256, 320, 264, "strided x and y"},
      {9, 2048, 512, 0, 0, "16-wide pass at 9 rows"},
  };
  return list;
}

TEST(Sm90_LinearStream, MatchesTheReferenceAtEveryShape) {
  MOELORA_REQUIRE_SM90();
  const int num_sms = cuda::device_info().num_sms;
  const uint64_t seed = test::test_seed(9101);
  cuda::Stream stream;
  for (const Shape& s : shapes()) {
    Case c(s, seed + s.n + s.k, num_sms);
    ops::cuda::launch_linear_stream(c.args(), num_sms, /*pdl=*/false, stream.get());
    stream.synchronize();
    const std::vector<uint16_t> first = c.output();
    c.check(first, "first launch");
    c.expect_tickets_zero();
    ops::cuda::launch_linear_stream(c.args(), num_sms, /*pdl=*/true, stream.get());
    stream.synchronize();
    EXPECT_EQ(c.output(), first) << s.what << ": a second launch gave other bits";
    c.expect_tickets_zero();
  }
}

TEST(Sm90_LinearStream, GraphReplaysEqualTheEagerLaunch) {
  MOELORA_REQUIRE_SM90();
  const int num_sms = cuda::device_info().num_sms;
  cuda::Stream stream;
  Case c({16, 5120, 2048, 0, 0, "Qwen3-30B-A3B qkv"}, test::test_seed(9102), num_sms);
  ops::cuda::launch_linear_stream(c.args(), num_sms, /*pdl=*/true, stream.get());
  stream.synchronize();
  const std::vector<uint16_t> eager = c.output();
  test::CapturedGraph graph(stream.get(), [&](cudaStream_t s) {
    // Two programmatic launches back to back: the second's partials and tickets wait for the first.
    ops::cuda::launch_linear_stream(c.args(), num_sms, /*pdl=*/true, s);
    ops::cuda::launch_linear_stream(c.args(), num_sms, /*pdl=*/true, s);
  });
  for (int replay = 0; replay < 3; ++replay) {
    graph.launch();
    EXPECT_EQ(c.output(), eager) << "replay " << replay;
    c.expect_tickets_zero();
  }
}

TEST(Sm90_LinearStream, AnyGridSizeMeetsTheRule) {
  MOELORA_REQUIRE_SM90();
  const int num_sms = cuda::device_info().num_sms;
  cuda::Stream stream;
  for (const int sms : {1, 7, num_sms}) {
    Case c({16, 2048, 4096, 0, 0, "o_proj"}, test::test_seed(9103), num_sms);
    ops::cuda::launch_linear_stream(c.args(), sms, /*pdl=*/false, stream.get());
    stream.synchronize();
    c.check(c.output(), sms == 1 ? "grid of 2 CTAs" : sms == 7 ? "grid of 14 CTAs" : "all SMs");
    c.expect_tickets_zero();
  }
}

__device__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Lets its dependents launch at once, then after `ns` writes x = source (the projection's input
// is only valid after this grid has completed).
__global__ void late_x_writer_kernel(const uint16_t* source, uint16_t* x, size_t count,
                                     uint64_t ns) {
  cuda::sm90::launch_dependents();
  const uint64_t start = global_ns();
  while (global_ns() - start < ns) __nanosleep(1000);
  for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += gridDim.x * blockDim.x)
    x[i] = source[i];
}

TEST(Sm90_LinearStream, ProgrammaticLaunchReadsTheInputOfTheKernelBefore) {
  MOELORA_REQUIRE_SM90();
  const int num_sms = cuda::device_info().num_sms;
  cuda::Stream stream;
  Case c({16, 5120, 2048, 0, 0, "qkv after a late writer"}, test::test_seed(9104), num_sms);
  const size_t count = c.x.size();
  cuda::DeviceBuffer source = upload_vector(c.x);
  for (int round = 0; round < 3; ++round) {
    MOELORA_CUDA_CHECK(cudaMemsetAsync(c.x_d.get(), 0, count * 2, stream.get()));  // stale x = 0
    ::moelora::cuda::launch_kernel(late_x_writer_kernel, dim3(8), dim3(256), 0, stream.get(),
                                   /*pdl=*/false, source.as<uint16_t>(), c.x_d.as<uint16_t>(),
                                   count, uint64_t{200'000});
    ops::cuda::launch_linear_stream(c.args(), num_sms, /*pdl=*/true, stream.get());
    stream.synchronize();
    c.check(c.output(), "after the late writer");
  }
}

TEST(Sm90_LinearStream, RefusesBadArgumentsBeforeLaunching) {
  MOELORA_REQUIRE_SM90();
  const int num_sms = cuda::device_info().num_sms;
  Case c({16, 256, 512, 0, 0, "refusals"}, test::test_seed(9105), num_sms);
  auto refused = [&](auto edit, const char* needle) {
    ops::cuda::LinearStreamArgs a = c.args();
    edit(a);
    const std::string msg =
        test::error_message([&] { ops::cuda::launch_linear_stream(a, num_sms, false, nullptr); },
                            ErrorCode::kInvalidArgument);
    EXPECT_NE(msg.find(needle), std::string::npos) << msg;
  };
  refused([](auto& a) { a.rows = 0; }, "rows = 0");
  refused([](auto& a) { a.rows = 65; }, "rows = 65");
  refused([](auto& a) { a.k = 100; }, "k = 100");
  refused([](auto& a) { a.ws.max_tiles = 3; }, "needs 4");
  refused([](auto& a) { a.ws.partials = nullptr; }, "no partials");
  refused([](auto& a) { a.ldx = 516; }, "16-byte aligned");
  refused([](auto& a) { a.ldy = 100; }, "y row stride 100");
  refused([](auto& a) { a.w = nullptr; }, "must be device pointers");
  EXPECT_FALSE(ops::cuda::linear_stream_supports(65, 64, 64));
  EXPECT_FALSE(ops::cuda::linear_stream_supports(1, 64, 96));
  EXPECT_TRUE(ops::cuda::linear_stream_supports(64, 1, 64));
}

}  // namespace
}  // namespace moelora
