// The test helpers' directories: test executables copied to another machine (a GPU host) find the
// fixtures and the moelora binary through the environment instead of the build machine's paths.
#include <gtest/gtest.h>

#include <cstdlib>

#include "support/test_support.h"

namespace moelora {
namespace {

TEST(TestSupport, DirectoriesFollowTheEnvironment) {
  const auto built_data = test::data_dir(), built_binary = test::binary_dir();
  ASSERT_TRUE(std::filesystem::exists(built_data / "tokenizer")) << built_data;
  setenv("MOELORA_TEST_DATA_DIR", "/elsewhere/data", 1);
  setenv("MOELORA_BINARY_DIR", "/elsewhere/bin", 1);
  EXPECT_EQ(test::data_dir(), std::filesystem::path("/elsewhere/data"));
  EXPECT_EQ(test::binary_dir(), std::filesystem::path("/elsewhere/bin"));
  EXPECT_EQ(test::fixture("tiny"), std::filesystem::path("/elsewhere/data/parity/tiny"));
  // empty counts as unset
  setenv("MOELORA_TEST_DATA_DIR", "", 1);
  unsetenv("MOELORA_BINARY_DIR");
  EXPECT_EQ(test::data_dir(), built_data);
  EXPECT_EQ(test::binary_dir(), built_binary);
  unsetenv("MOELORA_TEST_DATA_DIR");
}

}  // namespace
}  // namespace moelora
