// safetensors reader, sharded store and streaming writer (FORMATS.md §5.1).
//
// Reading maps the whole file once (read-only, MAP_PRIVATE) and checks every header entry
// before any tensor is handed out, so later code can trust shapes, dtypes and offsets without
// re-checking: a corrupt or truncated download fails at open() with a message naming the file,
// the tensor and the numbers that disagree, never with a crash deep inside a GEMM.
//
// Writing reproduces the reference writer's bytes (safetensors' Rust `serialize`): it is what
// lets checkpoints and adapters written by moelora be read by any other tool, and what the
// byte-for-byte test against the Python package checks.
#include "io/safetensors.h"
#include "io/input_limits.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <numeric>
#include <set>
#include <unordered_set>
#include <sstream>
#include <string_view>

#include <nlohmann/json.hpp>

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// ---- small helpers ----

// A JSON value as it appears in the file, shortened for messages.
std::string describe(const json& value) {
  std::string text = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

std::string errno_text(int err) {
  return std::strerror(err);
}

// Parses JSON text; syntax errors become kInvalidFile naming `file` (nlohmann's message carries
// line and column). Duplicate object keys are an error too: nlohmann would silently keep the
// last one, and a duplicated tensor name would then leave an unexplained hole in the data.
// SAX pass that only looks for a key repeated inside one object (nlohmann keeps the last one
// silently). A separate cheap pass: the DOM parser's callback mode is quadratic-ish on large
// headers (minutes for the 5 MB header of a 37k-tensor adapter), this is linear.
struct DuplicateKeyFinder : nlohmann::json_sax<json> {
  std::vector<std::unordered_set<std::string>> keys_per_object;
  std::string duplicate;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys_per_object.emplace_back();
    return true;
  }
  bool key(string_t& k) override {
    if (!keys_per_object.back().insert(k).second && duplicate.empty()) duplicate = k;
    return true;
  }
  bool end_object() override {
    keys_per_object.pop_back();
    return true;
  }
  bool start_array(std::size_t) override { return true; }
  bool end_array() override { return true; }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override { return false; }
};

json parse_json_strict(std::string_view text, const std::string& file, const std::string& what) {
  check_json_depth(text, file);
  json root;
  try {
    root = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    MOELORA_THROW(ErrorCode::kInvalidFile, file, ": ", what, " is not valid JSON: ", e.what());
  }
  DuplicateKeyFinder finder;
  json::sax_parse(text.begin(), text.end(), &finder);
  MOELORA_CHECK(finder.duplicate.empty(), ErrorCode::kInvalidFile, file, ": ", what, " has the key \"",
                finder.duplicate, "\" twice");
  return root;
}

// Bytes of `numel` elements, or false on uint64 overflow. 4-bit types round up to whole bytes.
bool checked_tensor_bytes(DType dtype, uint64_t numel, uint64_t* bytes) {
  const int bits = dtype_bits(dtype);
  if (bits < 8) {
    *bytes = numel / 2 + numel % 2;  // (numel * 4 + 7) / 8 without the overflow
    return true;
  }
  return !__builtin_mul_overflow(numel, static_cast<uint64_t>(bits / 8), bytes);
}

// ---- the mapping ----

// A read-only MAP_PRIVATE mapping of a whole file, unmapped when the last owner goes away.
// Owners are the SafetensorsFile and every Tensor view into it.
class Mapping {
 public:
  Mapping(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  ~Mapping() {
    if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), size_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_;
  size_t size_;
};

std::shared_ptr<const Mapping> map_file(const fs::path& path) {
  const std::string name = path.string();
  const int fd = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    MOELORA_CHECK(err != ENOENT, ErrorCode::kNotFound, name, ": no such file");
    MOELORA_THROW(ErrorCode::kInvalidFile, name, ": cannot open: ", errno_text(err));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    MOELORA_THROW(ErrorCode::kInvalidFile, name, ": not a regular file");
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    MOELORA_THROW(ErrorCode::kInvalidFile, name, ": file is ", size,
                  " bytes, shorter than the 8-byte header length field of a safetensors file");
  }
  void* data = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping stays valid without the descriptor
  MOELORA_CHECK(data != MAP_FAILED, ErrorCode::kInvalidFile, name, ": mmap of ", size,
                " bytes failed: ", errno_text(err));
  return std::make_shared<const Mapping>(static_cast<const uint8_t*>(data), size);
}

