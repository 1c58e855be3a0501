// Sm90 MoE routers against route_ref on random inputs: the route launch on given logits (softmax
// top-k with and without renormalization, noaux_tc with groups, bias and scaling, padding tokens,
// the GEMV chain's x row quant beside it) and with the router GEMM in the same launch (logits
// against linear.h's product, routing against route_ref on them, the same bits on relaunches and
// graph replays, refusals).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.cuh"
#include "ops/linear/linear.h"
#include "ops/quant/quant.h"
#include "ops/route/route.h"
#include "ops/route/route_cuda.cuh"
#include "support/test_support.h"

namespace moelora {
namespace {

using test::download_vector;
using test::upload_vector;

// Logits with a clear gap between every pair of consecutive sorted values, so that fp32
// rounding differences between CPU and GPU cannot reorder the top-k.
Tensor separated_logits(int T, int E, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(DType::kF32, {T, E});
  std::vector<int> perm(E);
  for (int r = 0; r < T; ++r) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int e = 0; e < E; ++e) t.data<float>()[r * E + perm[e]] = -3.0f + 6.0f * e / E;
  }
  return t;
}

// quant_hidden > 0: the fused row quant of x [T, quant_hidden] too, bit-equal to the reference.
void check_route(const ops::RouteParams& params, int T, uint64_t seed, bool with_bias, int valid_tokens = -1,
                 int quant_hidden = 0) {
  std::mt19937_64 rng(test::test_seed(seed));
  const int E = static_cast<int>(params.num_experts), k = static_cast<int>(params.top_k);
  Tensor logits = separated_logits(T, E, rng);
  Tensor bias;
  if (with_bias) bias = test::random_uniform({E}, rng, -0.02f, 0.02f);
  auto ref = ops::route_ref(logits, bias, params);
  auto logits_d = cuda::to_device(logits);
  cuda::DeviceBuffer bias_d;
  if (with_bias) bias_d = cuda::to_device(bias);
  cuda::DeviceBuffer ids_d(static_cast<size_t>(T) * k * 4), w_d(static_cast<size_t>(T) * k * 4);
  cuda::DeviceBuffer num_d = upload_vector(std::vector<int32_t>{valid_tokens < 0 ? T : valid_tokens});
  ops::cuda::RouteDeviceArgs a;
  a.logits = logits_d.as<float>();
  a.correction_bias = with_bias ? bias_d.as<float>() : nullptr;
  a.num_tokens = valid_tokens < 0 ? nullptr : num_d.as<int32_t>();
  a.topk_ids = ids_d.as<int32_t>();
  a.topk_weights = w_d.as<float>();
  a.max_tokens = T;
  // L2 prefetches of other kernels' inputs (here: the logits themselves and the weight buffer)
  // change nothing in the routing.
  a.prefetch[0] = {logits_d.get(), logits_d.bytes()};
  a.prefetch[1] = {w_d.get(), w_d.bytes()};
  cuda::DeviceBuffer x_d, q_d, scale_d;
  Tensor x;
  if (quant_hidden > 0) {
    x = test::random_normal({T, quant_hidden}, rng, 2.0f).to(DType::kBF16).to_f32();
    x_d = cuda::to_device(x.to(DType::kBF16));
    q_d = cuda::DeviceBuffer(static_cast<size_t>(T) * quant_hidden);
    scale_d = cuda::DeviceBuffer(static_cast<size_t>(T) * (quant_hidden / 128) * 4);
    a.quant.x = x_d.get();
    a.quant.hidden = quant_hidden;
    a.quant.q = q_d.as<uint8_t>();
    a.quant.scale = scale_d.as<float>();
  }
  ops::cuda::launch_route(params, a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  if (quant_hidden > 0) {
    const auto want = ops::quantize_fp8_per_token_ref(x);
    const auto q = download_vector<uint8_t>(q_d, static_cast<size_t>(T) * quant_hidden);
    const auto sc = download_vector<float>(scale_d, static_cast<size_t>(T) * (quant_hidden / 128));
    for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(q[i], want.q.data<uint8_t>()[i]) << "code " << i;
    for (size_t i = 0; i < sc.size(); ++i) ASSERT_EQ(sc[i], want.scale.data<float>()[i]) << "scale " << i;
  }
  auto ids = download_vector<int32_t>(ids_d, T * k);
  auto w = download_vector<float>(w_d, T * k);
  const int valid = valid_tokens < 0 ? T : valid_tokens;
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      if (t >= valid) {
        ASSERT_EQ(ids[t * k + j], -1) << "padding token " << t;
        continue;
      }
      ASSERT_EQ(ids[t * k + j], ref.ids.data<int32_t>()[t * k + j]) << "token " << t << " pick " << j;
      ASSERT_NEAR(w[t * k + j], ref.weights.data<float>()[t * k + j], 2e-6f * (1 + std::fabs(w[t * k + j])))
          << "token " << t << " pick " << j;
    }
}

