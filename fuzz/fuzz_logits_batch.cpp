// The batch file of `moelora logits --batch` (tools/logits_batch.h): the input is the file's text.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "fuzz_input.h"
#include "logits_batch.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moelora;
  const auto path = fuzz::write_file("batch.json", fuzz::as_text(data, size));
  try {
    (void)tools::read_batch(path.string());
  } catch (const Error&) {
  }
  return 0;
}