// ---- header validation ----

// One header entry: {"dtype": str, "shape": [uint...], "data_offsets": [begin, end]}. Checks
// types, the dtype name and that the byte span matches shape x dtype; bounds and overlaps are
// checked by the caller, which sees all entries.
TensorInfo parse_tensor_entry(const std::string& file, const std::string& name, const json& entry) {
  const std::string where = file + ": tensor '" + name + "'";
  MOELORA_CHECK(entry.is_object(), ErrorCode::kInvalidFile, where,
                ": expected an object with dtype, shape and data_offsets, got ", describe(entry));
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    MOELORA_CHECK(entry.contains(field), ErrorCode::kInvalidFile, where, ": missing field '", field, "'");
  }
  TensorInfo info;
  info.name = name;

  const json& dtype = entry["dtype"];
  MOELORA_CHECK(dtype.is_string(), ErrorCode::kInvalidFile, where, ": field 'dtype' must be a string, got ",
                describe(dtype));
  const auto parsed_dtype = dtype_from_name(dtype.get<std::string>());
  MOELORA_CHECK(parsed_dtype.has_value(), ErrorCode::kInvalidFile, where, ": unknown dtype ", describe(dtype),
                "; accepted: ", dtype_all_names());
  info.dtype = *parsed_dtype;

  const json& shape = entry["shape"];
  MOELORA_CHECK(shape.is_array(), ErrorCode::kInvalidFile, where, ": field 'shape' must be an array, got ",
                describe(shape));
  bool has_zero = false;
  for (size_t d = 0; d < shape.size(); ++d) {
    const json& dim = shape[d];
    MOELORA_CHECK(!(dim.is_number_integer() && !dim.is_number_unsigned()), ErrorCode::kInvalidFile, where,
                  ": dimension ", d, " of shape ", describe(shape), " is negative (", dim.get<int64_t>(),
                  ")");
    MOELORA_CHECK(dim.is_number_unsigned(), ErrorCode::kInvalidFile, where, ": dimension ", d, " of shape ",
                  describe(shape), " is ", describe(dim), ", not a non-negative integer");
    const uint64_t value = dim.get<uint64_t>();
    MOELORA_CHECK(value <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
                  ErrorCode::kInvalidFile, where, ": dimension ", d, " of shape ", describe(shape), " is ",
                  value, ", larger than the int64 maximum");
    has_zero = has_zero || value == 0;
    info.shape.push_back(static_cast<int64_t>(value));
  }
  // Element count, overflow-checked (a zero dimension makes the count 0 whatever the others are).
  uint64_t numel = 1;
  if (has_zero) {
    numel = 0;
  } else {
    for (int64_t d : info.shape) {
      MOELORA_CHECK(!__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel), ErrorCode::kInvalidFile,
                    where, ": the element count of shape ", shape_str(info.shape), " overflows 64 bits");
    }
  }

  const json& offsets = entry["data_offsets"];
  MOELORA_CHECK(offsets.is_array() && offsets.size() == 2 && offsets[0].is_number_unsigned() &&
                    offsets[1].is_number_unsigned(),
                ErrorCode::kInvalidFile, where,
                ": field 'data_offsets' must be two non-negative integers [begin, end], got ",
                describe(offsets));
  info.begin = offsets[0].get<uint64_t>();
  info.end = offsets[1].get<uint64_t>();
  MOELORA_CHECK(info.begin <= info.end, ErrorCode::kInvalidFile, where, ": data_offsets [", info.begin, ", ",
                info.end, "] begin after they end");

  uint64_t bytes = 0;
  MOELORA_CHECK(checked_tensor_bytes(info.dtype, numel, &bytes), ErrorCode::kInvalidFile, where,
                ": the byte size of ", numel, " elements of ", dtype_name(info.dtype), " overflows 64 bits");
  MOELORA_CHECK(bytes == info.end - info.begin, ErrorCode::kInvalidFile, where, " (", dtype_name(info.dtype),
                ", shape ", shape_str(info.shape), ") needs ", bytes, " bytes but data_offsets [", info.begin,
                ", ", info.end, "] span ", info.end - info.begin, " bytes");
  return info;
}

