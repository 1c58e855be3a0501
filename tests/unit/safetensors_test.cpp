// safetensors reader, store and writer (src/io/safetensors.h):
//   - goldens written by the Python reference (tests/data/safetensors/make_golden.py): the reader
//     returns the reference's values for every dtype, and the writer reproduces its bytes exactly;
//   - seeded round trips of every dtype (F4 and F8_E4M3 included), zero-sized tensors, metadata;
//   - sharded write + read through the index, and the index error cases;
//   - a suite of hand-made corrupt files: each must throw kInvalidFile (or kNotFound) with a
//     message that starts with the file path and names the tensor and the numbers involved.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <set>
#include <sstream>

#include "io/safetensors.h"
#include "support/test_support.h"

namespace moelora::io {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// ---------------------------------------------------------------------------------------------
// helpers

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors file made by hand: length field (the header's true size unless overridden),
// header text, data bytes.
std::string safetensors_bytes(const std::string& header, const std::string& data,
                              std::optional<uint64_t> declared_length = std::nullopt) {
  const uint64_t n = declared_length.value_or(header.size());
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

std::string tensor_bytes(const Tensor& t) {
  return std::string(static_cast<const char*>(t.raw_data()), t.nbytes());
}

// Runs fn, expects a moelora::Error with `code`, returns its message ("" when nothing threw).
std::string error_message(const std::function<void()>& fn, ErrorCode code) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << "message: " << e.what();
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected moelora::Error, got std::exception: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected moelora::Error, nothing was thrown";
  return "";
}

// First differing byte of two binary strings, for readable failures.
::testing::AssertionResult same_bytes(const std::string& actual, const std::string& expected) {
  if (actual == expected) return ::testing::AssertionSuccess();
  size_t i = 0;
  while (i < actual.size() && i < expected.size() && actual[i] == expected[i]) ++i;
  return ::testing::AssertionFailure()
         << "sizes " << actual.size() << " vs " << expected.size() << ", first difference at byte " << i
         << "\n  actual:   " << actual.substr(0, std::min<size_t>(actual.size(), 700))
         << "\n  expected: " << expected.substr(0, std::min<size_t>(expected.size(), 700));
}

// ---------------------------------------------------------------------------------------------
// the golden tensors (mirror of make_golden.py: same list, same value formulas)

struct GoldenTensor {
  std::string name;
  DType dtype;
  Shape shape;
};

const std::vector<GoldenTensor>& golden_tensors() {
  static const std::vector<GoldenTensor> list = {
      {"a.f32", DType::kF32, {3, 5}},
      {"b.bf16", DType::kBF16, {7, 3}},
      {"c.f16", DType::kF16, {2, 3, 5}},
      {"d.f64", DType::kF64, {5}},
      {"e.f8_e4m3", DType::kF8E4M3, {3, 7}},
      {"f.f8_e5m2", DType::kF8E5M2, {11}},
      {"g.f8_e8m0", DType::kF8E8M0, {3, 3}},
      {"h.f4", DType::kE2M1x2, {3, 10}},
      {"i.bool", DType::kBool, {9}},
      {"j.u8", DType::kU8, {13}},
      {"k.i8", DType::kI8, {2, 7}},
      {"l.i16", DType::kI16, {5, 3}},
      {"m.u16", DType::kU16, {7}},
      {"n.i32", DType::kI32, {3, 3}},
      {"o.u32", DType::kU32, {5}},
      {"p.i64", DType::kI64, {2, 3}},
      {"q.u64", DType::kU64, {3}},
      {"r.empty", DType::kF32, {0, 5}},
      {"s.scalar", DType::kF32, {}},
      {"Z.upper", DType::kBF16, {3}},
      {"\xd0\xbc\xd0\xbe\xd0\xb4\xd0\xb5\xd0\xbb\xd1\x8c.\xd0\xb2\xd0\xb5\xd1\x81", DType::kF16, {2}},
      {"quote\"back\\slash/name", DType::kI32, {1}},
      {"t.empty_bf16", DType::kBF16, {4, 0, 3}},
  };
  return list;
}

float golden_float_value(int64_t t, int64_t i) {
  return static_cast<float>(((i * 7 + t * 3) % 17 - 8) * 0.25);
}
uint64_t golden_int_bits(uint64_t t, uint64_t i) {
  return (i + 1) * 0x9E3779B97F4A7C15ull + t * 0x632BE59BD9B4E019ull;  // wraps mod 2^64 like the script
}

// The expected bytes of golden tensor t, computed independently of the reader.
std::string golden_bytes(int64_t t) {
  const GoldenTensor& g = golden_tensors()[t];
  const int64_t n = shape_numel(g.shape);
  std::string out;
  auto put = [&out](uint64_t value, int bytes) {
    for (int b = 0; b < bytes; ++b) out.push_back(static_cast<char>((value >> (8 * b)) & 0xff));
  };
  if (g.dtype == DType::kE2M1x2) {
    for (int64_t i = 0; i < n / 2; ++i) put((i * 29 + t * 7) % 256, 1);
    return out;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = golden_float_value(t, i);
    switch (g.dtype) {
      case DType::kF32: put(std::bit_cast<uint32_t>(v), 4); break;
      case DType::kF64: put(std::bit_cast<uint64_t>(static_cast<double>(v)), 8); break;
      case DType::kBF16: put(f32_to_bf16_bits(v), 2); break;
      case DType::kF16: put(f32_to_f16_bits(v), 2); break;
      case DType::kF8E4M3: put(f32_to_e4m3(v), 1); break;
      case DType::kF8E5M2: put(f32_to_f16_bits(v) >> 8, 1); break;  // exact: v fits e5m2
      case DType::kF8E8M0: put(120 + (i * 5 + t) % 15, 1); break;
      case DType::kBool: put((i * 5 + t) % 3 == 0 ? 1 : 0, 1); break;
      default: put(golden_int_bits(t, i), dtype_bits(g.dtype) / 8); break;
    }
  }
  return out;
}

fs::path golden_path(const std::string& name) {
  return test::data_dir() / "safetensors" / name;
}

// ---------------------------------------------------------------------------------------------
// goldens from the Python reference

TEST(SafetensorsGolden, ReaderReturnsTheReferenceValuesForEveryDtype) {
  const SafetensorsFile file = SafetensorsFile::open(golden_path("golden.safetensors"));
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  ASSERT_EQ(file.tensors().size(), golden_tensors().size());
  for (size_t t = 0; t < golden_tensors().size(); ++t) {
    const GoldenTensor& g = golden_tensors()[t];
    SCOPED_TRACE(g.name);
    ASSERT_TRUE(file.contains(g.name));
    const Tensor tensor = file.tensor(g.name);
    EXPECT_EQ(tensor.dtype(), g.dtype);
    EXPECT_EQ(tensor.shape(), g.shape);
    EXPECT_EQ(file.find(g.name)->nbytes(), tensor.nbytes());
    EXPECT_TRUE(same_bytes(tensor_bytes(tensor), golden_bytes(static_cast<int64_t>(t))));
    // Values through the fp32 loader: the float formulas are exact in every float dtype.
    if (g.dtype == DType::kF32 || g.dtype == DType::kBF16 || g.dtype == DType::kF16 ||
        g.dtype == DType::kF64 || g.dtype == DType::kF8E4M3 || g.dtype == DType::kF8E5M2) {
      for (int64_t i = 0; i < tensor.numel(); ++i) {
        ASSERT_EQ(tensor.item_f32(i), golden_float_value(static_cast<int64_t>(t), i)) << "element " << i;
      }
    }
    if (g.dtype == DType::kF8E8M0) {
      for (int64_t i = 0; i < tensor.numel(); ++i) {
        EXPECT_EQ(tensor.item_f32(i), std::ldexp(1.0f, static_cast<int>(120 + (i * 5 + t) % 15) - 127));
      }
    }
    if (g.dtype == DType::kE2M1x2) {
      for (int64_t i = 0; i < tensor.numel(); ++i) {
        const int byte = static_cast<int>((i / 2 * 29 + t * 7) % 256);
        const int code = (i % 2 == 0) ? (byte & 0xf) : (byte >> 4);  // low nibble = even element
        EXPECT_EQ(tensor.item_f32(i), kE2M1Values[code]) << "element " << i;
      }
    }
  }
  // names come back sorted (bytewise: upper case and '"' before lower case, UTF-8 last)
  std::vector<std::string> names;
  for (const TensorInfo& info : file.tensors()) names.push_back(info.name);
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_EQ(names.front(), "Z.upper");
}

TEST(SafetensorsGolden, ReaderOfFileWithoutMetadata) {
  const SafetensorsFile file = SafetensorsFile::open(golden_path("golden_nometa.safetensors"));
  EXPECT_TRUE(file.metadata().empty());
  EXPECT_EQ(file.tensors().size(), 3u);
  EXPECT_TRUE(same_bytes(tensor_bytes(file.tensor("j.u8")), golden_bytes(9)));
}

// Writes golden tensors `which` with SafetensorsWriter; alternates the two add() forms.
void add_golden(SafetensorsWriter& writer, const std::vector<int64_t>& which) {
  for (int64_t t : which) {
    const GoldenTensor& g = golden_tensors()[t];
    const std::string bytes = golden_bytes(t);
    if (t % 2 == 0) {
      Tensor tensor = Tensor::empty(g.dtype, g.shape);
      if (!bytes.empty()) std::memcpy(tensor.raw_data(), bytes.data(), bytes.size());
      writer.add(g.name, tensor);
    } else {
      writer.add(g.name, g.dtype, g.shape,
                 [bytes](void* dst) { std::memcpy(dst, bytes.data(), bytes.size()); });
    }
  }
}

TEST(SafetensorsGolden, WriterIsByteIdenticalToTheReferenceWriter) {
  test::TempDir dir;
  SafetensorsWriter writer;
  std::vector<int64_t> all(golden_tensors().size());
  std::iota(all.begin(), all.end(), int64_t{0});
  std::reverse(all.begin(), all.end());  // insertion order must not matter
  add_golden(writer, all);
  writer.write(dir / "ours.safetensors");
  EXPECT_TRUE(
      same_bytes(read_bytes(dir / "ours.safetensors"), read_bytes(golden_path("golden.safetensors"))));
}

TEST(SafetensorsGolden, WriterWithoutMetadataIsByteIdentical) {
  test::TempDir dir;
  SafetensorsWriter writer;
  writer.clear_metadata();
  add_golden(writer, {18, 0, 9});
  writer.write(dir / "ours.safetensors");
  EXPECT_TRUE(
      same_bytes(read_bytes(dir / "ours.safetensors"), read_bytes(golden_path("golden_nometa.safetensors"))));
}

// ---------------------------------------------------------------------------------------------
// round trips

const std::vector<DType> kAllDTypes = {
    DType::kBool, DType::kU8,     DType::kI8,     DType::kI16,    DType::kU16,   DType::kI32,
    DType::kU32,  DType::kI64,    DType::kU64,    DType::kF16,    DType::kBF16,  DType::kF32,
    DType::kF64,  DType::kF8E4M3, DType::kF8E5M2, DType::kF8E8M0, DType::kE2M1x2};

Tensor random_bytes_tensor(DType dtype, const Shape& shape, std::mt19937_64& rng) {
  Tensor t = Tensor::empty(dtype, shape);
  auto* p = static_cast<uint8_t*>(t.raw_data());
  for (uint64_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<uint8_t>(rng());
  return t;
}

TEST(SafetensorsRoundTrip, EveryDtypeZeroSizedTensorsAndMetadata) {
  std::mt19937_64 rng(test::test_seed(1234));
  test::TempDir dir;
  std::map<std::string, Tensor> expected;
  SafetensorsWriter writer;
  int n = 0;
  for (DType dtype : kAllDTypes) {
    // odd sizes; F4 needs an even element count per tensor
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 7),
                  cols = 2 * (1 + static_cast<int64_t>(rng() % 5)) + 1;
    const Shape shape = dtype == DType::kE2M1x2 ? Shape{rows, cols + 1} : Shape{rows, cols};
    const std::string name = "layer." + std::to_string(n++) + "." + std::string(dtype_name(dtype));
    expected[name] = random_bytes_tensor(dtype, shape, rng);
    writer.add(name, expected[name]);
    const std::string empty_name = name + ".empty";
    expected[empty_name] = Tensor::zeros(dtype, {rows, 0});
    writer.add(empty_name, expected[empty_name]);
  }
  expected["scalar"] = Tensor::from_f32({2.5f}, {});
  writer.add("scalar", expected["scalar"]);
  writer.set_metadata("producer", "moelora test");
  writer.set_metadata("format", "mlx");  // overrides the default "pt"
  std::vector<uint64_t> progress;
  writer.write(dir / "rt.safetensors", [&](uint64_t bytes) { progress.push_back(bytes); });
  EXPECT_EQ(progress.size(), expected.size());
  uint64_t expected_data = 0;
  for (const auto& [name, t] : expected) expected_data += t.nbytes();
  EXPECT_EQ(std::accumulate(progress.begin(), progress.end(), uint64_t{0}), expected_data);
  EXPECT_EQ(writer.data_bytes(), expected_data);

  const SafetensorsFile file = SafetensorsFile::open(dir / "rt.safetensors");
  EXPECT_EQ(file.metadata(),
            (std::map<std::string, std::string>{{"format", "mlx"}, {"producer", "moelora test"}}));
  ASSERT_EQ(file.tensors().size(), expected.size());
  for (const auto& [name, t] : expected) {
    SCOPED_TRACE(name);
    const Tensor got = file.tensor(name);
    EXPECT_EQ(got.dtype(), t.dtype());
    EXPECT_EQ(got.shape(), t.shape());
    EXPECT_TRUE(same_bytes(tensor_bytes(got), tensor_bytes(t)));
    // The writer's layout aligns every tensor to its element size inside the page-aligned map.
    const int elem = std::max(1, dtype_bits(t.dtype()) / 8);
    if (got.nbytes() > 0) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(got.raw_data()) % elem, 0u);
    }
  }

