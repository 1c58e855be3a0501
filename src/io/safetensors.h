// safetensors reading (mmap, zero-copy) and writing (streaming), single files and sharded
// checkpoints with model.safetensors.index.json.
//
// File layout: u64 little-endian header length N, N bytes of UTF-8 JSON
//   {"__metadata__": {str: str}, "<name>": {"dtype": "BF16", "shape": [..], "data_offsets": [b, e]}}
// then the data buffer; offsets are relative to byte 8 + N. Everything is validated before a
// single tensor is handed out: header length vs file size (and the 100 MB header cap), JSON
// syntax and types, dtype names, numel x dtype size == e - b (overflow-checked), offsets in
// bounds, no two tensors overlapping, the file ending exactly at the end of the data. Each
// violation throws moelora::Error (kInvalidFile) whose message names the file, the tensor or
// field, the expected and the actual value.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace moelora::io {

struct TensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin = 0;  // byte offsets relative to the data buffer
  uint64_t end = 0;
};

// One mmap'ed .safetensors file. Cheap to copy (shares the mapping); tensors returned by
// tensor() keep the mapping alive.
class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::filesystem::path& path);

  const std::filesystem::path& path() const;
  // Tensor descriptions, sorted by name.
  const std::vector<TensorInfo>& tensors() const;
  const TensorInfo* find(const std::string& name) const;  // nullptr when absent
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  // Zero-copy view of the tensor's bytes. Throws kNotFound naming the file and the tensor.
  Tensor tensor(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// A set of tensors spread over one file or several shards.
class SafetensorsStore {
 public:
  // `dir/<stem>.safetensors`, or the shards listed in `dir/<stem>.safetensors.index.json`
  // (every shard must exist, every name in the weight_map must be present in its shard, and no
  // name may be in two shards). stem is "model" for checkpoints, "adapter_model" for adapters.
  static SafetensorsStore open_dir(const std::filesystem::path& dir, const std::string& stem = "model");
  static SafetensorsStore open_file(const std::filesystem::path& path);

  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;         // throws kNotFound
  Tensor tensor(const std::string& name) const;                  // throws kNotFound
  const std::filesystem::path& file_of(const std::string& name) const;  // throws kNotFound
  // What to call this store in messages: the index file or the single file.
  const std::filesystem::path& source() const;
  uint64_t total_bytes() const;  // sum of tensor byte sizes

 private:
  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index in files_
  std::filesystem::path source_;
};

// Streaming writer: tensors are described up front and their bytes produced one at a time while
// the file is written, so a multi-GB checkpoint never has to sit in memory.
class SafetensorsWriter {
 public:
  using Fill = std::function<void(void* dst)>;  // writes exactly dtype_bytes(dtype, numel) bytes

  void add(const std::string& name, const Tensor& tensor);
  void add(const std::string& name, DType dtype, Shape shape, Fill fill);
  void set_metadata(const std::string& key, const std::string& value);
  size_t size() const { return entries_.size(); }
  uint64_t data_bytes() const;

  // Writes the file (header padded with spaces to a multiple of 8, tensors ordered like the
  // reference writer: by descending alignment, then name). `on_tensor(bytes)` is called after
  // each tensor, for progress bars.
  void write(const std::filesystem::path& path, const std::function<void(uint64_t)>& on_tensor = {}) const;

  // Writes the tensors as `<stem>-0000k-of-0000n.safetensors` shards of at most max_shard_bytes
  // (a tensor larger than that gets a shard of its own) plus `<stem>.safetensors.index.json`.
  // With a single shard, writes `<stem>.safetensors` and no index.
  void write_sharded(const std::filesystem::path& dir, uint64_t max_shard_bytes, const std::string& stem = "model",
                     const std::function<void(uint64_t)>& on_tensor = {}) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    Fill fill;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace moelora::io