// Every non-empty tensor inside the data buffer, none overlapping, no unused bytes between or
// after them (the reference reader requires the same full coverage).
void check_layout(const std::string& file, const std::vector<TensorInfo>& tensors, uint64_t data_size) {
  std::vector<const TensorInfo*> by_offset;
  for (const TensorInfo& t : tensors) {
    MOELORA_CHECK(t.end <= data_size, ErrorCode::kInvalidFile, file, ": tensor '", t.name,
                  "': data_offsets [", t.begin, ", ", t.end, "] run past the end of the data buffer (",
                  data_size, " bytes)");
    if (t.end > t.begin) by_offset.push_back(&t);
  }
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorInfo* a, const TensorInfo* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t covered = 0;  // the data buffer is used up to here
  const TensorInfo* previous = nullptr;
  for (const TensorInfo* t : by_offset) {
    if (previous != nullptr) {
      MOELORA_CHECK(t->begin >= previous->end, ErrorCode::kInvalidFile, file, ": tensors '", previous->name,
                    "' [", previous->begin, ", ", previous->end, "] and '", t->name, "' [", t->begin, ", ",
                    t->end, "] overlap");
    }
    MOELORA_CHECK(t->begin == covered, ErrorCode::kInvalidFile, file, ": bytes [", covered, ", ", t->begin,
                  ") of the data buffer belong to no tensor (gap before '", t->name, "' [", t->begin, ", ",
                  t->end, "])");
    covered = t->end;
    previous = t;
  }
  MOELORA_CHECK(covered == data_size, ErrorCode::kInvalidFile, file, ": the data buffer is ", data_size,
                " bytes but the tensors end at byte ", covered, ": ", data_size - covered,
                " trailing bytes belong to no tensor");
}

}  // namespace

// ============================================================================================
// SafetensorsFile
// ============================================================================================

struct SafetensorsFile::Impl {
  fs::path path;
  std::shared_ptr<const Mapping> mapping;
  uint64_t data_start = 0;          // 8 + header length
  std::vector<TensorInfo> tensors;  // sorted by name
  std::map<std::string, std::string> metadata;
};

SafetensorsFile SafetensorsFile::open(const fs::path& path) {
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  impl->mapping = map_file(path);
  const std::string file = path.string();
  const uint8_t* bytes = impl->mapping->data();
  const uint64_t file_size = impl->mapping->size();

  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | bytes[i];  // little-endian u64
  MOELORA_CHECK(header_len <= kSafetensorsMaxHeaderBytes, ErrorCode::kInvalidFile, file, ": header length ",
                header_len, " exceeds the limit of ", kSafetensorsMaxHeaderBytes, " bytes");
  MOELORA_CHECK(header_len <= file_size - 8, ErrorCode::kInvalidFile, file, ": header length ", header_len,
                " runs past the end of the file (file size ", file_size, " bytes)");
  impl->data_start = 8 + header_len;

  const std::string_view header_text(reinterpret_cast<const char*>(bytes + 8), header_len);
  const json header = parse_json_strict(header_text, file, "the header");
  MOELORA_CHECK(header.is_object(), ErrorCode::kInvalidFile, file,
                ": the header must be a JSON object of tensor entries, got ", describe(header));
  const uint64_t entries = header.size() - (header.contains("__metadata__") ? 1 : 0);
  MOELORA_CHECK(entries <= kMaxSafetensorsTensors, ErrorCode::kInvalidFile, file, ": the header lists ",
                entries, " tensors, more than the ", kMaxSafetensorsTensors,
                " accepted in one file (io/input_limits.h)");

  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      MOELORA_CHECK(value.is_object(), ErrorCode::kInvalidFile, file,
                    ": __metadata__ must be an object of string values, got ", describe(value));
      for (const auto& [meta_key, meta_value] : value.items()) {
        MOELORA_CHECK(meta_value.is_string(), ErrorCode::kInvalidFile, file, ": __metadata__ entry '",
                      meta_key, "' must be a string, got ", describe(meta_value));
        impl->metadata[meta_key] = meta_value.get<std::string>();
      }
      continue;
    }
    impl->tensors.push_back(parse_tensor_entry(file, key, value));
  }
  // nlohmann objects iterate in key order already; sort anyway so find() never depends on it.
  std::sort(impl->tensors.begin(), impl->tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.name < b.name; });
  check_layout(file, impl->tensors, file_size - impl->data_start);

  SafetensorsFile result;
  result.impl_ = std::move(impl);
  return result;
}