  // Header length field is a multiple of 8 and the header is space-padded JSON.
  const std::string raw = read_bytes(dir / "rt.safetensors");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(raw[i]);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + header_len + expected_data);
}

TEST(SafetensorsRoundTrip, DataOrderIsDescendingDtypeThenName) {
  test::TempDir dir;
  SafetensorsWriter writer;
  writer.add("b", Tensor::zeros(DType::kBF16, {3}));
  writer.add("a", Tensor::zeros(DType::kBF16, {3}));
  writer.add("c", Tensor::zeros(DType::kU8, {1}));
  writer.add("d", Tensor::zeros(DType::kF32, {1}));
  writer.add("e", Tensor::zeros(DType::kE2M1x2, {2}));
  writer.add("f", Tensor::zeros(DType::kI64, {1}));
  writer.write(dir / "o.safetensors");
  const SafetensorsFile file = SafetensorsFile::open(dir / "o.safetensors");
  std::vector<const TensorInfo*> by_offset;
  for (const TensorInfo& t : file.tensors()) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* x, auto* y) { return x->begin < y->begin; });
  std::string order;
  for (const TensorInfo* t : by_offset) order += t->name;
  EXPECT_EQ(order, "fdabce");  // I64, F32, BF16 (a, b), U8, F4
}

