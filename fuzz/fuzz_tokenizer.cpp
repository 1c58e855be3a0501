// tokenizer.json + tokenizer_config.json (io/tokenizer.h): the input is both texts, separated by
// the first NUL byte (none: no tokenizer_config.json). An accepted tokenizer encodes a fixed mix
// of scripts, digits, spaces and special-token lookalikes and decodes the ids back.
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "fuzz_input.h"
#include "io/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moelora;
  const std::string_view input = fuzz::as_text(data, size);
  const size_t split = input.find('\0');
  const std::string_view tokenizer_json = input.substr(0, split);
  const std::string_view config_json =
      split == std::string_view::npos ? std::string_view() : input.substr(split + 1);
  try {
    const io::Tokenizer tokenizer = io::Tokenizer::from_json(tokenizer_json, config_json);
    const std::vector<int32_t> ids =
        tokenizer.encode("Hello, world! 12345 \xc3\xa9t\xc3\xa9 \xe4\xbd\xa0\xe5\xa5\xbd  <|im_end|>\n\tx");
    (void)tokenizer.decode(ids);
    (void)tokenizer.decode(ids, /*skip_special_tokens=*/true);
  } catch (const Error&) {
  }
  return 0;
}
