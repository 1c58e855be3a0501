// fp32 conversion of a loaded checkpoint (see weights.h). The work is a flat list of jobs, one
// per tensor (one per expert for the stacked expert weights), run with parallel_for in chunks so
// the progress bar can advance from the calling thread.
#include "model/weights.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>
#include <string>

#include "core/progress.h"
#include "core/threads.h"
#include "ops/quant/quant.h"

namespace moelora::model {

namespace {

std::string weight_label(const io::LinearWeight& w) {
  return w.name.empty() ? std::string("linear weight") : "weight '" + w.name + "'";
}

// A tensor of any float dtype (norm weights, router, embeddings) as an fp32 copy.
Tensor to_f32(const Tensor& t) {
  return t.defined() ? t.to_f32() : Tensor();
}

// Copies `src` (F32 [rows, cols]) into rows [row0, row0 + rows) of `dst` (F32 [.., cols]).
void copy_rows(const Tensor& src, Tensor& dst, int64_t row0) {
  const int64_t cols = dst.dim(-1);
  MOELORA_ASSERT(src.dim(-1) == cols && (row0 + src.dim(0)) * cols <= dst.numel());
  std::memcpy(dst.data<float>() + row0 * cols, src.data<float>(), src.nbytes());
}

}  // namespace

Tensor dequantize_linear(const io::LinearWeight& w) {
  MOELORA_CHECK(w.defined(), ErrorCode::kInvalidArgument, weight_label(w), " is not loaded");
  Tensor out;
  switch (w.format) {
    case io::WeightFormat::kDense: out = w.weight.to_f32(); break;
    case io::WeightFormat::kFp8Block:
      MOELORA_CHECK(w.scale.defined(), ErrorCode::kInvalidArgument, weight_label(w),
                    ": FP8 block weight without weight_scale_inv");
      out = ops::dequant_fp8_block_ref(w.weight, w.scale, w.block_n, w.block_k);
      break;
    case io::WeightFormat::kNvfp4:
      MOELORA_CHECK(w.scale.defined(), ErrorCode::kInvalidArgument, weight_label(w),
                    ": NVFP4 weight without weight_scale");
      out = ops::dequant_nvfp4_ref(w.weight, w.scale, w.scale_2);
      break;
  }
  check_shape(out, {w.out_features, w.in_features},
              weight_label(w) + " (dequantized " + io::weight_format_name(w.format) + ")");
  return out;
}

ModelWeightsF32 convert_weights(const io::ModelWeights& weights, bool show_progress) {
  ModelWeightsF32 out;
  std::vector<std::function<void()>> jobs;
  auto linear = [&jobs](const io::LinearWeight& src, Tensor& dst) {
    if (!src.defined()) return;
    jobs.push_back([&src, &dst] { dst = dequantize_linear(src); });
  };
  auto plain = [&jobs](const Tensor& src, Tensor& dst) {
    if (!src.defined()) return;
    jobs.push_back([&src, &dst] { dst = to_f32(src); });
  };

  plain(weights.embed_tokens, out.embed_tokens);
  plain(weights.final_norm, out.final_norm);
  linear(weights.lm_head, out.lm_head);
  out.layers.resize(weights.layers.size());
  for (size_t l = 0; l < weights.layers.size(); ++l) {
    const io::LayerWeights& src = weights.layers[l];
    LayerWeightsF32& dst = out.layers[l];
    plain(src.input_layernorm, dst.input_layernorm);
    plain(src.post_attention_layernorm, dst.post_attention_layernorm);
    AttentionWeightsF32& a = dst.attention;
    linear(src.q_proj, a.q_proj);
    linear(src.k_proj, a.k_proj);
    linear(src.v_proj, a.v_proj);
    linear(src.o_proj, a.o_proj);
    plain(src.q_norm, a.q_norm);
    plain(src.k_norm, a.k_norm);
    linear(src.q_a_proj, a.q_a_proj);
    linear(src.q_b_proj, a.q_b_proj);
    linear(src.kv_a_proj_with_mqa, a.kv_a_proj_with_mqa);
    linear(src.kv_b_proj, a.kv_b_proj);
    plain(src.q_a_layernorm, a.q_a_layernorm);
    plain(src.kv_a_layernorm, a.kv_a_layernorm);
    dst.is_linear_attention = src.is_linear_attention;
    if (src.is_linear_attention) {
      const io::LinearAttentionWeights& g = src.linear_attn;
      LinearAttentionWeightsF32& d = dst.linear_attn;
      linear(g.in_proj_qkv, d.in_proj_qkv);
      linear(g.in_proj_z, d.in_proj_z);
      linear(g.in_proj_b, d.in_proj_b);
      linear(g.in_proj_a, d.in_proj_a);
      linear(g.out_proj, d.out_proj);
      plain(g.a_log, d.a_log);
      plain(g.dt_bias, d.dt_bias);
      plain(g.norm, d.norm);
      if (g.conv1d.defined()) {
        jobs.push_back([&g, &d] {
          // [conv_dim, 1, K] on disk -> [conv_dim, K]
          const Tensor c = to_f32(g.conv1d);
          d.conv1d = c.ndim() == 3 ? c.reshape({c.dim(0), c.dim(2)}) : c;
        });
      }
    }

    dst.is_moe = src.is_moe;
    if (!src.is_moe) {
      linear(src.mlp.gate, dst.mlp_gate);
      linear(src.mlp.up, dst.mlp_up);
      linear(src.mlp.down, dst.mlp_down);
      continue;
    }
    ops::MoeWeightsRef& moe = dst.moe;
    plain(src.router, moe.router);
    plain(src.e_score_correction_bias, moe.correction_bias);
    plain(src.shared_expert_gate, moe.shared_gate);
    const io::ExpertWeights& experts = src.experts;
    const int64_t num_experts = experts.num_experts;
    MOELORA_CHECK(num_experts > 0 && static_cast<int64_t>(experts.gate.size()) == num_experts &&
                      static_cast<int64_t>(experts.up.size()) == num_experts &&
                      static_cast<int64_t>(experts.down.size()) == num_experts,
                  ErrorCode::kInvalidArgument, "layer ", l, ": the checkpoint holds ", experts.gate.size(),
                  " gate, ", experts.up.size(), " up and ", experts.down.size(), " down weights for ",
                  num_experts, " experts");
    const int64_t inter = experts.gate[0].out_features, hidden = experts.gate[0].in_features;
    moe.w13 = Tensor::empty(DType::kF32, {num_experts, 2 * inter, hidden});
    moe.w2 = Tensor::empty(DType::kF32, {num_experts, hidden, inter});
    for (int64_t e = 0; e < num_experts; ++e) {
      jobs.push_back([&experts, &moe, e, inter, hidden] {
        Tensor gate = dequantize_linear(experts.gate[e]);
        Tensor up = dequantize_linear(experts.up[e]);
        Tensor down = dequantize_linear(experts.down[e]);
        check_shape(gate, {inter, hidden}, weight_label(experts.gate[e]));
        check_shape(up, {inter, hidden}, weight_label(experts.up[e]));
        check_shape(down, {hidden, inter}, weight_label(experts.down[e]));
        copy_rows(gate, moe.w13, e * 2 * inter);
        copy_rows(up, moe.w13, e * 2 * inter + inter);
        copy_rows(down, moe.w2, e * hidden);
      });
    }
    if (src.shared_expert.defined()) {
      const io::MlpWeights& shared = src.shared_expert;
      const int64_t shared_inter = shared.gate.out_features;
      moe.shared_w13 = Tensor::empty(DType::kF32, {2 * shared_inter, shared.gate.in_features});
      jobs.push_back([&shared, &moe, shared_inter] {
        copy_rows(dequantize_linear(shared.gate), moe.shared_w13, 0);
        copy_rows(dequantize_linear(shared.up), moe.shared_w13, shared_inter);
      });
      linear(shared.down, moe.shared_w2);
    }
  }

  // Run the jobs: chunks of a few per thread so the bar moves from this thread.
  const int64_t total = static_cast<int64_t>(jobs.size());
  std::optional<ProgressBar> bar;
  if (show_progress) bar.emplace("Preparing fp32 weights", static_cast<uint64_t>(total), "tensors");
  const int64_t chunk = std::max<int64_t>(1, 4 * num_threads());
  for (int64_t begin = 0; begin < total; begin += chunk) {
    const int64_t end = std::min(total, begin + chunk);
    parallel_for(end - begin, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) jobs[begin + i]();
    });
    if (bar) bar->advance(static_cast<uint64_t>(end - begin));
  }
  if (bar) bar->finish();

  auto count = [&out](const Tensor& t) {
    if (t.defined()) out.bytes += t.nbytes();
  };
  count(out.embed_tokens);
  count(out.final_norm);
  count(out.lm_head);
  for (const LayerWeightsF32& layer : out.layers) {
    for (const Tensor* t : {&layer.input_layernorm,
                            &layer.post_attention_layernorm,
                            &layer.attention.q_proj,
                            &layer.attention.k_proj,
                            &layer.attention.v_proj,
                            &layer.attention.o_proj,
                            &layer.attention.q_norm,
                            &layer.attention.k_norm,
                            &layer.attention.q_a_proj,
                            &layer.attention.q_a_layernorm,
                            &layer.attention.q_b_proj,
                            &layer.attention.kv_a_proj_with_mqa,
                            &layer.attention.kv_a_layernorm,
                            &layer.attention.kv_b_proj,
                            &layer.linear_attn.in_proj_qkv,
                            &layer.linear_attn.in_proj_z,
                            &layer.linear_attn.in_proj_b,
                            &layer.linear_attn.in_proj_a,
                            &layer.linear_attn.conv1d,
                            &layer.linear_attn.a_log,
                            &layer.linear_attn.dt_bias,
                            &layer.linear_attn.norm,
                            &layer.linear_attn.out_proj,
                            &layer.mlp_gate,
                            &layer.mlp_up,
                            &layer.mlp_down,
                            &layer.moe.router,
                            &layer.moe.correction_bias,
                            &layer.moe.w13,
                            &layer.moe.w2,
                            &layer.moe.shared_w13,
                            &layer.moe.shared_w2,
                            &layer.moe.shared_gate}) {
      count(*t);
    }
  }
  return out;
}

}  // namespace moelora::model