TEST(Sm90_Route, SoftmaxTopKRenormalizeAndNot) {
  MOELORA_REQUIRE_SM90();
  ops::RouteParams p;
  p.kind = RouterKind::kSoftmaxTopK;
  p.num_experts = 256;
  p.top_k = 8;
  p.renormalize = true;
  check_route(p, 37, 101, false);
  p.renormalize = false;
  p.num_experts = 60;  // not a multiple of 32
  p.top_k = 4;
  check_route(p, 5, 102, false);
}

TEST(Sm90_Route, NoauxTcGroupsBiasScaling) {
  MOELORA_REQUIRE_SM90();
  ops::RouteParams p;
  p.kind = RouterKind::kSigmoidNoauxTc;
  p.num_experts = 256;
  p.top_k = 8;
  p.renormalize = true;
  p.n_group = 8;
  p.topk_group = 4;
  p.routed_scaling_factor = 2.5f;
  check_route(p, 33, 103, true);
  p.num_experts = 384;  // Kimi: one group
  p.n_group = 1;
  p.topk_group = 1;
  p.routed_scaling_factor = 2.827f;
  check_route(p, 17, 104, true);
}

TEST(Sm90_Route, PaddingTokensGetNoExperts) {
  MOELORA_REQUIRE_SM90();
  ops::RouteParams p;
  p.num_experts = 64;
  p.top_k = 6;
  p.renormalize = true;
  check_route(p, 16, 105, false, /*valid_tokens=*/11);
}

// The decode GEMV chain's x quant in extra CTAs of the router launch: codes and scales equal
// quant.h's per-token groups bitwise (padding rows included), the routing unchanged.
TEST(Sm90_Route, RowQuantBesideTheRouting) {
  MOELORA_REQUIRE_SM90();
  ops::RouteParams p;
  p.num_experts = 256;
  p.top_k = 8;
  p.renormalize = true;
  check_route(p, 1, 106, false, -1, 2048);
  check_route(p, 7, 107, false, /*valid_tokens=*/5, 640);
}

// The router GEMM in the route launch (RouteDeviceArgs::router): the logits it forms against
// linear.h's x Wg^T (bf16 inputs, fp32 sums in another order: within 1e-5 of sum |x w|), the
// routing against route_ref on those logits (ids exact, weights as check_route), the same bits on
// a second launch and on graph replays (the token-tile tickets back at zero after each), padding
// tokens without experts, and the optional row quant beside it.
struct RouterRouteCase {
  ops::RouteParams params;
  int tokens = 0, hidden = 0, valid = -1, quant_hidden = 0;
  bool bias = false, pdl = false;
};