TEST(SafetensorsRoundTrip, TensorViewsKeepTheMappingAlive) {
  test::TempDir dir;
  std::mt19937_64 rng(test::test_seed(77));
  const Tensor original = test::random_normal({5, 3}, rng);
  {
    SafetensorsWriter writer;
    writer.add("w", original);
    writer.write(dir / "w.safetensors");
  }
  Tensor view;
  {
    SafetensorsStore store = SafetensorsStore::open_file(dir / "w.safetensors");
    view = store.tensor("w");
  }
  fs::remove(dir / "w.safetensors");  // the mapping outlives the directory entry too
  ASSERT_TRUE(view.defined());
  EXPECT_TRUE(test::all_close(view, original, 0, 0));
}

TEST(SafetensorsRoundTrip, OverwritesAtomicallyAndCleansUpAfterAFailedFill) {
  test::TempDir dir;
  const fs::path path = dir / "x.safetensors";
  {
    SafetensorsWriter writer;
    writer.add("old", Tensor::from_f32({1, 2, 3}, {3}));
    writer.write(path);
  }
  SafetensorsWriter failing;
  failing.add("new", DType::kF32, {4}, [](void*) { throw std::runtime_error("producer failed"); });
  EXPECT_THROW(failing.write(path), std::runtime_error);
  // the old file is untouched and no temporary file is left behind
  EXPECT_TRUE(SafetensorsFile::open(path).contains("old"));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);

  SafetensorsWriter replacing;
  replacing.add("new", Tensor::from_f32({4, 5}, {2}));
  replacing.write(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_FALSE(file.contains("old"));
  EXPECT_EQ(file.tensor("new").item_f32(1), 5.0f);
}