const fs::path& SafetensorsFile::path() const {
  return impl_->path;
}
const std::vector<TensorInfo>& SafetensorsFile::tensors() const {
  return impl_->tensors;
}
const std::map<std::string, std::string>& SafetensorsFile::metadata() const {
  return impl_->metadata;
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  const auto& tensors = impl_->tensors;
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const TensorInfo& t, const std::string& n) { return t.name < n; });
  return (it != tensors.end() && it->name == name) ? &*it : nullptr;
}

Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorInfo* info = find(name);
  MOELORA_CHECK(info != nullptr, ErrorCode::kNotFound, impl_->path.string(), ": no tensor named '", name,
                "' (the file holds ", impl_->tensors.size(), " tensors)");
  const uint8_t* data = impl_->mapping->data() + impl_->data_start + info->begin;
  // The view's owner is the mapping itself, so the bytes outlive this SafetensorsFile.
  std::shared_ptr<const void> owner(impl_->mapping, impl_->mapping->data());
  return Tensor::external(info->dtype, info->shape, data, std::move(owner));
}

// ============================================================================================
// SafetensorsStore
// ============================================================================================

SafetensorsStore SafetensorsStore::open_file(const fs::path& path) {
  SafetensorsStore store;
  store.files_.push_back(SafetensorsFile::open(path));
  for (const TensorInfo& t : store.files_[0].tensors()) store.where_[t.name] = 0;
  store.source_ = path;
  return store;
}

SafetensorsStore SafetensorsStore::open_dir(const fs::path& dir, const std::string& stem) {
  const std::string index_name = stem + ".safetensors.index.json";
  const std::string single_name = stem + ".safetensors";
  const fs::path index_path = dir / index_name;
  std::error_code ec;
  if (!fs::is_regular_file(index_path, ec)) {
    const fs::path single_path = dir / single_name;
    if (fs::is_regular_file(single_path, ec)) return open_file(single_path);
    MOELORA_THROW(ErrorCode::kNotFound, dir.string(), ": found neither ", index_name, " nor ", single_name,
                  fs::is_directory(dir, ec) ? "" : " (the directory does not exist)");
  }

  const std::string index_file = index_path.string();
  const json index = parse_json_strict(read_limited_text(index_path, kMaxJsonFileBytes, "the index"),
                                       index_file, "the index");
  MOELORA_CHECK(index.is_object(), ErrorCode::kInvalidFile, index_file, ": expected a JSON object, got ",
                describe(index));
  MOELORA_CHECK(index.contains("weight_map"), ErrorCode::kInvalidFile, index_file,
                ": missing field 'weight_map'");
  const json& weight_map = index["weight_map"];
  MOELORA_CHECK(weight_map.is_object(), ErrorCode::kInvalidFile, index_file,
                ": field 'weight_map' must be an object of tensor name -> shard file, got ",
                describe(weight_map));
  if (index.contains("metadata")) {
    MOELORA_CHECK(index["metadata"].is_object() || index["metadata"].is_null(), ErrorCode::kInvalidFile,
                  index_file, ": field 'metadata' must be an object, got ", describe(index["metadata"]));
  }

  // shard file name -> names the weight_map assigns to it
  std::map<std::string, std::vector<std::string>> by_shard;
  for (const auto& [name, shard] : weight_map.items()) {
    MOELORA_CHECK(shard.is_string(), ErrorCode::kInvalidFile, index_file, ": weight_map entry '", name,
                  "' must be a shard file name (string), got ", describe(shard));
    const std::string shard_name = shard.get<std::string>();
    const fs::path shard_rel(shard_name);
    const bool escapes =
        std::any_of(shard_rel.begin(), shard_rel.end(), [](const fs::path& c) { return c == ".."; });
    MOELORA_CHECK(!shard_name.empty() && shard_rel.is_relative() && !escapes, ErrorCode::kInvalidFile,
                  index_file, ": weight_map entry '", name, "' names the shard \"", shard_name,
                  "\"; expected a file name relative to the index's directory");
    by_shard[shard_name].push_back(name);
  }

  SafetensorsStore store;
  store.source_ = index_path;
  for (const auto& [shard_name, names] : by_shard) {
    const fs::path shard_path = dir / shard_name;
    MOELORA_CHECK(fs::is_regular_file(shard_path, ec), ErrorCode::kNotFound, index_file, ": shard '",
                  shard_name, "' (assigned ", names.size(), " tensors, e.g. '", names.front(),
                  "') does not exist: ", shard_path.string());
    SafetensorsFile file = SafetensorsFile::open(shard_path);
    for (const std::string& name : names) {
      MOELORA_CHECK(file.contains(name), ErrorCode::kInvalidFile, index_file, ": tensor '", name,
                    "' is assigned to shard '", shard_name, "' but that file does not contain it (",
                    shard_path.string(), " holds ", file.tensors().size(), " tensors)");
      store.where_[name] = store.files_.size();
    }
    store.files_.push_back(std::move(file));
  }
  return store;
}

