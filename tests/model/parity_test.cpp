// Parity of the CPU model with Hugging Face transformers + PEFT (fp32) on the committed fixtures
// of tests/data/parity (tests/data/README.md): logits for every prompt position, hidden states,
// routing, greedy continuations through the KV cache (and Qwen3.5's linear-attention state), a
// mixed-adapter batch, and for Qwen3.5 prompts prefilled in chunks.
//
// Tolerances (PERF.md and tests/data/README.md §2.4): logits and hidden states within
// min(1e-3, 1e-4 * max(1, max |ref|)); routing ids equal as sets per token (DeepSeek's slot order
// is unspecified), routing weights within 1e-5 after sorting by expert id; greedy tokens exact;
// the mixed batch within 1e-5 of the per-sequence runs. Every case prints its max abs difference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "model/sampler.h"
#include "support/test_support.h"

namespace moelora::model {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kGreedyTokens = 16;

fs::path parity_dir(const std::string& name) {
  return test::data_dir() / "parity" / name;
}

// Largest |ref| of a tensor, for the relative part of the tolerance.
double max_abs(const Tensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i)
    m = std::max(m, std::fabs(static_cast<double>(t.item_f32(i))));
  return m;
}

double tolerance_for(const Tensor& reference) {
  return std::min(1e-3, 1e-4 * std::max(1.0, max_abs(reference)));
}

void report(const std::string& what, double diff, double tol) {
  std::printf("[parity] %-48s max abs diff %.3e (tolerance %.1e)\n", what.c_str(), diff, tol);
  ::testing::Test::RecordProperty(what, std::to_string(diff));
}

// Reference tensors of one fixture directory.
class Reference {
 public:
  explicit Reference(const fs::path& file) : file_(io::SafetensorsFile::open(file)) {}
  bool has(const std::string& name) const { return file_.contains(name); }
  Tensor f32(const std::string& name) const { return file_.tensor(name).to_f32(); }
  Tensor i32(const std::string& name) const { return file_.tensor(name).clone(); }
  // Row b of an I32 [B, N] tensor.
  std::vector<int32_t> row(const std::string& name, int64_t b) const {
    const Tensor t = i32(name);
    const int32_t* p = t.data<int32_t>() + b * t.dim(1);
    return std::vector<int32_t>(p, p + t.dim(1));
  }
  int64_t rows(const std::string& name) const { return file_.tensor(name).dim(0); }

 private:
  io::SafetensorsFile file_;
};

class ParityCase {
 public:
  ParityCase(const std::string& fixture, const std::string& checkpoint,
             const std::vector<std::string>& adapters)
      : fixture_(fixture), ref_(parity_dir(fixture) / "reference.safetensors") {
    ModelOptions options;
    options.show_progress = false;
    model_ = std::make_unique<Model>(Model::load(parity_dir(fixture) / checkpoint, options));
    for (const std::string& name : adapters) model_->load_adapter(name, parity_dir(fixture) / name);
  }

  Model& model() { return *model_; }
  const Reference& ref() const { return ref_; }
  int64_t batch() const { return ref_.rows("input_ids"); }
  std::vector<int32_t> prompt(int64_t b) const { return ref_.row("input_ids", b); }
  int32_t slot(const std::string& adapter) const {
    return adapter == "base" ? -1 : model_->adapters().slot_of(adapter);
  }

  // Logits of every prompt row, one sequence at a time (full prompt, no cache reuse).
  void check_logits(const std::string& adapter, const std::string& label) {
    const Tensor expected = ref_.f32("logits." + adapter);  // [B, T, V]
    const double tol = tolerance_for(expected);
    double worst = 0;
    for (int64_t b = 0; b < batch(); ++b) {
      Sequence seq = model_->new_sequence(slot(adapter));
      const std::vector<int32_t> ids = prompt(b);
      const Tensor logits = model_->forward(seq, ids);
      const Tensor want = expected.select0(b);
      ASSERT_EQ(logits.shape(), want.shape());
      worst = std::max(worst, test::max_abs_diff(logits, want));
      EXPECT_TRUE(test::all_close(logits, want, static_cast<float>(tol), 0.0f))
          << label << " row " << b;
    }
    report(label + " logits", worst, tol);
  }