TEST(SafetensorsWriter, RejectsBadEntries) {
  SafetensorsWriter writer;
  writer.add("a", Tensor::zeros(DType::kF32, {2}));
  EXPECT_THAT(
      error_message([&] { writer.add("a", Tensor::zeros(DType::kF32, {2})); }, ErrorCode::kInvalidArgument),
      HasSubstr("'a' added twice"));
  EXPECT_THAT(error_message([&] { writer.add("__metadata__", Tensor::zeros(DType::kF32, {1})); },
                            ErrorCode::kInvalidArgument),
              HasSubstr("reserved"));
  EXPECT_THAT(
      error_message([&] { writer.add("", Tensor::zeros(DType::kF32, {1})); }, ErrorCode::kInvalidArgument),
      HasSubstr("empty tensor name"));
  EXPECT_THAT(error_message(
                  [&] {
                    writer.add("odd", Tensor::zeros(DType::kE2M1x2, {3, 3}));
                  },
                  ErrorCode::kInvalidArgument),
              AllOf(HasSubstr("'odd'"), HasSubstr("[3, 3]"), HasSubstr("odd element count (9)")));
  EXPECT_THAT(error_message([&] { writer.add("undef", Tensor()); }, ErrorCode::kInvalidArgument),
              HasSubstr("'undef' is undefined"));
  EXPECT_THAT(error_message([&] { writer.add("nofill", DType::kF32, {2}, {}); }, ErrorCode::kInvalidArgument),
              HasSubstr("no fill"));
  EXPECT_EQ(writer.size(), 1u);

  test::TempDir dir;
  EXPECT_THAT(error_message([&] { writer.write(dir / "missing" / "x.safetensors"); }, ErrorCode::kNotFound),
              HasSubstr("does not exist"));
  SafetensorsWriter bad_utf8;
  bad_utf8.add("bad\xff", Tensor::zeros(DType::kU8, {1}));
  EXPECT_THAT(error_message([&] { bad_utf8.write(dir / "u.safetensors"); }, ErrorCode::kInvalidArgument),
              HasSubstr("UTF-8"));
  EXPECT_FALSE(fs::exists(dir / "u.safetensors"));
}

// ---------------------------------------------------------------------------------------------
// sharded checkpoints

// 7 tensors of 4 x 5 floats (80 bytes) plus one of 400 bytes, added in a known order.
SafetensorsWriter make_sharded_writer(std::map<std::string, Tensor>& expected, std::mt19937_64& rng) {
  SafetensorsWriter writer;
  for (int i = 0; i < 7; ++i) {
    const std::string name = "model.layers." + std::to_string(i) + ".w";
    expected[name] = test::random_normal({4, 5}, rng);
    writer.add(name, expected[name]);
    if (i == 3) {
      expected["model.big"] = test::random_normal({20, 5}, rng);
      writer.add("model.big", expected["model.big"]);
    }
  }
  return writer;
}