std::vector<std::string> SafetensorsStore::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

bool SafetensorsStore::contains(const std::string& name) const {
  return where_.count(name) != 0;
}

size_t SafetensorsStore::file_index(const std::string& name) const {
  auto it = where_.find(name);
  MOELORA_CHECK(it != where_.end(), ErrorCode::kNotFound, source_.string(), ": no tensor named '", name,
                "' (", where_.size(), " tensors available)");
  return it->second;
}

const TensorInfo& SafetensorsStore::info(const std::string& name) const {
  return *files_[file_index(name)].find(name);
}

Tensor SafetensorsStore::tensor(const std::string& name) const {
  return files_[file_index(name)].tensor(name);
}

const fs::path& SafetensorsStore::file_of(const std::string& name) const {
  return files_[file_index(name)].path();
}

const fs::path& SafetensorsStore::source() const {
  return source_;
}

uint64_t SafetensorsStore::total_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, file] : where_) total += files_[file].find(name)->nbytes();
  return total;
}

// ============================================================================================
// SafetensorsWriter
// ============================================================================================

namespace {

// The reference writer sorts by its Dtype enum in descending order (declaration order: BOOL, F4,
// F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ, I16, U16, F16,
// BF16, I32, U32, F32, C64, F64, I64, U64), which puts wider types first and keeps every tensor
// aligned to its element size. These are the positions in that list.
int reference_dtype_rank(DType dtype) {
  switch (dtype) {
    case DType::kBool: return 0;
    case DType::kE2M1x2: return 1;
    case DType::kU8: return 4;
    case DType::kI8: return 5;
    case DType::kF8E5M2: return 6;
    case DType::kF8E4M3: return 7;
    case DType::kF8E8M0: return 8;
    case DType::kI16: return 11;
    case DType::kU16: return 12;
    case DType::kF16: return 13;
    case DType::kBF16: return 14;
    case DType::kI32: return 15;
    case DType::kU32: return 16;
    case DType::kF32: return 17;
    case DType::kF64: return 19;
    case DType::kI64: return 20;
    case DType::kU64: return 21;
  }
  MOELORA_THROW(ErrorCode::kInternal, "reference_dtype_rank: unhandled dtype ", static_cast<int>(dtype));
}

// Writes to a hidden temporary file beside `target` and renames it over `target` on commit();
// destroyed without commit() (an exception while writing), it removes the temporary file.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(fs::path target) : target_(std::move(target)) {
    static std::atomic<uint64_t> counter{0};
    const fs::path parent = target_.has_parent_path() ? target_.parent_path() : fs::path(".");
    temp_ = parent / ("." + target_.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                      std::to_string(counter.fetch_add(1)));
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd_ < 0) {
      const int err = errno;
      MOELORA_CHECK(err != ENOENT, ErrorCode::kNotFound, target_.string(), ": cannot create the file, ",
                    parent.string(), " does not exist");
      MOELORA_THROW(ErrorCode::kInvalidFile, target_.string(), ": cannot create ", temp_.string(), ": ",
                    errno_text(err));
    }
  }
  ~AtomicFileWriter() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temp_.c_str());
  }
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, uint64_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (size > 0) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(size, uint64_t{1} << 30));
      const ssize_t n = ::write(fd_, p, chunk);
      if (n < 0 && errno == EINTR) continue;
      MOELORA_CHECK(n > 0, ErrorCode::kInvalidFile, target_.string(), ": write failed: ", errno_text(errno));
      p += n;
      size -= static_cast<uint64_t>(n);
    }
  }

  void commit() {
    MOELORA_CHECK(::fsync(fd_) == 0, ErrorCode::kInvalidFile, target_.string(),
                  ": fsync failed: ", errno_text(errno));
    const int rc = ::close(fd_);
    fd_ = -1;
    MOELORA_CHECK(rc == 0, ErrorCode::kInvalidFile, target_.string(), ": close failed: ", errno_text(errno));
    MOELORA_CHECK(::rename(temp_.c_str(), target_.c_str()) == 0, ErrorCode::kInvalidFile, target_.string(),
                  ": cannot rename ", temp_.string(), " into place: ", errno_text(errno));
    committed_ = true;
  }

 private:
  fs::path target_;
  fs::path temp_;
  int fd_ = -1;
  bool committed_ = false;
};

