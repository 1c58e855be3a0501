// `moelora run`: the main job on its built-in default (see README.md).
#include <cstdio>

#include "cli.h"

namespace {
std::function<int()> setup_run(CLI::App& app) {
  return [] {
    std::printf("moelora run: placeholder\n");
    return 0;
  };
}
MOELORA_SUBCOMMAND("run", "Run the built-in demo (the README's main job)", 0, setup_run);
}  // namespace