TEST(SafetensorsSharded, WriteAndReadThroughTheIndex) {
  std::mt19937_64 rng(test::test_seed(99));
  test::TempDir dir;
  std::map<std::string, Tensor> expected;
  SafetensorsWriter writer = make_sharded_writer(expected, rng);
  uint64_t progress = 0;
  writer.write_sharded(dir.path(), 250, "model", [&](uint64_t b) { progress += b; });
  EXPECT_EQ(progress, 7 * 80 + 400u);

  // Greedy split of 80-byte tensors into 250-byte shards; the 400-byte tensor alone.
  // Order: [l0 l1 l2] [big] [l3 l4 l5] [l6]: big is emitted where it is met, l3 still joins the
  // open shard (like huggingface_hub).
  const nlohmann::json index =
      nlohmann::json::parse(test::read_text_file(dir / "model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], 7 * 80 + 400);
  const nlohmann::json& map = index["weight_map"];
  EXPECT_EQ(map.size(), 8u);
  EXPECT_EQ(map["model.layers.0.w"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(map["model.layers.2.w"], "model-00001-of-00004.safetensors");
  EXPECT_EQ(map["model.big"], "model-00002-of-00004.safetensors");
  EXPECT_EQ(map["model.layers.3.w"], "model-00003-of-00004.safetensors");
  EXPECT_EQ(map["model.layers.5.w"], "model-00003-of-00004.safetensors");
  EXPECT_EQ(map["model.layers.6.w"], "model-00004-of-00004.safetensors");
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  // Sorted keys, 2-space indent, trailing newline (json.dumps(indent=2, sort_keys=True) + "\n").
  const std::string text = test::read_text_file(dir / "model.safetensors.index.json");
  EXPECT_LT(text.find("\"model.big\""), text.find("\"model.layers.0.w\""));
  EXPECT_EQ(text.back(), '\n');

  const SafetensorsStore store = SafetensorsStore::open_dir(dir.path());
  EXPECT_EQ(store.source(), dir / "model.safetensors.index.json");
  EXPECT_EQ(store.size(), 8u);
  EXPECT_EQ(store.total_bytes(), 7 * 80 + 400u);
  EXPECT_EQ(store.file_of("model.big"), dir / "model-00002-of-00004.safetensors");
  std::vector<std::string> names = store.names();
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  for (const auto& [name, t] : expected) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(store.contains(name));
    EXPECT_EQ(store.info(name).shape, t.shape());
    EXPECT_TRUE(same_bytes(tensor_bytes(store.tensor(name)), tensor_bytes(t)));
  }
  EXPECT_THAT(error_message([&] { store.tensor("model.missing"); }, ErrorCode::kNotFound),
              AllOf(HasSubstr("model.safetensors.index.json"), HasSubstr("'model.missing'")));
  EXPECT_THAT(error_message([&] { store.info("nope"); }, ErrorCode::kNotFound), HasSubstr("'nope'"));
  EXPECT_THAT(error_message([&] { store.file_of("nope"); }, ErrorCode::kNotFound), HasSubstr("'nope'"));
}

TEST(SafetensorsSharded, OneShardIsASingleFileAndStaleFilesAreRemoved) {
  std::mt19937_64 rng(test::test_seed(5));
  test::TempDir dir;
  std::map<std::string, Tensor> expected;
  SafetensorsWriter writer = make_sharded_writer(expected, rng);
  writer.write_sharded(dir.path(), 250, "adapter_model");
  ASSERT_TRUE(fs::exists(dir / "adapter_model.safetensors.index.json"));
  write_bytes(dir / "adapter_model-00009-of-00009.safetensors", "stale");
  write_bytes(dir / "unrelated.safetensors", "keep me");

  writer.write_sharded(dir.path(), uint64_t{1} << 40, "adapter_model");
  EXPECT_TRUE(fs::exists(dir / "adapter_model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "adapter_model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "adapter_model-00001-of-00004.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "adapter_model-00009-of-00009.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "unrelated.safetensors"));

  const SafetensorsStore store = SafetensorsStore::open_dir(dir.path(), "adapter_model");
  EXPECT_EQ(store.source(), dir / "adapter_model.safetensors");
  EXPECT_EQ(store.size(), expected.size());
  EXPECT_THAT(error_message([&] { writer.write_sharded(dir.path(), 0); }, ErrorCode::kInvalidArgument),
              HasSubstr("max_shard_bytes"));
}

TEST(SafetensorsSharded, IndexIsPreferredAndUnlistedTensorsAreHidden) {
  test::TempDir dir;
  SafetensorsWriter shard;
  shard.add("listed", Tensor::from_f32({1, 2}, {2}));
  shard.add("unlisted", Tensor::from_f32({3}, {1}));
  shard.write(dir / "part-a.safetensors");
  SafetensorsWriter single;
  single.add("from_single_file", Tensor::from_f32({9}, {1}));
  single.write(dir / "model.safetensors");
  test::write_text_file(dir / "model.safetensors.index.json",
                        R"({"metadata": {"total_size": 8}, "weight_map": {"listed": "part-a.safetensors"}})");
  const SafetensorsStore store = SafetensorsStore::open_dir(dir.path());
  EXPECT_EQ(store.names(), std::vector<std::string>{"listed"});
  EXPECT_FALSE(store.contains("unlisted"));
  EXPECT_FALSE(store.contains("from_single_file"));
  EXPECT_EQ(store.total_bytes(), 8u);
}

TEST(SafetensorsSharded, MissingFilesAndBadIndexes) {
  test::TempDir dir;
  // neither file
  EXPECT_THAT(error_message([&] { SafetensorsStore::open_dir(dir.path()); }, ErrorCode::kNotFound),
              AllOf(StartsWith(dir.path().string()), HasSubstr("model.safetensors.index.json"),
                    HasSubstr("model.safetensors")));
  EXPECT_THAT(
      error_message([&] { SafetensorsStore::open_dir(dir / "nope", "adapter_model"); }, ErrorCode::kNotFound),
      AllOf(HasSubstr("adapter_model.safetensors.index.json"), HasSubstr("does not exist")));

  SafetensorsWriter shard;
  shard.add("a", Tensor::from_f32({1}, {1}));
  shard.write(dir / "s1.safetensors");
  const fs::path index = dir / "model.safetensors.index.json";
  const std::string index_name = index.string();
  auto expect_index_error = [&](const std::string& text, ErrorCode code, std::vector<std::string> words) {
    test::write_text_file(index, text);
    const std::string msg = error_message([&] { SafetensorsStore::open_dir(dir.path()); }, code);
    EXPECT_THAT(msg, StartsWith(index_name)) << text;
    for (const std::string& w : words) EXPECT_THAT(msg, HasSubstr(w)) << text;
  };
  expect_index_error(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})",
                     ErrorCode::kNotFound, {"shard 's2.safetensors'", "'b'", "does not exist"});
  expect_index_error(R"({"weight_map": {"a": "s1.safetensors", "ghost": "s1.safetensors"}})",
                     ErrorCode::kInvalidFile, {"'ghost'", "'s1.safetensors'", "does not contain"});
  expect_index_error(R"({"weight_map": {"a": "s1.safetensors",)", ErrorCode::kInvalidFile,
                     {"not valid JSON", "line 1"});
  expect_index_error(R"({"metadata": {}})", ErrorCode::kInvalidFile, {"missing field 'weight_map'"});
  expect_index_error(R"({"weight_map": ["a"]})", ErrorCode::kInvalidFile, {"'weight_map' must be an object"});
  expect_index_error(R"({"weight_map": {"a": 3}})", ErrorCode::kInvalidFile, {"'a'", "string", "3"});
  expect_index_error(R"({"weight_map": {"a": "../s1.safetensors"}})", ErrorCode::kInvalidFile,
                     {"../s1.safetensors", "relative"});
  expect_index_error(R"({"weight_map": {"a": "/etc/passwd"}})", ErrorCode::kInvalidFile, {"/etc/passwd"});
  expect_index_error(R"({"weight_map": {"a": "s1.safetensors", "a": "s1.safetensors"}})",
                     ErrorCode::kInvalidFile, {"\"a\" twice"});
  expect_index_error(R"([1, 2])", ErrorCode::kInvalidFile, {"JSON object"});
  expect_index_error(R"({"metadata": 3, "weight_map": {}})", ErrorCode::kInvalidFile, {"'metadata'"});

  // A shard that is itself corrupt reports the shard's path.
  write_bytes(dir / "s3.safetensors", "tiny");
  test::write_text_file(index, R"({"weight_map": {"x": "s3.safetensors"}})");
  EXPECT_THAT(error_message([&] { SafetensorsStore::open_dir(dir.path()); }, ErrorCode::kInvalidFile),
              StartsWith((dir / "s3.safetensors").string()));
}

// ---------------------------------------------------------------------------------------------
// corrupt files written by hand

class SafetensorsCorrupt : public ::testing::Test {
 protected:
  // Writes `bytes` as bad.safetensors, opens it, expects `code` and a message that starts with
  // the path and contains every word.
  void expect_rejected(const std::string& bytes, const std::vector<std::string>& words,
                       ErrorCode code = ErrorCode::kInvalidFile) {
    const fs::path path = dir_ / "bad.safetensors";
    write_bytes(path, bytes);
    const std::string msg = error_message([&] { SafetensorsFile::open(path); }, code);
    EXPECT_THAT(msg, StartsWith(path.string()));
    for (const std::string& w : words) EXPECT_THAT(msg, HasSubstr(w));
  }
  // A one-tensor file: header {"<name>": <entry>} and `data_size` zero bytes of data.
  void expect_entry_rejected(const std::string& entry, uint64_t data_size,
                             const std::vector<std::string>& words) {
    expect_rejected(safetensors_bytes("{\"w\": " + entry + "}", std::string(data_size, '\0')), words);
  }
  test::TempDir dir_;
};

TEST_F(SafetensorsCorrupt, TruncatedAndEmptyFiles) {
  expect_rejected("", {"0 bytes", "shorter than the 8-byte header length"});
  expect_rejected(std::string("\x05\x00\x00", 3), {"3 bytes", "shorter than"});
}

TEST_F(SafetensorsCorrupt, HeaderLengthPastTheEnd) {
  // 8-byte length field claiming 1234 header bytes, in a 100-byte file.
  expect_rejected(safetensors_bytes(std::string(92, ' '), "", 1234),
                  {"header length 1234 runs past the end of the file (file size 100 bytes)"});
  // A valid file cut short inside the data: the header now promises more data than is there.
  SafetensorsWriter writer;
  writer.add("w", Tensor::zeros(DType::kF32, {4, 4}));
  writer.write(dir_ / "good.safetensors");
  const std::string good = read_bytes(dir_ / "good.safetensors");
  expect_rejected(good.substr(0, good.size() - 10),
                  {"'w'", "run past the end of the data buffer (54 bytes)"});
  expect_rejected(good.substr(0, 20), {"runs past the end of the file (file size 20 bytes)"});
}

TEST_F(SafetensorsCorrupt, HeaderLengthOverTheLimit) {
  expect_rejected(safetensors_bytes("{}", "", 100'000'001),
                  {"header length 100000001", "exceeds", "100000000"});
  expect_rejected(safetensors_bytes("{}", "", ~uint64_t{0}), {"18446744073709551615", "exceeds"});
}

TEST_F(SafetensorsCorrupt, BadJson) {
  expect_rejected(safetensors_bytes("{\"w\": {\"dtype\": \"F32\",\n \"shape\": [1], }", ""),
                  {"header is not valid JSON", "line 2"});
  expect_rejected(safetensors_bytes("[1, 2]  ", ""), {"must be a JSON object", "[1,2]"});
  expect_rejected(safetensors_bytes("{\"w\": \"\xff\xfe\"}", ""), {"not valid JSON"});
  expect_rejected(safetensors_bytes("{\"w\": 5}", ""), {"tensor 'w'", "expected an object"});
  expect_rejected(safetensors_bytes(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},)"
                                    R"( "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
                                    "ab"),
                  {"\"w\" twice"});
}

