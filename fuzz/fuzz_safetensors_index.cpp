// Sharded checkpoints (io/safetensors.h, SafetensorsStore): the input is the text of
// model.safetensors.index.json; the directory holds two valid shards (tests/data/safetensors'
// golden files as a.safetensors and b.safetensors). Shard names that escape the directory, point
// at missing files or claim tensors a shard lacks must be refused; every tensor of an accepted
// store is read back.
#include <cstddef>
#include <cstdint>
#include <filesystem>

#include "core/error.h"
#include "fuzz_input.h"
#include "io/safetensors.h"

#ifndef MOELORA_FUZZ_DATA_DIR
#error "MOELORA_FUZZ_DATA_DIR (tests/data) is set by fuzz/CMakeLists.txt"
#endif

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moelora;
  static const bool shards_ready = [] {
    const std::filesystem::path golden = std::filesystem::path(MOELORA_FUZZ_DATA_DIR) / "safetensors";
    const auto options = std::filesystem::copy_options::overwrite_existing;
    std::filesystem::copy_file(golden / "golden.safetensors", fuzz::scratch_dir() / "a.safetensors", options);
    std::filesystem::copy_file(golden / "golden_nometa.safetensors", fuzz::scratch_dir() / "b.safetensors",
                               options);
    return true;
  }();
  (void)shards_ready;
  fuzz::write_file("model.safetensors.index.json", fuzz::as_text(data, size));
  try {
    const io::SafetensorsStore store = io::SafetensorsStore::open_dir(fuzz::scratch_dir());
    for (const std::string& name : store.names()) {
      const Tensor t = store.tensor(name);
      if (t.numel() <= (1 << 20)) (void)t.to_f32();
      (void)store.file_of(name);
    }
    (void)store.total_bytes();
  } catch (const Error&) {
  }
  return 0;
}
