// safetensors reading (mmap, zero-copy) and writing (streaming), single files and sharded
// checkpoints with model.safetensors.index.json.
//
// File layout: u64 little-endian header length N, N bytes of UTF-8 JSON
//   {"__metadata__": {str: str}, "<name>": {"dtype": "BF16", "shape": [..], "data_offsets": [b, e]}}
// then the data buffer; offsets are relative to byte 8 + N. Everything is validated before a
// single tensor is handed out: header length vs file size (and the 100 MB header cap), JSON
// syntax and types (duplicate keys included), dtype names, numel x dtype size == e - b
// (overflow-checked; the packed 4-bit "F4" rounds up to whole bytes), offsets in bounds, no two
// tensors overlapping, no unused bytes between tensors, the file ending exactly at the end of the
// data. Each violation throws moelora::Error (kInvalidFile) whose message starts with the file
// path and names the tensor or field, the expected and the actual value.
//
// Alignment: tensor views point straight into the mapping, so a tensor's address is only as
// aligned as its offset in the file. Files from the reference writer (and from SafetensorsWriter)
// are aligned for every element type (header padded to 8 bytes, tensors ordered by descending
// alignment), but the format does not require it. Read elements through load_as_f32 / memcpy
// (what the CPU code does), never by dereferencing a cast pointer of an arbitrary file.
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
  uint64_t nbytes() const { return end - begin; }
};

// Largest header a reader accepts (the reference implementation's MAX_HEADER_SIZE).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

// One mmap'ed .safetensors file (read-only, MAP_PRIVATE). Cheap to copy (shares the mapping);
// tensors returned by tensor() keep the mapping alive on their own.
class SafetensorsFile {
 public:
  // Throws kNotFound when the file does not exist, kInvalidFile when it is malformed.
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
  // `dir/<stem>.safetensors.index.json` when present, else `dir/<stem>.safetensors`; kNotFound
  // naming the directory and both file names when neither exists. stem is "model" for
  // checkpoints, "adapter_model" for adapters.
  //
  // Index rules: the file is JSON with a "weight_map" object of tensor name -> shard file name
  // (relative to dir; absolute names and ".." are rejected; duplicate keys are rejected). Every
  // shard must exist (kNotFound) and hold every tensor the weight_map assigns to it
  // (kInvalidFile). The weight_map is the single source of truth: a tensor that a shard holds
  // but the weight_map does not assign to that shard (including a second copy of a name
  // assigned to another shard) is not exposed. "metadata" is optional and not interpreted.
  static SafetensorsStore open_dir(const std::filesystem::path& dir, const std::string& stem = "model");
  static SafetensorsStore open_file(const std::filesystem::path& path);

  std::vector<std::string> names() const;  // sorted
  bool contains(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;                // throws kNotFound
  Tensor tensor(const std::string& name) const;                         // throws kNotFound
  const std::filesystem::path& file_of(const std::string& name) const;  // throws kNotFound
  // What to call this store in messages: the index file or the single file.
  const std::filesystem::path& source() const;
  uint64_t total_bytes() const;  // sum of tensor byte sizes
  size_t size() const { return where_.size(); }

 private:
  size_t file_index(const std::string& name) const;  // throws kNotFound

  std::vector<SafetensorsFile> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index in files_
  std::filesystem::path source_;
};

// Streaming writer: tensors are described up front and their bytes produced one at a time while
// the file is written, so a multi-GB checkpoint never has to sit in memory (at most the largest
// single tensor does, for Fill entries).
//
// Output is byte-identical to the reference Python writer (safetensors.torch.save_file) given the
// same tensors and a single metadata entry: compact JSON header with "__metadata__" first, then
// the tensors in data order, each {"dtype", "shape", "data_offsets"}; header padded with spaces
// to a multiple of 8. (With several metadata entries the reference order is a hash-map order;
// this writer sorts them by key.) "F4" tensors count e2m1 elements in their shape, so numel
// must be even: the reference reader rejects half-filled bytes.
class SafetensorsWriter {
 public:
  using Fill = std::function<void(void* dst)>;  // writes exactly dtype_bytes(dtype, numel) bytes

  // Names must be unique, non-empty and not "__metadata__" (kInvalidArgument otherwise). The
  // tensor's storage is shared, not copied: it is read when the file is written.
  void add(const std::string& name, const Tensor& tensor);
  void add(const std::string& name, DType dtype, Shape shape, Fill fill);
  // Metadata starts as {"format": "pt"} (what transformers writes); set_metadata adds or
  // overrides entries, clear_metadata removes all of them (no "__metadata__" key is written).
  void set_metadata(const std::string& key, const std::string& value);
  void clear_metadata() { metadata_.clear(); }
  size_t size() const { return entries_.size(); }
  uint64_t data_bytes() const;

  // Writes the file (header padded with spaces to a multiple of 8, tensors ordered like the
  // reference writer: by descending dtype rank -- 8-byte types first, packed 4-bit and BOOL
  // last -- then by name). The bytes go to a temporary file in the same directory that is
  // fsync'ed and renamed over `path`, so readers never see a half-written file. `on_tensor(bytes)`
  // is called after each tensor, for progress bars.
  void write(const std::filesystem::path& path, const std::function<void(uint64_t)>& on_tensor = {}) const;

  // Writes the tensors as `<stem>-0000k-of-0000n.safetensors` shards of at most max_shard_bytes
  // of tensor data (a tensor larger than that gets a shard of its own) plus
  // `<stem>.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {...}}, keys
  // sorted). Tensors are assigned to shards greedily in the order they were added, like
  // huggingface_hub's split_torch_state_dict_into_shards. With a single shard, writes
  // `<stem>.safetensors` and no index. Creates `dir` if needed. Stale files of an earlier write
  // with the same stem (the single file, the index, shards not in the new set) are removed
  // afterwards, so open_dir never mixes old and new files.
  void write_sharded(const std::filesystem::path& dir, uint64_t max_shard_bytes,
                     const std::string& stem = "model",
                     const std::function<void(uint64_t)>& on_tensor = {}) const;

 private:
  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    Fill fill;      // produces the bytes, unless `source` is defined
    Tensor source;  // add(name, tensor): written straight from its storage
    uint64_t nbytes() const;
  };
  void add_entry(Entry entry);

  std::vector<Entry> entries_;
  std::map<std::string, size_t> index_;  // name -> position in entries_ (duplicate check)
  std::map<std::string, std::string> metadata_ = {{"format", "pt"}};
};

}  // namespace moelora::io