TEST_F(SafetensorsCorrupt, FieldTypes) {
  expect_entry_rejected(R"({"shape": [1], "data_offsets": [0, 1]})", 1, {"'w'", "missing field 'dtype'"});
  expect_entry_rejected(R"({"dtype": "U8", "data_offsets": [0, 1]})", 1, {"'w'", "missing field 'shape'"});
  expect_entry_rejected(R"({"dtype": "U8", "shape": [1]})", 1, {"'w'", "missing field 'data_offsets'"});
  expect_entry_rejected(R"({"dtype": 3, "shape": [1], "data_offsets": [0, 1]})", 1,
                        {"'dtype' must be a string"});
  expect_entry_rejected(R"({"dtype": "U8", "shape": 1, "data_offsets": [0, 1]})", 1,
                        {"'shape' must be an array"});
  expect_entry_rejected(R"({"dtype": "U8", "shape": [1], "data_offsets": [0]})", 1,
                        {"'data_offsets' must be two non-negative integers", "[0]"});
  expect_entry_rejected(R"({"dtype": "U8", "shape": [1], "data_offsets": [-1, 0]})", 1, {"[-1,0]"});
  expect_entry_rejected(R"({"dtype": "U8", "shape": [1], "data_offsets": [0, 1.5]})", 1, {"[0,1.5]"});
}