std::string shard_file_name(const std::string& stem, size_t index, size_t count) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "-%05zu-of-%05zu.safetensors", index, count);
  return stem + buffer;
}

// "<stem>-<digits>-of-<digits>.safetensors": a shard of some earlier sharded write.
bool is_shard_file_name(const std::string& name, const std::string& stem) {
  const std::string prefix = stem + "-";
  const std::string suffix = ".safetensors";
  if (name.size() <= prefix.size() + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return false;
  }
  const std::string middle = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  const size_t of = middle.find("-of-");
  auto all_digits = [](std::string_view s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  return of != std::string::npos && all_digits(std::string_view(middle).substr(0, of)) &&
         all_digits(std::string_view(middle).substr(of + 4));
}

}  // namespace

uint64_t SafetensorsWriter::Entry::nbytes() const {
  return dtype_bytes(dtype, static_cast<uint64_t>(shape_numel(shape)));
}

void SafetensorsWriter::add_entry(Entry entry) {
  MOELORA_CHECK(!entry.name.empty(), ErrorCode::kInvalidArgument, "safetensors writer: empty tensor name");
  MOELORA_CHECK(entry.name != "__metadata__", ErrorCode::kInvalidArgument,
                "safetensors writer: \"__metadata__\" is reserved and cannot name a tensor");
  MOELORA_CHECK(index_.count(entry.name) == 0, ErrorCode::kInvalidArgument, "safetensors writer: tensor '",
                entry.name, "' added twice");
  const int64_t numel = shape_numel(entry.shape);  // rejects negative dimensions
  MOELORA_CHECK(entry.dtype != DType::kE2M1x2 || numel % 2 == 0, ErrorCode::kInvalidArgument,
                "safetensors writer: tensor '", entry.name, "' of dtype F4 has shape ",
                shape_str(entry.shape), " with an odd element count (", numel,
                "); F4 packs two elements per byte");
  index_[entry.name] = entries_.size();
  entries_.push_back(std::move(entry));
}

void SafetensorsWriter::add(const std::string& name, const Tensor& tensor) {
  MOELORA_CHECK(tensor.defined(), ErrorCode::kInvalidArgument, "safetensors writer: tensor '", name,
                "' is undefined");
  add_entry(Entry{name, tensor.dtype(), tensor.shape(), {}, tensor});
}

void SafetensorsWriter::add(const std::string& name, DType dtype, Shape shape, Fill fill) {
  MOELORA_CHECK(static_cast<bool>(fill), ErrorCode::kInvalidArgument, "safetensors writer: tensor '", name,
                "' has no fill function");
  add_entry(Entry{name, dtype, std::move(shape), std::move(fill), Tensor()});
}

void SafetensorsWriter::set_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

uint64_t SafetensorsWriter::data_bytes() const {
  uint64_t total = 0;
  for (const Entry& e : entries_) total += e.nbytes();
  return total;
}

