// Internals of the PEFT adapter loader (io/peft.h) shared by its three source files: peft.cpp
// (the loader's passes over the tensor names and load_adapter), peft_modules.cpp (which module of
// the base model a tensor name adapts) and peft_experts.cpp (the routed-expert layouts and the
// canonical A [Ea, R, in] / B [Eb, out, R] assembly). Nothing here is used outside
// src/io/peft*.cpp.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "io/hf_config.h"
#include "io/peft.h"
#include "io/safetensors.h"

namespace moelora::io::peft_detail {

// 2-D targets, in the order of LayerLora's fields (and of LayerLora::named(), whose first
// kNumPlain entries they are).
enum class Plain {
  kQ,
  kK,
  kV,
  kO,
  kQA,
  kQB,
  kKVA,
  kKVB,
  kInProjQkv,
  kInProjZ,
  kInProjB,
  kInProjA,
  kOutProj,
  kMlpGate,
  kMlpUp,
  kMlpDown,
  kSharedGate,
  kSharedUp,
  kSharedDown
};
inline constexpr size_t kNumPlain = 19;

LoraWeights& plain_slot(LayerLora& layer, Plain p);

// How a routed-expert tensor is keyed.
enum class ExpertForm { kNone, kPerExpert, kPeft3dOuter, kPeft3dInner, kStacked };
// Projections of the per-expert and stacked layouts (gate_up: a fused stacked LoRA).
enum class ExpertProj { kGate = 0, kUp = 1, kDown = 2, kGateUp = 3 };
inline constexpr std::array<const char*, 4> kExpertProjNames = {"gate_proj", "up_proj", "down_proj",
                                                         "gate_up_proj"};

struct ModuleRef {
  int64_t layer = -1;
  std::string layer_prefix;  // module path up to and including "layers.<L>."
  ExpertForm form = ExpertForm::kNone;
  Plain plain = Plain::kQ;              // when form == kNone
  int64_t expert = -1;                  // kPerExpert
  ExpertProj proj = ExpertProj::kGate;  // kPerExpert, kStacked
  int64_t in = 0, out = 0;  // expected features (all but PEFT 3-D, which is resolved by shape)
};

struct ModuleEntry {
  ModuleRef ref;
  std::string module;        // path without "base_model.model."
  std::string key_a, key_b;  // tensor names in the file ("" when absent)
};

// Everything a classification error needs to say where it is.
struct Where {
  const std::string& file;
  const std::string& key;
};

[[noreturn]] void another_architecture(const Where& w, const std::string& why);
[[noreturn]] void unsupported_target(const Where& w, const std::string& what);

// "Qwen3-MoE (GQA attention)", "DeepSeek-V3 (MLA, q_lora_rank 1536)", ... for messages.
std::string describe_base(const ModelConfig& base);
// Which part of `base` the module path names (module = key without "base_model.model." and without
// the lora_A/lora_B suffix). Throws for modules the base model does not have or that are not
// supported as LoRA targets (peft_modules.cpp).
ModuleRef classify_module(const std::string& module, const ModelConfig& base, const Where& w);

// One LoRA factor as stored: element (i, j) of the logical [rows, cols] matrix is element
// offset + i * row_stride + j * col_stride of `t` (any float dtype, read through load_as_f32 so
// unaligned mmap'ed data is fine).
struct FactorView {
  Tensor t;
  int64_t offset = 0, row_stride = 0, col_stride = 1;
  int64_t rows = 0, cols = 0;

