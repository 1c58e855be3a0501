// The batch file of `moelora logits --batch` (a mixed-adapter batch for parity checks):
//   [{"tokens": [1, 2, 3], "adapter": "a"}, {"tokens": [4, 5], "adapter": null}]
// A non-empty list of objects with exactly the keys "tokens" (a non-empty list of int32 ids) and
// "adapter" (a name, null or absent = the base model). Anything else is kInvalidArgument naming
// the file, the entry and the field (fuzz/fuzz_logits_batch checks that nothing else escapes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moelora::tools {

struct BatchEntry {
  std::vector<int32_t> tokens;
  std::string adapter;  // "" = base
};

// kNotFound when the file cannot be opened.
std::vector<BatchEntry> read_batch(const std::string& path);

}  // namespace moelora::tools