  // Hidden states and routing of the base model, both rows in one batch. Routing weights within
  // `weight_tol` (absolute; they lie in [0, 1]).
  void check_hidden_and_routing(const std::string& label, double weight_tol = 1e-5) {
    std::vector<Sequence> seqs;
    std::vector<std::vector<int32_t>> ids;
    for (int64_t b = 0; b < batch(); ++b) {
      seqs.push_back(model_->new_sequence(-1));
      ids.push_back(prompt(b));
    }
    std::vector<SequenceInput> inputs;
    for (int64_t b = 0; b < batch(); ++b) inputs.push_back({&seqs[b], ids[b]});
    ForwardTrace trace;
    ForwardOptions options;
    options.trace = &trace;
    model_->forward(inputs, options);

    const int64_t layers = model_->num_layers();
    ASSERT_EQ(static_cast<int64_t>(trace.hidden.size()), layers + 1);
    for (int64_t i = 0; i <= layers; ++i) {
      const std::string name = "hidden.base." + std::to_string(i);
      if (!ref_.has(name)) continue;
      const Tensor expected = ref_.f32(name);
      const Tensor want = expected.reshape({expected.dim(0) * expected.dim(1), expected.dim(2)});
      const double tol = tolerance_for(want);
      ASSERT_EQ(trace.hidden[i].shape(), want.shape()) << name;
      const double diff = test::max_abs_diff(trace.hidden[i], want);
      report(label + " " + name, diff, tol);
      EXPECT_TRUE(test::all_close(trace.hidden[i], want, static_cast<float>(tol), 0.0f))
          << label << " " << name;
    }

    int checked = 0;
    for (const auto& [layer, route] : trace.routes) {
      const std::string suffix = "layer" + std::to_string(layer);
      ASSERT_TRUE(ref_.has("route_idx." + suffix)) << "no reference routing for MoE " << suffix;
      const Tensor ids_ref = ref_.i32("route_idx." + suffix);
      const Tensor w_ref = ref_.f32("route_w." + suffix);
      ASSERT_EQ(route.ids.shape(), ids_ref.shape()) << suffix;
      const int64_t tokens = ids_ref.dim(0), k = ids_ref.dim(1);
      double w_diff = 0;
      for (int64_t t = 0; t < tokens; ++t) {
        // (expert, weight) pairs sorted by expert id on both sides.
        std::vector<std::pair<int32_t, float>> got, want;
        for (int64_t j = 0; j < k; ++j) {
          got.emplace_back(route.ids.data<int32_t>()[t * k + j],
                           route.weights.data<float>()[t * k + j]);
          want.emplace_back(ids_ref.data<int32_t>()[t * k + j], w_ref.data<float>()[t * k + j]);
        }
        std::sort(got.begin(), got.end());
        std::sort(want.begin(), want.end());
        for (int64_t j = 0; j < k; ++j) {
          EXPECT_EQ(got[j].first, want[j].first) << label << " " << suffix << " token " << t;
          w_diff = std::max(w_diff, static_cast<double>(std::fabs(got[j].second - want[j].second)));
        }
      }
      report(label + " route_w." + suffix, w_diff, weight_tol);
      EXPECT_LE(w_diff, weight_tol) << label << " " << suffix;
      ++checked;
    }
    EXPECT_GT(checked, 0) << "the model has no MoE layer";
  }