void check_router_route(const RouterRouteCase& c, uint64_t seed) {
  std::mt19937_64 rng(test::test_seed(seed));
  const int T = c.tokens, H = c.hidden, E = static_cast<int>(c.params.num_experts), k = static_cast<int>(c.params.top_k);
  const int valid = c.valid < 0 ? T : c.valid;
  SCOPED_TRACE("E = " + std::to_string(E) + ", k = " + std::to_string(k) + ", H = " + std::to_string(H) +
               ", T = " + std::to_string(T) + " (" + std::to_string(valid) + " valid)");
  ASSERT_TRUE(ops::cuda::router_route_supports(c.params, H, T));
  const Tensor x = test::random_normal({T, H}, rng, 1.0f).to(DType::kBF16).to_f32();
  const Tensor w = test::random_normal({E, H}, rng, 0.05f).to(DType::kBF16).to_f32();
  Tensor bias;
  if (c.bias) bias = test::random_uniform({E}, rng, -0.02f, 0.02f);
  const Tensor want_logits = ops::linear_ref(x, w);

  auto x_d = cuda::to_device(x.to(DType::kBF16));
  auto w_d = cuda::to_device(w.to(DType::kBF16));
  cuda::DeviceBuffer bias_d;
  if (c.bias) bias_d = cuda::to_device(bias);
  cuda::DeviceBuffer ids_d(static_cast<size_t>(T) * k * 4), tw_d(static_cast<size_t>(T) * k * 4),
      logits_d(static_cast<size_t>(T) * E * 4),
      partials_d(ops::cuda::router_route_partial_floats(E, H, T) * sizeof(float));
  const int tickets = ops::cuda::router_route_tickets(T);
  cuda::DeviceBuffer tickets_d = upload_vector(std::vector<int32_t>(tickets, 0));
  cuda::DeviceBuffer num_d = upload_vector(std::vector<int32_t>{valid});
  ops::cuda::RouteDeviceArgs a;
  a.correction_bias = c.bias ? bias_d.as<float>() : nullptr;
  a.num_tokens = c.valid < 0 ? nullptr : num_d.as<int32_t>();
  a.topk_ids = ids_d.as<int32_t>();
  a.topk_weights = tw_d.as<float>();
  a.max_tokens = T;
  a.pdl = c.pdl;
  a.router.x = x_d.as<__nv_bfloat16>();
  a.router.weight = w_d.as<__nv_bfloat16>();
  a.router.hidden = H;
  a.router.logits = logits_d.as<float>();
  a.router.partials = partials_d.as<float>();
  a.router.tickets = tickets_d.as<int32_t>();
  cuda::DeviceBuffer q_d, scale_d;
  if (c.quant_hidden > 0) {
    ASSERT_EQ(c.quant_hidden, H);
    q_d = cuda::DeviceBuffer(static_cast<size_t>(T) * H);
    scale_d = cuda::DeviceBuffer(static_cast<size_t>(T) * (H / 128) * 4);
    a.quant = {x_d.get(), H, q_d.as<uint8_t>(), scale_d.as<float>()};
  }
  ops::cuda::launch_route(c.params, a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());

  const auto logits = download_vector<float>(logits_d, static_cast<size_t>(T) * E);
  for (int t = 0; t < valid; ++t)
    for (int e = 0; e < E; ++e) {
      double bound = 0;
      for (int h = 0; h < H; ++h)
        bound += std::fabs(x.data<float>()[static_cast<size_t>(t) * H + h] * w.data<float>()[static_cast<size_t>(e) * H + h]);
      ASSERT_NEAR(logits[static_cast<size_t>(t) * E + e], want_logits.data<float>()[static_cast<size_t>(t) * E + e],
                  1e-5 * bound + 1e-6)
          << "logit of token " << t << ", expert " << e;
    }
  Tensor gpu_logits = Tensor::empty(DType::kF32, {valid, E});
  std::copy(logits.begin(), logits.begin() + static_cast<size_t>(valid) * E, gpu_logits.data<float>());
  const auto ref = ops::route_ref(gpu_logits, bias, c.params);
  const auto ids = download_vector<int32_t>(ids_d, static_cast<size_t>(T) * k);
  const auto tw = download_vector<float>(tw_d, static_cast<size_t>(T) * k);
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const size_t i = static_cast<size_t>(t) * k + j;
      if (t >= valid) {
        ASSERT_EQ(ids[i], -1) << "padding token " << t;
        ASSERT_EQ(tw[i], 0.f) << "padding token " << t;
        continue;
      }
      ASSERT_EQ(ids[i], ref.ids.data<int32_t>()[i]) << "token " << t << " pick " << j;
      ASSERT_NEAR(tw[i], ref.weights.data<float>()[i], 2e-6f * (1 + std::fabs(tw[i]))) << "token " << t << " pick " << j;
    }
  if (c.quant_hidden > 0) {
    const auto want = ops::quantize_fp8_per_token_ref(x);
    const auto q = download_vector<uint8_t>(q_d, static_cast<size_t>(T) * H);
    const auto sc = download_vector<float>(scale_d, static_cast<size_t>(T) * (H / 128));
    for (size_t i = 0; i < q.size(); ++i) ASSERT_EQ(q[i], want.q.data<uint8_t>()[i]) << "code " << i;
    for (size_t i = 0; i < sc.size(); ++i) ASSERT_EQ(sc[i], want.scale.data<float>()[i]) << "scale " << i;
  }
  EXPECT_EQ(download_vector<int32_t>(tickets_d, tickets), std::vector<int32_t>(tickets, 0)) << "tickets after a launch";

  // Whichever CTA completes a tile, the sums run in chunk order: a second launch and graph
  // replays give the same bits.
  auto same_bits = [&](const char* what) {
    EXPECT_EQ(download_vector<float>(logits_d, static_cast<size_t>(T) * E), logits) << what;
    EXPECT_EQ(download_vector<int32_t>(ids_d, static_cast<size_t>(T) * k), ids) << what;
    EXPECT_EQ(download_vector<float>(tw_d, static_cast<size_t>(T) * k), tw) << what;
    EXPECT_EQ(download_vector<int32_t>(tickets_d, tickets), std::vector<int32_t>(tickets, 0)) << what;
  };
  MOELORA_CUDA_CHECK(cudaMemset(ids_d.get(), 0xff, ids_d.bytes()));
  ops::cuda::launch_route(c.params, a, nullptr);
  MOELORA_CUDA_CHECK(cudaDeviceSynchronize());
  same_bits("second launch");
  cuda::Stream stream;
  test::CapturedGraph graph(stream.get(), [&](cudaStream_t s) { ops::cuda::launch_route(c.params, a, s); });
  for (int replay = 0; replay < 2; ++replay) {
    MOELORA_CUDA_CHECK(cudaMemset(tw_d.get(), 0, tw_d.bytes()));
    graph.launch();
    same_bits("graph replay");
  }
}

