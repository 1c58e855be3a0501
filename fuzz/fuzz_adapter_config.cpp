// PEFT adapter_config.json (io/peft.h): the input is the file's text.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "fuzz_input.h"
#include "io/peft.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moelora;
  const auto path = fuzz::write_file("adapter_config.json", fuzz::as_text(data, size));
  try {
    (void)io::parse_adapter_config(path);
  } catch (const Error&) {
  }
  return 0;
}