  // Greedy continuation through the cache: prefill the prompt, then one token per step.
  void check_greedy(const std::string& adapter, const std::string& label) {
    for (int64_t b = 0; b < batch(); ++b) {
      const std::vector<int32_t> expected = ref_.row("greedy." + adapter, b);
      const int64_t prompt_tokens = static_cast<int64_t>(prompt(b).size());
      ASSERT_EQ(static_cast<int64_t>(expected.size()), prompt_tokens + kGreedyTokens);
      Sequence seq = model_->new_sequence(slot(adapter));
      std::vector<int32_t> generated;
      ForwardOptions last_only;
      last_only.all_logits = false;
      Tensor logits = model_->forward(seq, prompt(b), last_only);
      for (int64_t i = 0; i < kGreedyTokens; ++i) {
        const int32_t token = argmax(std::span<const float>(logits.data<float>(), logits.numel()));
        generated.push_back(token);
        if (i + 1 < kGreedyTokens)
          logits = model_->forward(seq, std::span<const int32_t>(&token, 1), last_only);
      }
      const std::vector<int32_t> want(expected.begin() + prompt_tokens, expected.end());
      EXPECT_EQ(generated, want) << label << " greedy row " << b;
    }
    std::printf("[parity] %-48s greedy %lld x %lld tokens checked\n", (label).c_str(),
                static_cast<long long>(batch()), static_cast<long long>(kGreedyTokens));
  }

  // One batch: row 0 with adapter a, row 1 with adapter b, row 0 base-only. Each sequence's logits
  // must equal its own single-sequence run (<= 1e-5) and the reference.
  void check_mixed_batch(const std::string& a, const std::string& b, const std::string& label) {
    struct Item {
      std::string adapter;
      int64_t row;
    };
    const std::vector<Item> items = {{a, 0}, {b, 1}, {"base", 0}};
    std::vector<Sequence> seqs;
    std::vector<std::vector<int32_t>> ids;
    for (const Item& item : items) {
      seqs.push_back(model_->new_sequence(slot(item.adapter)));
      ids.push_back(prompt(item.row));
    }
    std::vector<SequenceInput> inputs;
    for (size_t i = 0; i < items.size(); ++i) inputs.push_back({&seqs[i], ids[i]});
    const std::vector<Tensor> batched = model_->forward(inputs);
    ASSERT_EQ(batched.size(), items.size());
    double vs_single = 0, vs_ref = 0, tol_ref = 1e-3;
    for (size_t i = 0; i < items.size(); ++i) {
      Sequence alone = model_->new_sequence(slot(items[i].adapter));
      const Tensor single = model_->forward(alone, ids[i]);
      vs_single = std::max(vs_single, test::max_abs_diff(batched[i], single));
      EXPECT_TRUE(test::all_close(batched[i], single, 1e-5f, 0.0f)) << label << " sequence " << i;
      const Tensor expected = ref_.f32("logits." + items[i].adapter).select0(items[i].row);
      tol_ref = std::min(tol_ref, tolerance_for(expected));
      vs_ref = std::max(vs_ref, test::max_abs_diff(batched[i], expected));
      EXPECT_TRUE(
          test::all_close(batched[i], expected, static_cast<float>(tolerance_for(expected)), 0.0f))
          << label << " sequence " << i;
    }
    report(label + " mixed batch vs single runs", vs_single, 1e-5);
    report(label + " mixed batch vs reference", vs_ref, tol_ref);

    // Decode a few steps together, again mixed, and compare with separate decoding.
    std::vector<Sequence> alone;
    for (size_t i = 0; i < items.size(); ++i) {
      alone.push_back(model_->new_sequence(slot(items[i].adapter)));
      model_->forward(alone.back(), ids[i]);
    }
    double decode_diff = 0;
    std::vector<int32_t> next(items.size());
    for (size_t i = 0; i < items.size(); ++i) {
      const Tensor& l = batched[i];
      next[i] =
          argmax(std::span<const float>(l.data<float>() + (l.dim(0) - 1) * l.dim(1), l.dim(1)));
    }
    for (int step = 0; step < 4; ++step) {
      std::vector<SequenceInput> step_inputs;
      for (size_t i = 0; i < items.size(); ++i)
        step_inputs.push_back({&seqs[i], std::span<const int32_t>(&next[i], 1)});
      const std::vector<Tensor> together = model_->forward(step_inputs);
      for (size_t i = 0; i < items.size(); ++i) {
        const Tensor separate = model_->forward(alone[i], std::span<const int32_t>(&next[i], 1));
        decode_diff = std::max(decode_diff, test::max_abs_diff(together[i], separate));
        next[i] = argmax(std::span<const float>(together[i].data<float>(), together[i].numel()));
      }
    }
    report(label + " mixed batch decode vs single", decode_diff, 1e-5);
    EXPECT_LE(decode_diff, 1e-5);
  }