  // dst[0, cols) = row i * ratio (ratio 1: the stored value converted to fp32, exactly).
  void copy_row(int64_t i, float* dst, double ratio) const {
    const int64_t start = offset + i * row_stride;
    if (t.dtype() == DType::kF32 && col_stride == 1 && ratio == 1.0) {
      std::memcpy(dst, static_cast<const char*>(t.raw_data()) + 4 * start,
                  static_cast<size_t>(cols) * 4);
      return;
    }
    for (int64_t j = 0; j < cols; ++j) {
      const float v =
          load_as_f32(t.raw_data(), t.dtype(), static_cast<uint64_t>(start + j * col_stride));
      dst[j] = ratio == 1.0 ? v : static_cast<float>(static_cast<double>(v) * ratio);
    }
  }
};

// Matrix `index` of a stack of [rows, cols] matrices stored row-major in `t`.
FactorView matrix_view(const Tensor& t, int64_t index, int64_t rows, int64_t cols);

// A block of one canonical target: its rows [out_offset, out_offset + out_rows) of the fused
// output and `rank` columns of R, for every expert.
struct Part {
  std::string label;  // "gate_proj", "up_proj", ... for messages
  int64_t out_offset = 0, out_rows = 0;
  std::vector<FactorView> a, b;  // one (shared by all experts) or one per expert
  std::vector<double> scaling;   // per expert (one entry for plain targets)
  int64_t rank = 0;              // the largest rank of any expert

  bool uniform_scaling() const {
    return std::all_of(scaling.begin(), scaling.end(), [&](double s) { return s == scaling[0]; });
  }
};

// Writes the canonical A [Ea, R, in], B [Eb, out, R] of a target made of `parts` (blocks on the
// diagonal: part p takes rows [out_offset, +out_rows) and its own columns of R).
LoraWeights assemble(const std::vector<Part>& parts, int64_t num_experts, int64_t out_total, int64_t in);

// Per-layer collection of the routed-expert tensors.
struct LayerExperts {
  std::set<ExpertForm> forms;
  const ModuleEntry* peft3d_outer = nullptr;
  const ModuleEntry* peft3d_inner = nullptr;
  std::array<std::vector<const ModuleEntry*>, 3> per_expert;  // gate, up, down; one slot per expert
  std::array<const ModuleEntry*, 4> stacked{};                // gate, up, down, gate_up
  std::string layer_prefix;
};

// The layout's name for messages.
const char* form_name(ExpertForm form);

// One load_adapter call. The passes over the tensor names and the plain targets are in peft.cpp,
// the routed-expert layouts in peft_experts.cpp.
class AdapterLoader {
 public:
  AdapterLoader(const std::filesystem::path& dir, const ModelConfig& base, const std::string& name,
                const AdapterLoadOptions& options)
      : dir_(dir), base_(base), name_(name), options_(options) {}

  LoraAdapter load();

 private:
  void collect();
  void check_pairs_and_dtypes();
  void check_targeted(const ModuleEntry& entry) const;
  LoraWeights load_plain(const ModuleEntry& entry);
  void load_experts(int64_t layer, LayerExperts& experts, LayerLora& out);
  std::vector<Part> per_expert_parts(int64_t layer, LayerExperts& experts, bool gate_up);
  std::vector<Part> peft3d_parts(int64_t layer, LayerExperts& experts, bool gate_up);
  std::vector<Part> stacked_parts(int64_t layer, LayerExperts& experts, bool gate_up);
  void check_max_rank(const LoraWeights& w, int64_t layer, const std::string& target,
                      const std::string& detail) const;

  // Validations shared by the layouts; `module` is the module path for messages.
  void check_ndim(const Tensor& t, int ndim, const std::string& factor, const std::string& module,
                  const char* layout) const;
  void check_rank_vs_config(int64_t rank, const std::string& path, const std::string& module,
                            const std::string& how) const;
  void check_feature(const Tensor& t, int dim, int64_t expected, const std::string& factor,
                     const std::string& module, const char* feature) const;

  const std::filesystem::path dir_;
  const ModelConfig& base_;
  const std::string name_;
  const AdapterLoadOptions options_;
  AdapterConfig config_;
  SafetensorsStore store_;
  std::string file_;  // the safetensors file (or index), for messages
  std::string config_file_;
  std::map<std::string, ModuleEntry> modules_;  // by module path
  int64_t num_tensors_ = 0;
  std::vector<std::array<const ModuleEntry*, kNumPlain>> plain_;  // per layer
  std::vector<LayerExperts> experts_;                             // per layer
};

}  // namespace moelora::io::peft_detail