TEST_F(SafetensorsCorrupt, UnknownDtype) {
  expect_entry_rejected(R"({"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 2]})", 2,
                        {"tensor 'w'", "unknown dtype \"Q4_K\"", "accepted:", "BF16", "F8_E4M3", "F4"});
}

TEST_F(SafetensorsCorrupt, ShapeTimesDtypeDiffersFromTheSpan) {
  expect_entry_rejected(R"({"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]})", 20,
                        {"tensor 'w'", "F32", "[2, 3]", "needs 24 bytes", "[0, 20]", "span 20 bytes"});
  // F4 counts elements: [2, 3] is 6 elements = 3 bytes
  expect_entry_rejected(R"({"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 6]})", 6,
                        {"needs 3 bytes", "span 6 bytes"});
}

TEST_F(SafetensorsCorrupt, PackedF4WithAnOddCountRoundsUp) {
  const fs::path path = dir_ / "f4.safetensors";
  write_bytes(path, safetensors_bytes(R"({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}})",
                                      std::string("\x21\x03", 2)));
  const Tensor t = SafetensorsFile::open(path).tensor("w");
  EXPECT_EQ(t.numel(), 3);
  EXPECT_EQ(t.item_f32(0), 0.5f);
  EXPECT_EQ(t.item_f32(1), 1.0f);
  EXPECT_EQ(t.item_f32(2), 1.5f);
}

TEST_F(SafetensorsCorrupt, BadShapes) {
  expect_entry_rejected(R"({"dtype": "U8", "shape": [2, -3], "data_offsets": [0, 0]})", 0,
                        {"tensor 'w'", "dimension 1", "[2,-3]", "negative (-3)"});
  expect_entry_rejected(R"({"dtype": "U8", "shape": [2.5], "data_offsets": [0, 2]})", 2,
                        {"dimension 0", "2.5", "not a non-negative integer"});
  expect_entry_rejected(R"({"dtype": "U8", "shape": ["3"], "data_offsets": [0, 3]})", 3,
                        {"dimension 0", "\"3\"", "not a non-negative integer"});
  expect_entry_rejected(R"({"dtype": "U8", "shape": [9223372036854775808], "data_offsets": [0, 0]})", 0,
                        {"9223372036854775808", "larger than the int64 maximum"});
}