  // The prompt fed in chunks of the given sizes (cycled) into one sequence: every chunk's logits
  // equal the reference rows of those positions, i.e. the caches (KV and linear-attention state)
  // carry everything a one-call prefill sees.
  void check_chunked_prefill(const std::string& adapter, const std::vector<int64_t>& chunks,
                             const std::string& label) {
    const Tensor expected = ref_.f32("logits." + adapter);  // [B, T, V]
    const double tol = tolerance_for(expected);
    double worst = 0;
    for (int64_t b = 0; b < batch(); ++b) {
      Sequence seq = model_->new_sequence(slot(adapter));
      const std::vector<int32_t> ids = prompt(b);
      const int64_t total = static_cast<int64_t>(ids.size());
      size_t next_chunk = 0;
      for (int64_t begin = 0; begin < total;) {
        const int64_t end = std::min(total, begin + chunks[next_chunk++ % chunks.size()]);
        const Tensor logits = model_->forward(
            seq, std::span<const int32_t>(ids.data() + begin, static_cast<size_t>(end - begin)));
        const Tensor want = expected.select0(b).slice0(begin, end);
        worst = std::max(worst, test::max_abs_diff(logits, want));
        EXPECT_TRUE(test::all_close(logits, want, static_cast<float>(tol), 0.0f))
            << label << " row " << b << " positions [" << begin << ", " << end << ")";
        begin = end;
      }
      EXPECT_EQ(seq.length(), total);
    }
    report(label + " chunked prefill logits", worst, tol);
  }

  // The model's fp32 copy of a quantized weight equals the fixture's exact dequantization.
  void check_dequant(const std::string& tensor_name, const Tensor& actual) {
    const Tensor expected = ref_.f32("dequant." + tensor_name);
    ASSERT_EQ(actual.shape(), expected.shape()) << tensor_name;
    const double diff = test::max_abs_diff(actual, expected);
    report("dequant " + tensor_name, diff, 0.0);
    EXPECT_EQ(diff, 0.0) << tensor_name;
  }

 private:
  std::string fixture_;
  Reference ref_;
  std::unique_ptr<Model> model_;
};

// Rows [begin, end) of expert e's slice of a stacked [E, R, C] tensor as a [end - begin, C] copy.
Tensor expert_rows(const Tensor& stacked, int64_t e, int64_t begin, int64_t end) {
  return stacked.select0(e).slice0(begin, end).clone();
}

const std::vector<std::string> kQwenAdapters = {"lora_peft3d", "lora_per_expert",
                                                "lora_shared_outer"};
const std::vector<std::string> kDeepseekAdapters = {"lora_peft3d", "lora_dense_shared",
                                                    "lora_per_expert"};

// ---------------------------------------------------------------- Qwen3-MoE

class Qwen3MoeCheckpoint : public ::testing::TestWithParam<std::string> {};

TEST_P(Qwen3MoeCheckpoint, BaseLogitsHiddenRoutingGreedy) {
  ParityCase c("qwen3_moe", GetParam(), {});
  const std::string label = "qwen3_moe/" + GetParam();
  c.check_logits("base", label);
  c.check_hidden_and_routing(label);
  c.check_greedy("base", label);
}

INSTANTIATE_TEST_SUITE_P(Parity, Qwen3MoeCheckpoint,
                         ::testing::Values("base", "base_fused", "base_sharded"));

TEST(Qwen3MoeParity, Adapters) {
  ParityCase c("qwen3_moe", "base", kQwenAdapters);
  for (const std::string& adapter : kQwenAdapters) {
    SCOPED_TRACE(adapter);
    c.check_logits(adapter, "qwen3_moe/" + adapter);
    c.check_greedy(adapter, "qwen3_moe/" + adapter);
  }
}