TEST(Sm90_Route, RouterGemmInTheRouteLaunchSoftmax) {
  MOELORA_REQUIRE_SM90();
  RouterRouteCase c;
  c.params.num_experts = 128;  // Qwen3-30B-A3B: a decode batch with padding tokens
  c.params.top_k = 8;
  c.params.renormalize = true;
  c.tokens = 16;
  c.valid = 13;
  c.hidden = 2048;
  c.pdl = true;
  check_router_route(c, 120);
  c.params.num_experts = 256;  // Qwen3.5-35B-A3B, one token
  c.tokens = 1;
  c.valid = -1;
  check_router_route(c, 121);
  c.params.num_experts = 60;  // partial expert tile, partial column chunk, no renormalization
  c.params.top_k = 4;
  c.params.renormalize = false;
  c.tokens = 5;
  c.hidden = 520;
  c.pdl = false;
  check_router_route(c, 122);
  c.params.num_experts = 64;  // every token tile of the largest decode forward, up to the last row
  c.params.top_k = 6;
  c.tokens = ops::cuda::kRouterRouteMaxTokens;
  c.valid = ops::cuda::kRouterRouteMaxTokens - 1;
  c.hidden = 1024;
  check_router_route(c, 123);
}

TEST(Sm90_Route, RouterGemmInTheRouteLaunchNoauxTc) {
  MOELORA_REQUIRE_SM90();
  RouterRouteCase c;
  c.params.kind = RouterKind::kSigmoidNoauxTc;  // Kimi-K2.5: one group, bias, routed scaling
  c.params.num_experts = 384;
  c.params.top_k = 8;
  c.params.renormalize = true;
  c.params.routed_scaling_factor = 2.827f;
  c.bias = true;
  c.tokens = 50;
  c.valid = 41;
  c.hidden = 7168;
  c.pdl = true;
  check_router_route(c, 124);
  c.params.num_experts = 256;  // DeepSeek-V3 groups
  c.params.n_group = 8;
  c.params.topk_group = 4;
  c.params.routed_scaling_factor = 2.5f;
  c.tokens = 33;
  c.valid = -1;
  c.hidden = 1024;
  check_router_route(c, 125);
  c.params.num_experts = 1024;  // the largest E: the tile's logits take 64 KB of shared memory
  c.params.n_group = 16;
  c.params.topk_group = 4;
  c.tokens = 17;
  c.hidden = 256;
  check_router_route(c, 126);
}

TEST(Sm90_Route, RouterGemmWithRowQuantAndRefusals) {
  MOELORA_REQUIRE_SM90();
  RouterRouteCase c;
  c.params.num_experts = 256;
  c.params.top_k = 8;
  c.params.renormalize = true;
  c.tokens = 7;
  c.valid = 5;
  c.hidden = 640;
  c.quant_hidden = 640;
  check_router_route(c, 127);

  ops::RouteParams p = c.params;
  EXPECT_FALSE(ops::cuda::router_route_supports(p, 2048, ops::cuda::kRouterRouteMaxTokens + 1));
  EXPECT_FALSE(ops::cuda::router_route_supports(p, 2044, 16));
  EXPECT_TRUE(ops::cuda::router_route_supports(p, 2048, 16));
  cuda::DeviceBuffer buf(1 << 20);
  ops::cuda::RouteDeviceArgs a;
  a.topk_ids = buf.as<int32_t>();
  a.topk_weights = buf.as<float>();
  a.max_tokens = ops::cuda::kRouterRouteMaxTokens + 1;
  a.router = {buf.as<__nv_bfloat16>(), buf.as<__nv_bfloat16>(), 2048, nullptr, buf.as<float>(), buf.as<int32_t>()};
  // Each refusal names the field and its value.
  auto expect_refused = [&](ErrorCode code, const std::string& names) {
    try {
      ops::cuda::launch_route(p, a, nullptr);
      ADD_FAILURE() << "launch_route accepted a launch it should refuse (" << names << ")";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(names), std::string::npos) << e.what();
    }
  };
  expect_refused(ErrorCode::kUnsupported, "max_tokens = 65");
  a.max_tokens = 16;
  a.router.hidden = 2044;
  expect_refused(ErrorCode::kUnsupported, "hidden = 2044");
  a.router.hidden = 2048;
  a.router.partials = nullptr;
  expect_refused(ErrorCode::kInvalidArgument, "partials");
}

}  // namespace
}  // namespace moelora