TEST_F(SafetensorsCorrupt, OverflowNear2To64) {
  // element count overflows
  expect_entry_rejected(R"({"dtype": "F32", "shape": [4611686018427387904, 8], "data_offsets": [0, 0]})", 0,
                        {"tensor 'w'", "element count", "overflows 64 bits"});
  // element count fits, byte size does not
  expect_entry_rejected(R"({"dtype": "F32", "shape": [4611686018427387904], "data_offsets": [0, 0]})", 0,
                        {"byte size of 4611686018427387904 elements of F32 overflows 64 bits"});
  // offsets near 2^64 with a matching span: out of bounds, not wrapped around
  expect_entry_rejected(
      R"({"dtype": "U8", "shape": [7], "data_offsets": [18446744073709551608, 18446744073709551615]})", 7,
      {"[18446744073709551608, 18446744073709551615]", "run past the end of the data buffer (7 bytes)"});
  // a zero dimension makes the count 0 even when the others would overflow
  const fs::path path = dir_ / "zero.safetensors";
  write_bytes(
      path,
      safetensors_bytes(
          R"({"w": {"dtype": "F64", "shape": [4611686018427387904, 0, 9], "data_offsets": [0, 0]}})", ""));
  EXPECT_EQ(SafetensorsFile::open(path).tensor("w").numel(), 0);
}

TEST_F(SafetensorsCorrupt, BeginAfterEnd) {
  expect_entry_rejected(R"({"dtype": "U8", "shape": [4], "data_offsets": [8, 4]})", 8,
                        {"tensor 'w'", "data_offsets [8, 4] begin after they end"});
}

TEST_F(SafetensorsCorrupt, OffsetsOutOfBounds) {
  expect_entry_rejected(R"({"dtype": "F32", "shape": [6], "data_offsets": [0, 24]})", 16,
                        {"tensor 'w'", "[0, 24]", "run past the end of the data buffer (16 bytes)"});
}

TEST_F(SafetensorsCorrupt, OverlappingTensors) {
  expect_rejected(safetensors_bytes(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
                                    R"( "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}})",
                                    std::string(12, 'x')),
                  {"tensors 'a' [0, 8] and 'b' [4, 12] overlap"});
  // identical spans
  expect_rejected(safetensors_bytes(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                                    R"( "b": {"dtype": "I8", "shape": [4], "data_offsets": [0, 4]}})",
                                    std::string(4, 'x')),
                  {"'a' [0, 4]", "'b' [0, 4]", "overlap"});
}

TEST_F(SafetensorsCorrupt, TrailingBytesAndGaps) {
  expect_entry_rejected(R"({"dtype": "U8", "shape": [8], "data_offsets": [0, 8]})", 10,
                        {"data buffer is 10 bytes", "tensors end at byte 8", "2 trailing bytes"});
  expect_rejected(safetensors_bytes("{}", "xyz"), {"3 trailing bytes"});
  expect_rejected(safetensors_bytes(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},)"
                                    R"( "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}})",
                                    std::string(12, 'x')),
                  {"bytes [4, 8)", "belong to no tensor", "'b' [8, 12]"});
  expect_entry_rejected(R"({"dtype": "U8", "shape": [4], "data_offsets": [2, 6]})", 6, {"bytes [0, 2)"});
}

TEST_F(SafetensorsCorrupt, ZeroSizedTensorsMaySitAnywhereInBounds) {
  const fs::path path = dir_ / "zero.safetensors";
  write_bytes(path, safetensors_bytes(R"({"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},)"
                                      R"( "e": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]},)"
                                      R"( "f": {"dtype": "F32", "shape": [3, 0], "data_offsets": [8, 8]}})",
                                      std::string(8, 'x')));
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.tensor("e").numel(), 0);
  EXPECT_EQ(file.tensor("f").shape(), (Shape{3, 0}));
  expect_rejected(safetensors_bytes(R"({"e": {"dtype": "F32", "shape": [0], "data_offsets": [9, 9]}})", ""),
                  {"'e'", "[9, 9]", "run past the end of the data buffer (0 bytes)"});
}

TEST_F(SafetensorsCorrupt, Metadata) {
  expect_rejected(safetensors_bytes(R"({"__metadata__": {"format": "pt", "step": 5}})", ""),
                  {"__metadata__ entry 'step' must be a string", "5"});
  expect_rejected(safetensors_bytes(R"({"__metadata__": ["pt"]})", ""), {"__metadata__ must be an object"});
}

TEST_F(SafetensorsCorrupt, MissingFileAndDirectory) {
  EXPECT_THAT(
      error_message([&] { SafetensorsFile::open(dir_ / "absent.safetensors"); }, ErrorCode::kNotFound),
      AllOf(StartsWith((dir_ / "absent.safetensors").string()), HasSubstr("no such file")));
  EXPECT_THAT(error_message([&] { SafetensorsFile::open(dir_.path()); }, ErrorCode::kInvalidFile),
              HasSubstr("not a regular file"));
}

TEST_F(SafetensorsCorrupt, MissingTensorLookup) {
  const fs::path path = dir_ / "ok.safetensors";
  SafetensorsWriter writer;
  writer.add("present", Tensor::zeros(DType::kU8, {1}));
  writer.write(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.find("absent"), nullptr);
  EXPECT_THAT(error_message([&] { file.tensor("absent"); }, ErrorCode::kNotFound),
              AllOf(StartsWith(path.string()), HasSubstr("no tensor named 'absent'")));
}

}  // namespace
}  // namespace moelora::io
