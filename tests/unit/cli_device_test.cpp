// `moelora generate --device` and `moelora logits --device` on the CPU (tools/device_run.h):
//   - --device cpu is the default and changes nothing: the same stdout and safetensors bytes as
//     no --device at all, and the library's greedy tokens / logits;
//   - --json names the device;
//   - --device cuda where this build or machine cannot run it (no CUDA in the build, or no device
//     visible) fails at once with one line that names the device, says why (check_device's
//     message) and names the fix (--device cpu), and writes nothing;
//   - an unknown device is one line naming it and the choices;
//   - --help explains --device.
// The GPU side (cuda against cpu on a device) is tests/gpu/cli_device_gpu_test.cu.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "model/model.h"
#include "moelora/engine.h"
#include "support/test_support.h"

namespace moelora {
namespace {

namespace fs = std::filesystem;

fs::path fixture() {
  return test::data_dir() / "parity" / "qwen3_moe";
}

// Shell-quoted path (appended piecewise: GCC 12's -Wrestrict misfires on "'" + string + "'").
std::string quote(const fs::path& p) {
  std::string q = "'";
  q += p.string();
  q += '\'';
  return q;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(line);
  return out;
}

// stdout of `moelora args` alone (stderr, with the timing line, dropped).
std::string stdout_of(const std::string& args) {
  const test::CommandResult r =
      test::run_command("{ MOELORA_NO_PROGRESS=1 " + quote(test::binary_dir() / "moelora") + " " +
                        args + " 2>/dev/null; }");
  EXPECT_EQ(r.exit_code, 0) << args << "\n" << r.output;
  return r.output;
}

// The fixture's prompt and its greedy continuation through adapter lora_peft3d.
struct Greedy {
  std::string prompt;  // "1,2,3"
  std::vector<int32_t> tokens;
};
Greedy fixture_greedy() {
  const io::SafetensorsFile ref = io::SafetensorsFile::open(fixture() / "reference.safetensors");
  const Tensor prompt = ref.tensor("input_ids").clone();
  const Tensor greedy = ref.tensor("greedy.lora_peft3d").clone();
  Greedy g;
  for (int64_t i = 0; i < prompt.dim(1); ++i) {
    if (i > 0) g.prompt += ',';
    g.prompt += std::to_string(prompt.data<int32_t>()[i]);
  }
  g.tokens.assign(greedy.data<int32_t>() + prompt.dim(1), greedy.data<int32_t>() + greedy.dim(1));
  return g;
}

std::string generate_args(const Greedy& g) {
  return "generate --model " + quote(fixture() / "base") +
         " --adapter p=" + quote(fixture() / "lora_peft3d") + " --use p --tokens " + g.prompt +
         " --max-new-tokens 16 --ignore-eos";
}

TEST(CliDevice, GenerateCpuIsTheDefaultAndUnchanged) {
  const Greedy g = fixture_greedy();
  nlohmann::json plain = nlohmann::json::parse(stdout_of(generate_args(g) + " --json"));
  nlohmann::json cpu = nlohmann::json::parse(stdout_of(generate_args(g) + " --json --device cpu"));
  EXPECT_EQ(plain["device"], "cpu");
  EXPECT_EQ(cpu["device"], "cpu");
  EXPECT_EQ(cpu["tokens"].get<std::vector<int32_t>>(), g.tokens);
  EXPECT_GT(cpu["tokens_per_s"].get<double>(), 0.0);
  // Everything but the timing is the same with and without --device cpu.
  plain.erase("tokens_per_s");
  cpu.erase("tokens_per_s");
  EXPECT_EQ(plain, cpu);
  EXPECT_EQ(cpu.size(), 6u) << cpu.dump();  // tokens, text, prompt_tokens, adapter, stopped, device

  // Text output (the fixture has a tokenizer): the same continuation on stdout.
  const std::string text = stdout_of(generate_args(g));
  EXPECT_FALSE(text.empty());
  EXPECT_EQ(stdout_of(generate_args(g) + " --device cpu"), text);
  EXPECT_EQ(text, cpu["text"].get<std::string>() + "\n");
}

TEST(CliDevice, LogitsCpuIsTheDefaultAndUnchanged) {
  test::TempDir tmp;
  const std::string base = "logits --model " + quote(fixture() / "base") +
                           " --adapter pe=" + quote(fixture() / "lora_per_expert") +
                           " --use pe --tokens 3,14,15,92,65 --out ";
  stdout_of(base + quote(tmp / "plain.safetensors"));
  const std::string printed = stdout_of(base + quote(tmp / "cpu.safetensors") + " --device cpu");
  EXPECT_NE(printed.find("logits: [5, "), std::string::npos) << printed;
  EXPECT_EQ(test::read_text_file(tmp / "plain.safetensors"),
            test::read_text_file(tmp / "cpu.safetensors"));

  const io::SafetensorsFile file = io::SafetensorsFile::open(tmp / "cpu.safetensors");
  EXPECT_EQ(file.metadata().count("device"), 0u);  // the CPU file is what it always was
  model::ModelOptions options;
  options.show_progress = false;
  model::Model model = model::Model::load(fixture() / "base", options);
  model::Sequence seq = model.new_sequence(model.load_adapter("pe", fixture() / "lora_per_expert"));
  const Tensor expected = model.forward(seq, std::vector<int32_t>{3, 14, 15, 92, 65});
  const Tensor written = file.tensor("logits").clone();
  ASSERT_EQ(written.shape(), expected.shape());
  EXPECT_EQ(test::max_abs_diff(written, expected), 0.0);
}

// One line naming the device, the reason and the fix; nothing written.
void expect_device_error(const std::string& args, const std::string& subcommand,
                         const std::string& reason, const fs::path& out = {}) {
  const test::CommandResult r = test::run_moelora(args);
  EXPECT_NE(r.exit_code, 0) << args;
  const std::vector<std::string> lines = lines_of(r.output);
  ASSERT_EQ(lines.size(), 1u) << args << "\n" << r.output;
  EXPECT_EQ(lines[0].rfind("moelora " + subcommand + ": error: ", 0), 0u) << lines[0];
  EXPECT_NE(lines[0].find("'cuda'"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find(reason), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("--device cpu"), std::string::npos) << lines[0];
  if (!out.empty()) {
    EXPECT_FALSE(fs::exists(out)) << out;
  }
}

TEST(CliDevice, CudaWithoutDeviceFailsWithOneLine) {
  const Status cuda = check_device("cuda");
  if (cuda.is_ok()) GTEST_SKIP() << "this host can run device cuda (tests/gpu covers it)";
  EXPECT_EQ(cuda.code(), ErrorCode::kUnsupported);
  test::TempDir tmp;
  const std::string model = " --model " + quote(fixture() / "base");
  expect_device_error("generate" + model + " --tokens 1,2,3 --max-new-tokens 4 --device cuda",
                      "generate", cuda.message());
  expect_device_error(
      "generate" + model + " --tokens 1,2,3 --max-new-tokens 4 --json --device cuda", "generate",
      cuda.message());
  expect_device_error(
      "logits" + model + " --tokens 1,2,3 --device cuda --out " + quote(tmp / "l.safetensors"),
      "logits", cuda.message(), tmp / "l.safetensors");
  test::write_text_file(tmp / "batch.json", R"([{"tokens": [1, 2]}, {"tokens": [3]}])");
  expect_device_error("logits" + model + " --batch " + quote(tmp / "batch.json") +
                          " --device cuda --out " + quote(tmp / "b.safetensors"),
                      "logits", cuda.message(), tmp / "b.safetensors");
}

TEST(CliDevice, UnknownDeviceIsOneLine) {
  test::TempDir tmp;
  const std::string model = " --model " + quote(fixture() / "base");
  for (const std::string& args :
       {"generate" + model + " --tokens 1,2 --device tpu",
        "logits" + model + " --tokens 1,2 --device tpu --out " + quote(tmp / "l.safetensors")}) {
    const test::CommandResult r = test::run_moelora(args);
    EXPECT_NE(r.exit_code, 0) << args;
    const std::vector<std::string> lines = lines_of(r.output);
    ASSERT_EQ(lines.size(), 1u) << r.output;
    EXPECT_NE(lines[0].find("--device 'tpu' is unknown; expected cpu or cuda"), std::string::npos)
        << lines[0];
  }
}

TEST(CliDevice, HelpExplainsDevice) {
  for (const std::string subcommand : {"generate", "logits"}) {
    const test::CommandResult r = test::run_moelora(subcommand + " --help");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("--device"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("cpu (the fp32 reference model) or cuda"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("=cpu"), std::string::npos) << r.output;  // the default
  }
}

}  // namespace
}  // namespace moelora