TEST(Qwen3MoeParity, MixedAdapterBatch) {
  ParityCase c("qwen3_moe", "base", kQwenAdapters);
  c.check_mixed_batch("lora_peft3d", "lora_per_expert", "qwen3_moe peft3d+per_expert+base");
  c.check_mixed_batch("lora_shared_outer", "lora_peft3d", "qwen3_moe shared_outer+peft3d+base");
}

// ---------------------------------------------------------------- Qwen3.5-MoE
// 5 layers: Gated DeltaNet x 3, gated full attention, Gated DeltaNet; 72-token prompts (past the
// 64-token chunk of transformers' chunked delta rule); greedy decoding through the
// linear-attention state (transformers' recurrent step) and the KV cache.

const std::vector<std::string> kQwen35Adapters = {"lora_all", "lora_linear"};

class Qwen35MoeCheckpoint : public ::testing::TestWithParam<std::string> {};

TEST_P(Qwen35MoeCheckpoint, BaseLogitsHiddenRoutingGreedy) {
  ParityCase c("qwen3_5_moe", GetParam(), {});
  const std::string label = "qwen3_5_moe/" + GetParam();
  const io::ModelConfig& config = c.model().config();
  ASSERT_EQ(config.arch, io::Architecture::kQwen35Moe);
  ASSERT_EQ(c.model().num_layers(), 5);
  for (int64_t l = 0; l < 5; ++l)
    EXPECT_EQ(c.model().weights().layers[l].is_linear_attention, l != 3) << "layer " << l;
  c.check_logits("base", label);
  // 144 tokens through four Gated DeltaNet layers, each a different fp32 summation order from
  // transformers' chunked form: the last router's inputs differ by ~1e-5 (hidden.base.4 above),
  // so its weights get 3e-5 instead of 1e-5.
  c.check_hidden_and_routing(label, 3e-5);
  c.check_greedy("base", label);
}

// base: the text model as transformers saves it (per-expert keys under model.); base_vlm: the
// published form (Qwen3_5MoeForConditionalGeneration, decoder under model.language_model., fused
// experts, a vision tower that is ignored).
INSTANTIATE_TEST_SUITE_P(Parity, Qwen35MoeCheckpoint, ::testing::Values("base", "base_vlm"));

// The published VLM checkpoint read through a text-only config (qwen3_5_moe_text, as
// Qwen3_5MoeForCausalLM reads it): the decoder prefix is found, the vision tower is skipped and
// listed as ignored, and the logits are the text model's.
TEST(Qwen35MoeParity, VlmCheckpointUnderATextConfig) {
  const fs::path src = parity_dir("qwen3_5_moe") / "base_vlm";
  const test::TempDir tmp;
  const fs::path dir = tmp.path();
  for (const auto& entry : fs::directory_iterator(src))
    fs::copy(entry.path(), dir / entry.path().filename());
  nlohmann::json vlm = nlohmann::json::parse(std::ifstream(src / "config.json"));
  nlohmann::json text = vlm["text_config"];
  text["model_type"] = "qwen3_5_moe_text";
  text["architectures"] = {"Qwen3_5MoeForCausalLM"};
  test::write_text_file(dir / "config.json", text.dump(2));

  io::LoadOptions load;
  load.show_progress = false;
  const io::ModelWeights weights = io::load_checkpoint(dir, load);
  EXPECT_EQ(weights.weight_prefix, "model.language_model.");
  const auto visual =
      std::count_if(weights.ignored_tensors.begin(), weights.ignored_tensors.end(),
                    [](const std::string& n) { return n.rfind("model.visual.", 0) == 0; });
  EXPECT_GT(visual, 0) << "the vision tower is not listed as ignored";
  ModelOptions options;
  options.show_progress = false;
  Model model(weights, options);
  const Reference ref(parity_dir("qwen3_5_moe") / "reference.safetensors");
  const std::vector<int32_t> ids = ref.row("input_ids", 1);
  Sequence seq = model.new_sequence(-1);
  const Tensor logits = model.forward(seq, ids);
  const Tensor want = ref.f32("logits.base").select0(1);
  const double tol = tolerance_for(want);
  report("qwen3_5_moe/base_vlm as text logits", test::max_abs_diff(logits, want), tol);
  EXPECT_TRUE(test::all_close(logits, want, static_cast<float>(tol), 0.0f));
}

