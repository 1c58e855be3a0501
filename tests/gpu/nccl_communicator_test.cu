// The NCCL communicator (nccl/nccl_communicator.h) on one GPU: a group of one rank runs every
// collective on device buffers (F32 and BF16) eagerly and captured in a CUDA graph; a group that
// a rank never joins fails after its timeout instead of hanging; bad ids, ranks, dtypes and roots
// are errors that name them; an aborted communicator refuses further work. (NCCL cannot put two
// ranks on one GPU, so the multi-rank collectives run on hosts with several GPUs.)
#include <gtest/gtest.h>

#include "gpu_test_util.cuh"

#if defined(MOELORA_WITH_NCCL)

#include <cuda_bf16.h>

#include <chrono>
#include <functional>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "core/cuda_utils.h"
#include "core/error.h"
#include "nccl/nccl_communicator.h"
#include "support/test_support.h"

namespace moelora::dist {
namespace {

using namespace std::chrono_literals;

#define MOELORA_REQUIRE_GPU()                                                     \
  do {                                                                            \
    if (::moelora::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";   \
  } while (0)

class NcclOneRank : public ::testing::Test {
 protected:
  void SetUp() override {
    MOELORA_REQUIRE_GPU();
    comm_ = NcclCommunicator::create(nccl_new_unique_id(), 0, 1, 0, 30s);
    MOELORA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  std::unique_ptr<NcclCommunicator> comm_;
  cudaStream_t stream_ = nullptr;
};

std::vector<float> iota_floats(size_t n, float start) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = start + static_cast<float>(i);
  return v;
}

TEST(NcclCommunicator, UniqueIdsAreHexTextAndDistinct) {
  MOELORA_REQUIRE_GPU();
  const std::string a = nccl_new_unique_id(), b = nccl_new_unique_id();
  EXPECT_EQ(a.size(), 256u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos) << a;
  EXPECT_NE(a, b);
  // Multicast stays off for every communicator of the process.
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  ASSERT_NE(nvls, nullptr);
  EXPECT_STREQ(nvls, "0");
}

// With one rank every collective is a copy of its own data: the values prove the buffers, counts
// and dtypes reach NCCL as meant.
TEST_F(NcclOneRank, CollectivesOnDeviceBuffers) {
  EXPECT_EQ(comm_->rank(), 0);
  EXPECT_EQ(comm_->size(), 1);
  const size_t n = 1000;
  const std::vector<float> values = iota_floats(n, -3.5f);
  cuda::DeviceBuffer inout = test::upload_vector(values);
  comm_->all_reduce_sum(inout.get(), n, DType::kF32, stream_);
  cuda::DeviceBuffer gathered(n * sizeof(float)), scattered(n * sizeof(float));
  comm_->all_gather(inout.get(), gathered.get(), n, DType::kF32, stream_);
  comm_->reduce_scatter_sum(gathered.get(), scattered.get(), n, DType::kF32, stream_);
  comm_->broadcast(scattered.get(), n, DType::kF32, 0, stream_);
  std::vector<__nv_bfloat16> halves(n);
  for (size_t i = 0; i < n; ++i) halves[i] = __float2bfloat16(values[i]);
  cuda::DeviceBuffer bf16 = test::upload_vector(halves);
  comm_->all_reduce_sum(bf16.get(), n, DType::kBF16, stream_);
  comm_->synchronize(stream_);
  EXPECT_EQ(test::download_vector<float>(inout, n), values);
  EXPECT_EQ(test::download_vector<float>(gathered, n), values);
  EXPECT_EQ(test::download_vector<float>(scattered, n), values);
  const std::vector<__nv_bfloat16> back = test::download_vector<__nv_bfloat16>(bf16, n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(__bfloat162float(back[i]), __bfloat162float(halves[i]));
}

// A decode step is one graph replay: the collectives must capture. The graph gathers `source`
// into `target`; between replays the source changes and the target follows.
TEST_F(NcclOneRank, CollectivesCaptureIntoAGraph) {
  const size_t n = 4096;
  cuda::DeviceBuffer source(n * sizeof(float)), target(n * sizeof(float));
  test::CapturedGraph graph(stream_, [&](cudaStream_t s) {
    comm_->all_gather(source.get(), target.get(), n, DType::kF32, s);
    comm_->all_reduce_sum(target.get(), n, DType::kF32, s);
  });
  for (int replay = 0; replay < 3; ++replay) {
    const std::vector<float> values = iota_floats(n, 10.0f * replay);
    source.upload(values.data(), n * sizeof(float));
    graph.launch();
    comm_->synchronize(stream_);
    EXPECT_EQ(test::download_vector<float>(target, n), values) << "replay " << replay;
  }
}

// Rank 0 of a group of two whose rank 1 never starts: an error after the timeout, no hang.
TEST(NcclCommunicator, ARankThatNeverJoinsIsAnErrorNotAHang) {
  MOELORA_REQUIRE_GPU();
  const auto start = std::chrono::steady_clock::now();
  const std::string message = test::error_message(
      [] { NcclCommunicator::create(nccl_new_unique_id(), 0, 2, 0, 3s); }, ErrorCode::kInternal);
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_TRUE(test::contains(message, "rank 0 of 2")) << message;
  EXPECT_TRUE(test::contains(message, "joining the group")) << message;
  EXPECT_TRUE(test::contains(message, "did not finish within 3000 ms")) << message;
  EXPECT_GE(waited, 3s);
  EXPECT_LT(waited, 30s) << "the abort itself must not wait for the missing rank";
}

TEST_F(NcclOneRank, BadArgumentsAndAbortAreNamed) {
  auto expect_error = [](const std::function<void()>& fn, const std::string& part) {
    const std::string message = test::error_message(fn);
    EXPECT_TRUE(test::contains(message, part)) << "'" << part << "' not in: " << message;
  };
  expect_error([] { NcclCommunicator::create("00ff", 0, 1, 0); }, "expected 256 hex digits");
  expect_error([] { NcclCommunicator::create(std::string(256, 'g'), 0, 1, 0); },
               "is not a hex digit");
  expect_error([] { NcclCommunicator::create(nccl_new_unique_id(), 2, 2, 0); },
               "rank 2 of 2 ranks is not a rank");
  cuda::DeviceBuffer buf(64 * sizeof(float));
  expect_error([&] { comm_->all_reduce_sum(buf.get(), 64, DType::kF16, stream_); },
               "dtype F16 is not F32 or BF16");
  expect_error([&] { comm_->broadcast(buf.get(), 64, DType::kF32, 1, stream_); },
               "root 1 is not a rank of 1");
  comm_->abort("the test stops here");
  EXPECT_TRUE(comm_->aborted());
  expect_error([&] { comm_->all_reduce_sum(buf.get(), 64, DType::kF32, stream_); },
               "was aborted (the test stops here)");
}

}  // namespace
}  // namespace moelora::dist

#else  // no NCCL in this build

TEST(NcclCommunicator, NeedsNccl) {
  GTEST_SKIP() << "this build has no NCCL (CMake found none next to the CUDA toolkit)";
}

#endif
