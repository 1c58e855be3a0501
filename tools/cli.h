// Subcommand registry of the moelora tool. Each tools/<name>.cpp registers itself with
// MOELORA_SUBCOMMAND; main.cpp builds the CLI11 app from the registry, so adding a subcommand
// touches one file.
#pragma once

#include <CLI/CLI.hpp>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace moelora::cli {

// Adds the subcommand's options to `app` and returns the function that runs it (exit code).
using SetupFn = std::function<std::function<int()>(CLI::App& app)>;

struct Subcommand {
  std::string name;
  std::string description;
  int order;  // position in --help
  SetupFn setup;
};

std::vector<Subcommand>& registry();

// The arguments this process was started with (argv[0] first), for a command that starts copies
// of itself (`moelora serve --tp N` starts one process per rank).
std::vector<std::string>& command_line();

struct Registrar {
  Registrar(std::string name, std::string description, int order, SetupFn setup) {
    registry().push_back({std::move(name), std::move(description), order, std::move(setup)});
  }
};

// Parses "1,2,3" into token ids; throws moelora::Error naming `what` on a bad entry.
std::vector<int32_t> parse_int_list(const std::string& text, const std::string& what);

// Runs another subcommand of this binary (e.g. "synth") with `args`, as if typed after its name,
// so a tool that composes others writes and measures exactly what a user of them would get.
// Throws moelora::Error (kInternal) on a parse error or a non-zero exit.
void run_subcommand(const std::string& name, std::vector<std::string> args);

// A fresh directory <temp>/moelora-<tag>-XXXXXX, removed with its content when this dies.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace moelora::cli

#define MOELORA_CLI_CONCAT_(a, b) a##b
#define MOELORA_CLI_CONCAT(a, b) MOELORA_CLI_CONCAT_(a, b)
#define MOELORA_SUBCOMMAND(name, description, order, setup)                           \
  static ::moelora::cli::Registrar MOELORA_CLI_CONCAT(moelora_subcommand_, __LINE__)( \
      name, description, order, setup)