TEST(Qwen35MoeParity, Adapters) {
  ParityCase c("qwen3_5_moe", "base", kQwen35Adapters);
  for (const std::string& adapter : kQwen35Adapters) {
    SCOPED_TRACE(adapter);
    c.check_logits(adapter, "qwen3_5_moe/" + adapter);
    c.check_greedy(adapter, "qwen3_5_moe/" + adapter);
  }
}

TEST(Qwen35MoeParity, MixedAdapterBatch) {
  ParityCase c("qwen3_5_moe", "base", kQwen35Adapters);
  c.check_mixed_batch("lora_all", "lora_linear", "qwen3_5_moe all+linear+base");
  c.check_mixed_batch("lora_linear", "lora_all", "qwen3_5_moe linear+all+base");
}

TEST(Qwen35MoeParity, ChunkedPrefillCarriesTheLinearAttentionState) {
  ParityCase c("qwen3_5_moe", "base", kQwen35Adapters);
  c.check_chunked_prefill("base", {1, 7, 30}, "qwen3_5_moe/base 1+7+30");
  c.check_chunked_prefill("base", {64}, "qwen3_5_moe/base 64");
  c.check_chunked_prefill("lora_all", {5, 40}, "qwen3_5_moe/lora_all 5+40");
}

// A sequence's linear-attention state has no per-token history: truncation goes back to 0 tokens
// (then the prompt runs again to the same logits) or nowhere; a forward pass that fails after
// some layers changed their state leaves the sequence as it was.
TEST(Qwen35MoeParity, StateTruncationAndFailedPassRollback) {
  ParityCase c("qwen3_5_moe", "base", {});
  Model& model = c.model();
  const std::vector<int32_t> ids = c.prompt(0);
  const std::span<const int32_t> head(ids.data(), 40), tail(ids.data() + 40, ids.size() - 40);
  const Tensor want_tail = c.ref().f32("logits.base").select0(0).slice0(40, ids.size());
  const double tol = tolerance_for(want_tail);

  Sequence seq = model.new_sequence(-1);
  model.forward(seq, head);
  EXPECT_GT(seq.cache_bytes(), 0u);
  try {
    seq.truncate(20);
    ADD_FAILURE() << "truncating a linear-attention state to 20 of 40 tokens did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("truncate to 0"), std::string::npos) << e.what();
  }
  EXPECT_EQ(seq.length(), 40);
  seq.truncate(40);  // no-op

  // A pass that throws in layer 3's MoE (a forced routing of the wrong shape), after the three
  // Gated DeltaNet layers before it advanced their states.
  std::map<int64_t, Tensor> bad_routes;
  bad_routes[3] = Tensor::zeros(DType::kI32, {1, 1});
  ForwardOptions failing;
  failing.forced_routes = &bad_routes;
  EXPECT_THROW(model.forward(seq, tail, failing), Error);
  EXPECT_EQ(seq.length(), 40);
  const Tensor after_failure = model.forward(seq, tail);
  EXPECT_TRUE(test::all_close(after_failure, want_tail, static_cast<float>(tol), 0.0f));
  report("qwen3_5_moe/base after a failed pass", test::max_abs_diff(after_failure, want_tail), tol);

  // Back to 0 tokens: a fresh state, the same logits again.
  seq.truncate(0);
  EXPECT_EQ(seq.length(), 0);
  model.forward(seq, head);
  const Tensor again = model.forward(seq, tail);
  EXPECT_EQ(test::max_abs_diff(again, after_failure), 0.0);
}

