// safetensors files (io/safetensors.h): the input is a whole .safetensors file. Every tensor the
// reader accepts is read back in full and converted to f32, so a header that lies about shapes,
// dtypes or offsets must be refused before any byte outside the file is touched.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "fuzz_input.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moelora;
  const auto path = fuzz::write_file("model.safetensors", fuzz::as_text(data, size));
  try {
    const io::SafetensorsFile file = io::SafetensorsFile::open(path);
    for (const io::TensorInfo& info : file.tensors()) {
      const Tensor t = file.tensor(info.name);
      if (t.numel() <= (1 << 20)) (void)t.to_f32();
    }
    (void)file.metadata();
  } catch (const Error&) {
    // refused with a message: what bad input may do
  }
  return 0;
}
