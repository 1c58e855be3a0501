// moelora: command-line entry point. Subcommands live in tools/<name>.cpp and register
// themselves (tools/cli.h). Errors from the library arrive as moelora::Error and are printed as
// one line; the exit code is non-zero.
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <map>

#include "cli.h"
#include "core/error.h"

namespace moelora::cli {

std::vector<Subcommand>& registry() {
  static std::vector<Subcommand> r;
  return r;
}

std::vector<std::string>& command_line() {
  static std::vector<std::string> args;
  return args;
}

void run_subcommand(const std::string& name, std::vector<std::string> args) {
  for (const Subcommand& sub : registry()) {
    if (sub.name != name) continue;
    CLI::App app{sub.description, "moelora " + name};
    std::function<int()> run = sub.setup(app);
    std::reverse(args.begin(), args.end());  // CLI11 takes the argument vector back to front
    try {
      app.parse(args);
    } catch (const CLI::ParseError& e) {
      MOELORA_THROW(ErrorCode::kInternal, "moelora ", name, ": ", e.what());
    }
    const int code = run();
    MOELORA_CHECK(code == 0, ErrorCode::kInternal, "moelora ", name, " exited with ", code);
    return;
  }
  MOELORA_THROW(ErrorCode::kInternal, "the subcommand '", name, "' is not built into this binary");
}

ScratchDir::ScratchDir(const std::string& tag) {
  std::string pattern =
      (std::filesystem::temp_directory_path() / ("moelora-" + tag + "-XXXXXX")).string();
  MOELORA_CHECK(mkdtemp(pattern.data()) != nullptr, ErrorCode::kInvalidArgument,
                "cannot create a temporary directory ", pattern);
  path_ = pattern;
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::vector<int32_t> parse_int_list(const std::string& text, const std::string& what) {
  std::vector<int32_t> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(pos, end - pos);
    MOELORA_CHECK(!item.empty(), ErrorCode::kInvalidArgument, what, ": empty entry in '", text,
                  "'");
    char* stop = nullptr;
    long long v = std::strtoll(item.c_str(), &stop, 10);
    MOELORA_CHECK(stop && *stop == '\0' && v >= INT32_MIN && v <= INT32_MAX,
                  ErrorCode::kInvalidArgument, what, ": '", item, "' is not an integer");
    out.push_back(static_cast<int32_t>(v));
    pos = end + 1;
  }
  return out;
}

}  // namespace moelora::cli

int main(int argc, char** argv) {
  using namespace moelora;
  CLI::App app{
      "moelora: Mixture-of-Experts LLM inference with many LoRA adapters.\n"
      "Loads Hugging Face checkpoints (bf16, FP8 block-scaled, NVFP4) and PEFT adapters; runs\n"
      "Qwen3-MoE and DeepSeek-V3 / Kimi models on the CPU reference backend (and on Hopper GPUs).\n"
      "Run `moelora <command> --help` for the options of one command."};
  cli::command_line().assign(argv, argv + argc);
  app.require_subcommand(1);
  app.fallthrough(false);

  auto& subs = cli::registry();
  std::sort(subs.begin(), subs.end(),
            [](const auto& a, const auto& b) { return a.order < b.order; });
  std::map<CLI::App*, std::function<int()>> runners;
  std::map<CLI::App*, std::string> names;
  try {
    for (auto& s : subs) {
      CLI::App* sub = app.add_subcommand(s.name, s.description);
      runners[sub] = s.setup(*sub);
      names[sub] = s.name;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moelora: internal error while building the command line: %s\n", e.what());
    return 2;
  }

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  for (auto& [sub, run] : runners) {
    if (!sub->parsed()) continue;
    try {
      return run();
    } catch (const Error& e) {
      std::fprintf(stderr, "moelora %s: error: %s\n", names[sub].c_str(), e.what());
      return 1;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "moelora %s: error: %s\n", names[sub].c_str(), e.what());
      return 1;
    }
  }
  return 0;
}