void SafetensorsWriter::write(const fs::path& path, const std::function<void(uint64_t)>& on_tensor) const {
  // Data order of the reference writer: descending dtype rank, then name (bytewise).
  std::vector<size_t> order(entries_.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const int ra = reference_dtype_rank(entries_[a].dtype), rb = reference_dtype_rank(entries_[b].dtype);
    return ra != rb ? ra > rb : entries_[a].name < entries_[b].name;
  });

  // Header: compact JSON, "__metadata__" first, tensors in data order, fields in the order
  // dtype, shape, data_offsets (ordered_json keeps insertion order).
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata_) meta[key] = value;
    header["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  for (size_t i : order) {
    const Entry& e = entries_[i];
    const uint64_t bytes = e.nbytes();
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = std::string(dtype_name(e.dtype));
    entry["shape"] = e.shape;
    entry["data_offsets"] = {offset, offset + bytes};
    header[e.name] = std::move(entry);
    offset += bytes;
  }
  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    MOELORA_THROW(ErrorCode::kInvalidArgument, path.string(),
                  ": tensor names and metadata must be valid UTF-8: ", e.what());
  }
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  MOELORA_CHECK(header_text.size() <= kSafetensorsMaxHeaderBytes, ErrorCode::kOutOfRange, path.string(),
                ": the header would be ", header_text.size(), " bytes, over the ", kSafetensorsMaxHeaderBytes,
                "-byte limit of readers");

  AtomicFileWriter out(path);
  uint8_t length_field[8];
  for (int i = 0; i < 8; ++i) length_field[i] = static_cast<uint8_t>(uint64_t{header_text.size()} >> (8 * i));
  out.write(length_field, 8);
  out.write(header_text.data(), header_text.size());

  std::vector<uint8_t> buffer;  // reused for Fill entries; sized by the largest one
  for (size_t i : order) {
    const Entry& e = entries_[i];
    const uint64_t bytes = e.nbytes();
    if (bytes > 0) {
      if (e.source.defined()) {
        out.write(e.source.raw_data(), bytes);
      } else {
        buffer.assign(bytes, 0);
        e.fill(buffer.data());
        out.write(buffer.data(), bytes);
      }
    }
    if (on_tensor) on_tensor(bytes);
  }
  out.commit();
}

void SafetensorsWriter::write_sharded(const fs::path& dir, uint64_t max_shard_bytes, const std::string& stem,
                                      const std::function<void(uint64_t)>& on_tensor) const {
  MOELORA_CHECK(max_shard_bytes > 0, ErrorCode::kInvalidArgument, dir.string(),
                ": max_shard_bytes must be positive");
  MOELORA_CHECK(!stem.empty(), ErrorCode::kInvalidArgument, dir.string(), ": empty file stem");

  // Greedy split in insertion order; an oversized tensor gets a shard of its own, appended at
  // the point where it is met.
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  uint64_t current_bytes = 0;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const uint64_t bytes = entries_[i].nbytes();
    if (bytes > max_shard_bytes) {
      shards.push_back({i});
      continue;
    }
    if (!current.empty() && current_bytes + bytes > max_shard_bytes) {
      shards.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(i);
    current_bytes += bytes;
  }
  if (!current.empty() || shards.empty()) shards.push_back(std::move(current));

  std::error_code ec;
  fs::create_directories(dir, ec);
  MOELORA_CHECK(fs::is_directory(dir, ec), ErrorCode::kInvalidArgument, dir.string(),
                ": cannot create the output directory");

  const std::string index_name = stem + ".safetensors.index.json";
  const std::string single_name = stem + ".safetensors";
  std::set<std::string> written;

  if (shards.size() == 1) {
    write(dir / single_name, on_tensor);
    written.insert(single_name);
  } else {
    json weight_map = json::object();
    for (size_t k = 0; k < shards.size(); ++k) {
      const std::string file_name = shard_file_name(stem, k + 1, shards.size());
      SafetensorsWriter shard;
      shard.metadata_ = metadata_;
      for (size_t i : shards[k]) {
        shard.add_entry(entries_[i]);
        weight_map[entries_[i].name] = file_name;
      }
      shard.write(dir / file_name, on_tensor);
      written.insert(file_name);
    }
    json index = {{"metadata", {{"total_size", data_bytes()}}}, {"weight_map", std::move(weight_map)}};
    const std::string text = index.dump(2) + "\n";
    AtomicFileWriter out(dir / index_name);
    out.write(text.data(), text.size());
    out.commit();
    written.insert(index_name);
  }

  // Remove what an earlier write with the same stem left behind (a stale index would make
  // open_dir read old shards).
  std::vector<fs::path> stale;
  for (const auto& item : fs::directory_iterator(dir, ec)) {
    const std::string name = item.path().filename().string();
    const bool ours = name == index_name || name == single_name || is_shard_file_name(name, stem);
    if (ours && written.count(name) == 0) stale.push_back(item.path());
  }
  for (const fs::path& path : stale) fs::remove(path, ec);
}

}  // namespace moelora::io