// ---------------------------------------------------------------- DeepSeek-V3

TEST(DeepseekV3Parity, BaseLogitsHiddenRoutingGreedy) {
  ParityCase c("deepseek_v3", "base", {});
  c.check_logits("base", "deepseek_v3/base");
  c.check_hidden_and_routing("deepseek_v3/base");
  c.check_greedy("base", "deepseek_v3/base");
}

TEST(DeepseekV3Parity, Adapters) {
  ParityCase c("deepseek_v3", "base", kDeepseekAdapters);
  for (const std::string& adapter : kDeepseekAdapters) {
    SCOPED_TRACE(adapter);
    c.check_logits(adapter, "deepseek_v3/" + adapter);
    c.check_greedy(adapter, "deepseek_v3/" + adapter);
  }
}

TEST(DeepseekV3Parity, MixedAdapterBatch) {
  ParityCase c("deepseek_v3", "base", kDeepseekAdapters);
  c.check_mixed_batch("lora_peft3d", "lora_dense_shared", "deepseek_v3 peft3d+dense_shared+base");
  c.check_mixed_batch("lora_per_expert", "lora_peft3d", "deepseek_v3 per_expert+peft3d+base");
}

// ---------------------------------------------------------------- Kimi-like (no q_lora_rank)

TEST(KimiLikeParity, BaseAndAdapter) {
  ParityCase c("kimi_like", "base", {"lora_peft3d"});
  c.check_logits("base", "kimi_like/base");
  c.check_hidden_and_routing("kimi_like/base");
  c.check_greedy("base", "kimi_like/base");
  c.check_logits("lora_peft3d", "kimi_like/lora_peft3d");
  c.check_greedy("lora_peft3d", "kimi_like/lora_peft3d");
  c.check_mixed_batch("lora_peft3d", "base", "kimi_like peft3d+base+base");
}

// ---------------------------------------------------------------- quantized checkpoints

TEST(Fp8Parity, DeepseekV3BlockFp8) {
  ParityCase c("fp8", "deepseek_v3_fp8", {});
  const LayerWeightsF32& layer1 = c.model().weights().layers[1];
  c.check_dequant("model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                  layer1.attention.kv_a_proj_with_mqa);
  c.check_dequant("model.layers.1.self_attn.kv_b_proj.weight", layer1.attention.kv_b_proj);
  c.check_dequant("model.layers.1.self_attn.q_b_proj.weight", layer1.attention.q_b_proj);
  const int64_t inter = layer1.moe.w13.dim(1) / 2;
  c.check_dequant("model.layers.1.mlp.experts.3.up_proj.weight",
                  expert_rows(layer1.moe.w13, 3, inter, 2 * inter));
  c.check_logits("base", "fp8/deepseek_v3_fp8");
  c.check_hidden_and_routing("fp8/deepseek_v3_fp8");
  c.check_greedy("base", "fp8/deepseek_v3_fp8");
}

TEST(Nvfp4Parity, Qwen3MoeNvfp4) {
  ParityCase c("nvfp4", "qwen3_moe_nvfp4", {});
  const ModelWeightsF32& w = c.model().weights();
  const int64_t inter = w.layers[0].moe.w13.dim(1) / 2;
  c.check_dequant("model.layers.0.mlp.experts.0.gate_proj.weight",
                  expert_rows(w.layers[0].moe.w13, 0, 0, inter));
  c.check_dequant("model.layers.0.self_attn.k_proj.weight", w.layers[0].attention.k_proj);
  c.check_dequant("model.layers.1.mlp.experts.2.down_proj.weight",
                  expert_rows(w.layers[1].moe.w2, 2, 0, w.layers[1].moe.w2.dim(1)));
  c.check_logits("base", "nvfp4/qwen3_moe_nvfp4");
  c.check_hidden_and_routing("nvfp4/qwen3_moe_nvfp4");
  c.check_greedy("base", "nvfp4/qwen3_moe_nvfp4");
}

}  // namespace
}  // namespace moelora::model
