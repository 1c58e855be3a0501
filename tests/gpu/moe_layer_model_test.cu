// Sm90 MoeLayerCuda as a model uses it: the layers of one model sharing one workspace
// (MoeSharedWorkspace), one rank's experts of an expert-parallel layer (expert_begin: two halves
// summed against the whole layer), the engine's side-stream schedule with the activation and
// finalize launched programmatically after the LoRA events, and the seam-2 expand formed in the
// finalize; each against layers built alone or the plain schedule, bit for bit where the
// arithmetic is the same. And the shared expert run as one more expert of the routed GEMMs
// (MoeLayerConfig::shared_in_experts), as models with an FP8 shared expert build it.
#include <gtest/gtest.h>

#include "gpu/moe_layer_fixture.cuh"

namespace moelora {
namespace {

using namespace moe_layer_test;

// The activation and finalize launched programmatically after the side stream's LoRA events
// (SideStreamScheduling::pdl_after_side_join): the same bits as plain launches after them, eagerly
// and in graph replays, with and without a shared expert (whose cuBLAS kernels keep the finalize
// a plain launch), one adapter and two.
TEST_F(Sm90_MoeLayer, ProgrammaticLaunchesAfterTheSideStreamEventsAreBitEqual) {
  for (const int shared_inter : {0, 128}) {
    SCOPED_TRACE("shared_inter " + std::to_string(shared_inter));
    std::mt19937_64 rng(test::test_seed(509 + shared_inter));
    const int H = 256, T = 16;
    auto lf = make_layer(H, 128, 8, 2, shared_inter, shared_inter > 0, RouterKind::kSoftmaxTopK, T,
                         2, 16, rng);
    ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
    auto a0 = make_adapter(lf, 16, false, rng), a1 = make_adapter(lf, 8, true, rng);
    layer.set_adapter(0, a0.gpu());
    layer.set_adapter(1, a1.gpu());
    Tensor x = bf16_round(test::random_normal({T, H}, rng));
    Tensor logits = test::random_normal({T, 8}, rng, 3.0f);
    for (const std::vector<int32_t>& slots :
         {std::vector<int32_t>(T, 0),
          std::vector<int32_t>{0, -1, 1, 1, -1, 0, 0, 1, -1, -1, 1, 0, 0, 0, 1, -1}}) {
      // the schedule of plain launches: seam 1 after the align, the seam-2 expand on the side
      ops::cuda::SideStreamScheduling plain_launches;
      plain_launches.pdl_after_side_join = false;
      plain_launches.seam1_after_quant = 0;
      plain_launches.seam2_expand_in_finalize_max_tokens = 0;
      layer.set_side_stream_scheduling(plain_launches);
      const Tensor plain = run(layer, x, slots, logits);
      ops::cuda::SideStreamScheduling programmatic = plain_launches;
      programmatic.pdl_after_side_join = true;
      layer.set_side_stream_scheduling(programmatic);
      EXPECT_EQ(test::max_abs_diff(run(layer, x, slots, logits), plain), 0.0) << "eager";
      expect_graph_replays_equal(layer, x, slots, logits, plain);
      programmatic.seam1_after_quant = 1;
      layer.set_side_stream_scheduling(programmatic);
      EXPECT_EQ(test::max_abs_diff(run(layer, x, slots, logits), plain), 0.0)
          << "eager, seam 1 after the quant";
      // the defaults: by rule seam 1 after the quant and the fold (without a shared expert), here
      // with the seam-2 shrink on the side stream (in the activation it sums in another order:
      // Seam2ShrinkInTheActivationMatchesTheReference)
      ops::cuda::SideStreamScheduling defaults;
      defaults.seam2_shrink_in_activation = 0;
      layer.set_side_stream_scheduling(defaults);
      EXPECT_EQ(test::max_abs_diff(run(layer, x, slots, logits), plain), 0.0) << "eager, defaults";
      expect_graph_replays_equal(layer, x, slots, logits, plain);
    }
  }
}

// Four adapters in slots 0-3 of `layer` (ranks big / 5 / 16 / 13, the second with a shared-outer
// layout) and a batch of T tokens whose slots cycle -1, 0, 1, 2, 3.
struct MixedAdapterBatch {
  std::vector<HostAdapter> adapters;
  std::vector<ops::MoeLoraRef> refs;
  Tensor x, logits;  // [T, H] bf16-rounded, [T, E]
  std::vector<int32_t> slots;
};
MixedAdapterBatch mixed_adapter_batch(ops::cuda::MoeLayerCuda& layer, const LayerFixture& lf,
                                      int big, int T, std::mt19937_64& rng) {
  MixedAdapterBatch b;
  b.adapters = {make_adapter(lf, big, false, rng), make_adapter(lf, 5, true, rng),
                make_adapter(lf, 16, false, rng), make_adapter(lf, 13, false, rng)};
  for (int s = 0; s < 4; ++s) {
    layer.set_adapter(s, b.adapters[s].gpu());
    b.refs.push_back(b.adapters[s].ref());
  }
  b.x = bf16_round(test::random_normal({T, lf.config.hidden}, rng));
  b.logits = test::random_normal({T, static_cast<int64_t>(lf.config.num_experts)}, rng, 3.0f);
  b.slots.resize(T);
  for (int t = 0; t < T; ++t) b.slots[t] = (t % 5) - 1;
  return b;
}

// The seam-2 expand formed in the finalize kernel (SideStreamScheduling::
// seam2_expand_in_finalize_max_tokens): the same bits as the side stream's expand + the plain
// finalize, eagerly and in graph replays, with base tokens and four adapters in one batch (ranks
// 24 / 5 / 16 / 13, one shared-outer, so both register instances, rank tails and the shared B
// run); the rows match the reference per token. A
// pool of rank 40, a top-k of 10 and a shared expert (whose cuBLAS kernels keep the finalize a
// plain launch) are past the fold's limits and keep the side-stream expand.
TEST_F(Sm90_MoeLayer, Seam2ExpandInTheFinalizeEqualsTheSideStreamExpand) {
  struct Case {
    int shared_inter, max_rank, experts, top_k;
  };
  for (const Case& cs : {Case{0, 24, 8, 2}, Case{128, 24, 8, 2}, Case{0, 16, 16, 8},
                         Case{0, 40, 8, 2}, Case{0, 16, 16, 10}}) {
    SCOPED_TRACE("shared_inter " + std::to_string(cs.shared_inter) + ", R " +
                 std::to_string(cs.max_rank) + ", E " + std::to_string(cs.experts) + ", k " +
                 std::to_string(cs.top_k));
    std::mt19937_64 rng(test::test_seed(523 + cs.shared_inter + cs.max_rank + cs.top_k));
    const int H = 256, T = 37;
    auto lf = make_layer(H, 128, cs.experts, cs.top_k, cs.shared_inter, cs.shared_inter > 0,
                         RouterKind::kSoftmaxTopK, T, 4, cs.max_rank, rng);
    ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
    const MixedAdapterBatch b = mixed_adapter_batch(layer, lf, std::min(cs.max_rank, 24), T, rng);
    const Tensor &x = b.x, &logits = b.logits;
    const std::vector<int32_t>& slots = b.slots;
    const std::vector<ops::MoeLoraRef>& refs = b.refs;
    ops::cuda::SideStreamScheduling side_expand;
    side_expand.seam2_expand_in_finalize_max_tokens = 0;
    layer.set_side_stream_scheduling(side_expand);
    const Tensor plain = run(layer, x, slots, logits);
    ops::cuda::SideStreamScheduling in_finalize;
    in_finalize.seam2_expand_in_finalize_max_tokens = 64;
    in_finalize.seam2_shrink_in_activation = 0;  // the side stream's shrink, as `plain`
    layer.set_side_stream_scheduling(in_finalize);
    const Tensor folded = run(layer, x, slots, logits);
    EXPECT_EQ(test::max_abs_diff(folded, plain), 0.0) << "eager";
    // the reference check where the fixture's inputs separate the slots (two of eight experts)
    if (cs.top_k == 2) check_rows(folded, x, slots, lf, refs, logits);
    // fewer tokens than the threshold covers, and a threshold below the batch: the side expand
    in_finalize.seam2_expand_in_finalize_max_tokens = T - 1;
    layer.set_side_stream_scheduling(in_finalize);
    EXPECT_EQ(test::max_abs_diff(run(layer, x, slots, logits), plain), 0.0) << "below the batch";
    in_finalize.seam2_expand_in_finalize_max_tokens = 64;
    layer.set_side_stream_scheduling(in_finalize);
    expect_graph_replays_equal(layer, x, slots, logits, plain);
  }
}

// The graph captured from one forward of `layer` on `stream` and its nodes (destroyed with the
// object).
struct CapturedForward {
  cudaGraph_t graph = nullptr;
  std::vector<cudaGraphNode_t> nodes;
  CapturedForward(ops::cuda::MoeLayerCuda& layer, const ops::cuda::MoeForwardArgs& f,
                  cudaStream_t stream) {
    MOELORA_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    layer.forward(f);
    MOELORA_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    size_t num_nodes = 0;
    MOELORA_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &num_nodes));
    nodes.resize(num_nodes);
    MOELORA_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &num_nodes));
  }
  ~CapturedForward() { cudaGraphDestroy(graph); }
  CapturedForward(const CapturedForward&) = delete;
  CapturedForward& operator=(const CapturedForward&) = delete;
};

// Kernel nodes of a captured forward that join two streams (more than one dependency).
int joining_nodes(ops::cuda::MoeLayerCuda& layer, const ops::cuda::MoeForwardArgs& f,
                  cudaStream_t stream) {
  const CapturedForward captured(layer, f, stream);
  int joins = 0;
  for (cudaGraphNode_t node : captured.nodes) {
    size_t deps = 0;
    MOELORA_CUDA_CHECK(cudaGraphNodeGetDependencies(node, nullptr, nullptr, &deps));
    joins += deps > 1;
  }
  return joins;
}

// The kernel nodes of the graph captured from one forward that carry the device's greatest
// priority (copied from their capture stream's).
int kernels_at_greatest_priority(ops::cuda::MoeLayerCuda& layer, const ops::cuda::MoeForwardArgs& f,
                                 cudaStream_t stream) {
  int least = 0, greatest = 0;
  MOELORA_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  if (least == greatest) return -1;  // a device without priorities
  const CapturedForward captured(layer, f, stream);
  int count = 0;
  for (cudaGraphNode_t node : captured.nodes) {
    cudaGraphNodeType type;
    MOELORA_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeKernel) continue;
    cudaKernelNodeAttrValue value{};
    MOELORA_CUDA_CHECK(
        cudaGraphKernelNodeGetAttribute(node, cudaKernelNodeAttributePriority, &value));
    count += value.priority == greatest;
  }
  return count;
}

// The routed experts' seam-2 shrink in the activation kernel (SideStreamScheduling::
// seam2_shrink_in_activation, where the seam-2 expand is in the finalize): LoRA rows match the
// reference and the side stream's shrink within bf16 rounding (the same products summed in
// another order), base rows bitwise, deterministic, graph replays equal to the eager forward; the
// captured forward joins the two streams once (before the activation) instead of three times;
// above the
// fold's token threshold the side stream's shrink runs (bitwise its output). Four adapters (ranks
// 24 / 5 / 16 / 13, one shared-outer) and base tokens in one batch; k = 2 and k = 8; the shared
// expert among the routed experts, whose down LoRA then also shrinks in the activation (at its
// token's row) and expands in the finalize.
TEST_F(Sm90_MoeLayer, Seam2ShrinkInTheActivationMatchesTheReference) {
  struct Case {
    int experts, top_k;
    bool shared_in_experts;
  };
  for (const Case& cs : {Case{8, 2, false}, Case{16, 8, false}, Case{16, 4, true}}) {
    SCOPED_TRACE("E " + std::to_string(cs.experts) + ", k " + std::to_string(cs.top_k) +
                 (cs.shared_in_experts ? ", shared expert among the routed" : ""));
    std::mt19937_64 rng(test::test_seed(547 + cs.top_k));
    const int H = 256, I = 128, T = 37;
    auto lf =
        make_layer(H, I, cs.experts, cs.top_k, cs.shared_in_experts ? I : 0, cs.shared_in_experts,
                   RouterKind::kSoftmaxTopK, T, 4, 24, rng, cs.shared_in_experts);
    ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
    const MixedAdapterBatch b = mixed_adapter_batch(layer, lf, 24, T, rng);
    const Tensor &x = b.x, &logits = b.logits;
    const std::vector<int32_t>& slots = b.slots;
    ops::cuda::SideStreamScheduling side, in_activation;
    side.seam2_shrink_in_activation = 0;
    side.shared_lora_stream =
        0;  // one side stream (its own stream: SharedExpertLoraOnItsOwnStream*)
    in_activation.seam2_shrink_in_activation = 1;
    layer.set_side_stream_scheduling(side);
    const Tensor side_shrink = run(layer, x, slots, logits);
    layer.set_side_stream_scheduling(in_activation);
    const Tensor fused = run(layer, x, slots, logits);
    EXPECT_EQ(test::max_abs_diff(run(layer, x, slots, logits), fused), 0.0) << "twice";
    for (int t = 0; t < T; t += 5)  // slot -1
      for (int c = 0; c < H; ++c)
        ASSERT_EQ(fused.item_f32(t * H + c), side_shrink.item_f32(t * H + c)) << "base token " << t;
    EXPECT_TRUE(test::close_bf16(fused, side_shrink)) << "against the side stream's shrink";
    // Only the summation order of the seam-2 shrinks differs (the activations and their FP8 codes
    // are the same): a missing delta (e.g. the shared expert's) would move its rows much further.
    for (int t = 0; t < T; ++t)
      EXPECT_LT(row_rel_error(fused, side_shrink, t), 0.01) << "token " << t;
    // the reference check where the fixture's inputs separate the slots (few of the experts)
    if (cs.top_k <= 4) check_rows(fused, x, slots, lf, b.refs, logits, 0.0447);
    expect_graph_replays_equal(layer, x, slots, logits, fused);
    // a threshold below the batch: no fold, so the side stream's shrink and expand
    ops::cuda::SideStreamScheduling unfolded = in_activation;
    unfolded.seam2_expand_in_finalize_max_tokens = T - 1;
    layer.set_side_stream_scheduling(unfolded);
    EXPECT_EQ(test::max_abs_diff(run(layer, x, slots, logits), side_shrink), 0.0)
        << "above the fold's threshold";
    {  // the side stream's joins in the captured forward
      const UploadedForward f = upload_forward(layer, x, slots, logits);
      layer.set_side_stream_scheduling(in_activation);
      EXPECT_EQ(joining_nodes(layer, f.args, main_->get()), 1) << "the activation's join only";
      layer.set_side_stream_scheduling(side);
      EXPECT_EQ(joining_nodes(layer, f.args, main_->get()), 3)
          << "the activation's, the seam-2 shrink's (after the seam-1 kernels and the activation) "
             "and the finalize's";
    }
    layer.set_side_stream_scheduling({});
  }
}

// The shared expert's LoRA on its own stream (SideStreamScheduling::shared_lora_stream) and the
// activation launched programmatically beside it (activation_pdl_with_shared_pairs), each alone,
// together and with seam 1 released after the quant: the same bits as the side stream's schedule,
// eagerly and in graph replays, with the seam-2 expand in the finalize (the default here) and on
// the side stream, four adapters and base tokens; the reference check; the single-adapter forward
// (all of the shared expert's LoRA on the side stream) against the reference; the captured forward
// joins one stream more and its four kernels on the second stream carry the greatest priority.
TEST_F(Sm90_MoeLayer, SharedExpertLoraOnItsOwnStreamIsBitEqual) {
  std::mt19937_64 rng(test::test_seed(561));
  const int H = 256, I = 128, E = 16, k = 4, T = 37;
  auto lf = make_layer(H, I, E, k, I, /*gate=*/true, RouterKind::kSoftmaxTopK, T, 4, 24, rng,
                       /*shared_in_experts=*/true);
  ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
  const MixedAdapterBatch b = mixed_adapter_batch(layer, lf, 24, T, rng);
  const Tensor &x = b.x, &logits = b.logits;
  const std::vector<int32_t>& slots = b.slots;
  for (const int seam2_in_finalize : {-1, 0}) {
    SCOPED_TRACE(seam2_in_finalize ? "seam-2 expand in the finalize" : "seam-2 expand on the side");
    ops::cuda::SideStreamScheduling one_stream;
    one_stream.shared_lora_stream = 0;
    one_stream.activation_pdl_with_shared_pairs = 0;
    one_stream.seam2_expand_in_finalize_max_tokens = seam2_in_finalize;
    layer.set_side_stream_scheduling(one_stream);
    const Tensor want = run(layer, x, slots, logits);
    check_rows(want, x, slots, lf, b.refs, logits, 0.0447);
    for (const int own_stream : {0, 1})
      for (const int pdl : {0, 1})
        for (const int after_quant : {0, 1}) {
          if (!own_stream && !pdl && !after_quant) continue;
          SCOPED_TRACE("own stream " + std::to_string(own_stream) + ", programmatic activation " +
                       std::to_string(pdl) + ", seam 1 after the quant " +
                       std::to_string(after_quant));
          ops::cuda::SideStreamScheduling s = one_stream;
          s.shared_lora_stream = own_stream;
          s.activation_pdl_with_shared_pairs = pdl;
          s.seam1_after_quant = after_quant;
          layer.set_side_stream_scheduling(s);
          EXPECT_EQ(test::max_abs_diff(run(layer, x, slots, logits), want), 0.0) << "eager";
          expect_graph_replays_equal(layer, x, slots, logits, want);
        }
    // The captured forward: on one side stream the shared expert's seam-2 kernels follow the
    // routed experts' (joins: the activation's, the seam-2 shrink's after the seam-1 kernels and
    // the activation, the finalize's); on its own stream they are forked from the activation
    // beside them, one join more.
    const UploadedForward f = upload_forward(layer, x, slots, logits);
    layer.set_side_stream_scheduling(one_stream);
    EXPECT_EQ(joining_nodes(layer, f.args, main_->get()), 3) << "one side stream";
    ops::cuda::SideStreamScheduling own = one_stream;
    own.shared_lora_stream = 1;
    layer.set_side_stream_scheduling(own);
    EXPECT_EQ(joining_nodes(layer, f.args, main_->get()), 4) << "the shared expert's own stream";
    // its four kernels (seam-1 shrink and expand, seam-2 shrink and expand) keep the stream's
    // greatest priority as graph nodes; nothing else has it
    EXPECT_EQ(kernels_at_greatest_priority(layer, f.args, main_->get()), 4);
    layer.set_side_stream_scheduling(one_stream);
    EXPECT_EQ(kernels_at_greatest_priority(layer, f.args, main_->get()), 0);
  }
  // A single adapter (its dense seam-1 shrink is a cuBLAS GEMM on the side stream's handle, so
  // the shared expert's LoRA stays on the side stream whatever the setting): the reference, and
  // the segment kernels of the multi-adapter path on the second stream within bf16 rounding.
  std::vector<int32_t> single(T, 1);
  for (int t = 0; t < T; t += 3) single[t] = -1;
  ops::cuda::SideStreamScheduling own;
  own.shared_lora_stream = 1;
  layer.set_side_stream_scheduling(own);
  const Tensor one = run(layer, x, single, logits, true, /*single_slot=*/1);
  check_rows(one, x, single, lf, b.refs, logits, 0.0447);
  EXPECT_TRUE(test::close_bf16(one, run(layer, x, single, logits, true, -1)))
      << "single adapter path against the segment kernels on the second stream";
  layer.set_side_stream_scheduling({});
}

// Scheduling values outside their ranges are refused with the field named.
TEST_F(Sm90_MoeLayer, SideStreamSchedulingOutOfRangeIsRefused) {
  std::mt19937_64 rng(test::test_seed(531));
  auto lf = make_layer(256, 128, 8, 2, 0, false, RouterKind::kSoftmaxTopK, 8, 1, 16, rng);
  ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
  ops::cuda::SideStreamScheduling s;
  s.seam1_after_quant = 2;
  EXPECT_TRUE(test::contains(test::error_message([&] { layer.set_side_stream_scheduling(s); }),
                             "seam1_after_quant = 2"));
  s = {};
  s.seam2_expand_in_finalize_max_tokens = -2;
  EXPECT_TRUE(test::contains(test::error_message([&] { layer.set_side_stream_scheduling(s); }),
                             "seam2_expand_in_finalize_max_tokens = -2"));
  s = {};
  s.seam2_shrink_in_activation = 2;
  EXPECT_TRUE(test::contains(test::error_message([&] { layer.set_side_stream_scheduling(s); }),
                             "seam2_shrink_in_activation = 2"));
  s = {};
  s.shared_lora_stream = 2;
  EXPECT_TRUE(test::contains(test::error_message([&] { layer.set_side_stream_scheduling(s); }),
                             "shared_lora_stream = 2"));
  s = {};
  s.activation_pdl_with_shared_pairs = -2;
  EXPECT_TRUE(test::contains(test::error_message([&] { layer.set_side_stream_scheduling(s); }),
                             "activation_pdl_with_shared_pairs = -2"));
  s = {};
  s.lora_max_ctas = -3;
  EXPECT_TRUE(test::contains(test::error_message([&] { layer.set_side_stream_scheduling(s); }),
                             "lora_max_ctas = -3"));
}

// Layers sharing one MoeSharedWorkspace share its two cuBLAS handles and their workspaces
// (32 MB each): building eight more such layers takes far less device memory than the eight
// private pairs (512 MB) would.
TEST_F(Sm90_MoeLayer, LayersSharingOneWorkspaceShareTheirCublasHandles) {
  std::mt19937_64 rng(test::test_seed(518));
  auto lf = make_layer(256, 128, 8, 2, 0, false, RouterKind::kSoftmaxTopK, 16, 1, 16, rng);
  ops::cuda::MoeSharedWorkspace shared;
  std::vector<std::unique_ptr<ops::cuda::MoeLayerCuda>> layers;
  layers.push_back(std::make_unique<ops::cuda::MoeLayerCuda>(lf.config, lf.host, main_->get(),
                                                             side_->get(), &shared));
  void* const main_handle = shared.cublas_main();
  void* const side_handle = shared.cublas_side();
  EXPECT_NE(main_handle, side_handle);
  size_t free_before = 0, free_after = 0, total = 0;
  MOELORA_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  for (int i = 0; i < 8; ++i)
    layers.push_back(std::make_unique<ops::cuda::MoeLayerCuda>(lf.config, lf.host, main_->get(),
                                                               side_->get(), &shared));
  MOELORA_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  EXPECT_EQ(shared.cublas_main(), main_handle);
  EXPECT_EQ(shared.cublas_side(), side_handle);
  EXPECT_LT(free_before - std::min(free_before, free_after), size_t{128} << 20)
      << "eight layers sharing a workspace allocated " << (free_before - free_after) / (1 << 20)
      << " MB";
}

// Layers of different shapes sharing one MoeSharedWorkspace (as a model's layers do) give the
// same bits as layers with private workspaces: run alternately, each layer's output from the
// shared one equals its private twin's, eagerly and in one captured graph of both layers in turn;
// their zeroed counters (route tickets, GEMM work counters) stay per layer, so a layer that runs
// after another one of a different plan still finds them at zero. The small layer has a separate
// bf16 shared expert, the large one an FP8 shared expert among its routed experts, whose LoRA
// runs on the workspace's second side stream (SideStreamScheduling::shared_lora_stream) rather
// than on its private twin's.
TEST_F(Sm90_MoeLayer, LayersSharingOneWorkspaceEqualLayersWithTheirOwn) {
  std::mt19937_64 rng(test::test_seed(517));
  const int T = 24;
  auto small = make_layer(256, 128, 8, 2, 128, true, RouterKind::kSoftmaxTopK, T, 2, 16, rng);
  auto large = make_layer(384, 256, 16, 4, 256, false, RouterKind::kSigmoidNoauxTc, T, 2, 16, rng,
                          /*shared_in_experts=*/true);
  ops::cuda::MoeSharedWorkspace shared;
  ops::cuda::MoeLayerCuda small_own(small.config, small.host, main_->get(), side_->get());
  ops::cuda::MoeLayerCuda large_own(large.config, large.host, main_->get(), side_->get());
  ops::cuda::MoeLayerCuda small_shared(small.config, small.host, main_->get(), side_->get(),
                                       &shared);
  ops::cuda::MoeLayerCuda large_shared(large.config, large.host, main_->get(), side_->get(),
                                       &shared);
  EXPECT_EQ(shared.bytes(), std::max(small_own.workspace_bytes(), large_own.workspace_bytes()))
      << "the shared workspace is as large as the larger plan";
  auto small_adapter = make_adapter(small, 16, false, rng);
  auto large_adapter = make_adapter(large, 8, true, rng);
  for (auto* layer : {&small_own, &small_shared}) layer->set_adapter(1, small_adapter.gpu());
  for (auto* layer : {&large_own, &large_shared}) layer->set_adapter(1, large_adapter.gpu());
  std::vector<int32_t> slots(T, -1);
  for (int t = 0; t < T; t += 3) slots[t] = 1;
  const Tensor xs = bf16_round(test::random_normal({T, 256}, rng));
  const Tensor xl = bf16_round(test::random_normal({T, 384}, rng));
  // Routing from the layers' own routers (no logits given): the route tickets are exercised.
  const Tensor small_ref = run(small_own, xs, slots, Tensor());
  const Tensor large_ref = run(large_own, xl, slots, Tensor());
  for (int round = 0; round < 2; ++round) {
    EXPECT_EQ(test::max_abs_diff(run(small_shared, xs, slots, Tensor()), small_ref), 0.0)
        << "round " << round;
    EXPECT_EQ(test::max_abs_diff(run(large_shared, xl, slots, Tensor()), large_ref), 0.0)
        << "round " << round;
  }
  // One graph: the small layer, then the large one, then the small one again (all on the shared
  // workspace), replayed twice.
  auto xs_d = cuda::to_device(xs.to(DType::kBF16));
  auto xl_d = cuda::to_device(xl.to(DType::kBF16));
  auto s_d = upload_vector(slots);
  cuda::DeviceBuffer out_s1(static_cast<size_t>(T) * 256 * 2),
      out_l(static_cast<size_t>(T) * 384 * 2), out_s2(static_cast<size_t>(T) * 256 * 2);
  auto args = [&](const cuda::DeviceBuffer& x, cuda::DeviceBuffer& out) {
    ops::cuda::MoeForwardArgs f;
    f.x = x.as<__nv_bfloat16>();
    f.slot = s_d.as<int32_t>();
    f.tokens = T;
    f.lora = true;
    f.out = out.as<__nv_bfloat16>();
    return f;
  };
  cudaGraphExec_t exec = capture([&] {
    small_shared.forward(args(xs_d, out_s1));
    large_shared.forward(args(xl_d, out_l));
    small_shared.forward(args(xs_d, out_s2));
  });
  // Each layer's routing of its last forward stays its own after the other layer ran (the GPU
  // model reads every layer's back, GpuModel::moe_topk_ids).
  auto routing = [&](const ops::cuda::MoeLayerCuda& layer, int k) {
    std::vector<int32_t> ids(static_cast<size_t>(T) * k);
    MOELORA_CUDA_CHECK(
        cudaMemcpy(ids.data(), layer.topk_ids(), ids.size() * 4, cudaMemcpyDeviceToHost));
    return ids;
  };
  const std::vector<int32_t> small_ids = routing(small_own, 2), large_ids = routing(large_own, 4);
  for (int replay = 0; replay < 2; ++replay) {
    MOELORA_CUDA_CHECK(cudaGraphLaunch(exec, main_->get()));
    main_->synchronize();
    EXPECT_EQ(routing(small_shared, 2), small_ids) << "the small layer's routing was overwritten";
    EXPECT_EQ(routing(large_shared, 4), large_ids) << "the large layer's routing was overwritten";
    EXPECT_EQ(test::max_abs_diff(cuda::to_host(out_s1, DType::kBF16, {T, 256}).to_f32(), small_ref),
              0.0);
    EXPECT_EQ(test::max_abs_diff(cuda::to_host(out_l, DType::kBF16, {T, 384}).to_f32(), large_ref),
              0.0);
    EXPECT_EQ(test::max_abs_diff(cuda::to_host(out_s2, DType::kBF16, {T, 256}).to_f32(), small_ref),
              0.0);
  }
  MOELORA_CUDA_CHECK(cudaGraphExecDestroy(exec));
}

// Expert parallelism on one device: the 16 experts of a layer split over two layers that each
// hold 8 (expert_begin 0 / 8, the router scoring all 16, the shared expert on the first only).
// The two outputs summed equal the whole layer's within bf16 rounding (each expert's rows come out
// of the same kernels on the same inputs) and the reference's within its tolerance; a token whose
// experts all live on one half gets exactly zero from the other. Both adapter layouts (per-expert
// and shared-outer factors, the per-expert ones cut to each half's experts), decode and prefill
// GEMM paths.
TEST_F(Sm90_MoeLayer, ExpertParallelHalvesSumToTheWholeLayer) {
  std::mt19937_64 rng(test::test_seed(523));
  const int H = 256, I = 128, E = 16, k = 4, Is = 128, T = 16, half = E / 2;
  auto lf = make_layer(H, I, E, k, Is, true, RouterKind::kSoftmaxTopK, T, 2, 16, rng);
  std::vector<HostAdapter> adapters = {make_adapter(lf, 16, false, rng),
                                       make_adapter(lf, 8, true, rng)};
  ops::cuda::MoeLayerCuda whole(lf.config, lf.host, main_->get(), side_->get());
  for (int s = 0; s < 2; ++s) whole.set_adapter(s, adapters[s].gpu());
  // The experts [begin, begin + half) of a per-expert factor (extent E), or the factor as it is.
  auto cut = [&](const Tensor& t, int begin) {
    return t.dim(0) == E ? t.slice0(begin, begin + half).clone() : t;
  };
  std::vector<std::unique_ptr<ops::cuda::MoeLayerCuda>> halves;
  std::vector<std::vector<HostAdapter>> half_adapters(2);
  for (int r = 0; r < 2; ++r) {
    const int begin = r * half;
    ops::cuda::MoeLayerConfig c = lf.config;
    c.num_experts = half;
    c.expert_begin = begin;
    c.shared_inter = r == 0 ? Is : 0;
    c.shared_gate = r == 0 && lf.config.shared_gate;
    ops::cuda::MoeLayerHostWeights w = lf.host;
    w.w13 = cut(lf.host.w13, begin);
    w.w13_scale = cut(lf.host.w13_scale, begin);
    w.w2 = cut(lf.host.w2, begin);
    w.w2_scale = cut(lf.host.w2_scale, begin);
    if (r != 0) w.shared_w13 = w.shared_w2 = w.shared_gate = Tensor();
    halves.push_back(std::make_unique<ops::cuda::MoeLayerCuda>(c, w, main_->get(), side_->get()));
    for (int s = 0; s < 2; ++s) {
      HostAdapter a;
      a.gate_up = {cut(adapters[s].gate_up.a, begin), cut(adapters[s].gate_up.b, begin),
                   adapters[s].gate_up.scaling};
      a.down = {cut(adapters[s].down.a, begin), cut(adapters[s].down.b, begin),
                adapters[s].down.scaling};
      if (r == 0) {
        a.shared_gate = adapters[s].shared_gate;
        a.shared_up = adapters[s].shared_up;
        a.shared_down = adapters[s].shared_down;
      }
      half_adapters[r].push_back(std::move(a));
    }
    for (int s = 0; s < 2; ++s) {
      const HostAdapter& a = half_adapters[r][static_cast<size_t>(s)];
      ops::cuda::MoeLayerAdapter g = a.gpu();
      if (r != 0) g.shared_gate = g.shared_up = g.shared_down = nullptr;
      halves.back()->set_adapter(s, g);
    }
  }
  EXPECT_EQ(halves[1]->router_bytes(), whole.router_bytes()) << "each half keeps the whole router";
  const Tensor x = bf16_round(test::random_normal({T, H}, rng));
  const Tensor logits = test::random_normal({T, E}, rng, 3.0f);
  const std::vector<int32_t> slots = {0, -1, 1, 0, 0, -1, 1, 1, -1, 0, 1, -1, 0, 0, 1, -1};
  // Which half each token's experts are on (the softmax top-k is the k largest logits).
  std::vector<std::array<bool, 2>> uses(T, {false, false});
  for (int t = 0; t < T; ++t) {
    std::vector<int> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int a, int b) {
      return logits.item_f32(t * E + a) > logits.item_f32(t * E + b);
    });
    for (int j = 0; j < k; ++j) uses[t][static_cast<size_t>(order[j] / half)] = true;
  }
  for (const auto path : {ops::cuda::GemmPath::kDecode, ops::cuda::GemmPath::kPrefill}) {
    SCOPED_TRACE(path == ops::cuda::GemmPath::kDecode ? "decode GEMMs" : "prefill GEMMs");
    whole.set_gemm_path(path);
    const Tensor want = run(whole, x, slots, logits);
    Tensor sum = Tensor::zeros(DType::kF32, {T, H});
    for (int r = 0; r < 2; ++r) {
      halves[static_cast<size_t>(r)]->set_gemm_path(path);
      const Tensor part = run(*halves[static_cast<size_t>(r)], x, slots, logits);
      for (int t = 0; t < T; ++t) {
        if (r == 1 && !uses[t][1]) {  // nothing routed to this half and no shared expert here
          for (int c = 0; c < H; ++c) ASSERT_EQ(part.item_f32(t * H + c), 0.0f) << "token " << t;
        }
        for (int c = 0; c < H; ++c) sum.data<float>()[t * H + c] += part.item_f32(t * H + c);
      }
    }
    for (int t = 0; t < T; ++t) EXPECT_LT(row_rel_error(sum, want, t), 0.01) << "token " << t;
    std::vector<ops::MoeLoraRef> refs = {adapters[0].ref(), adapters[1].ref()};
    check_rows(sum, x, slots, lf, refs, logits);
  }
  // A layer whose experts are not among the router's is refused, naming them.
  ops::cuda::MoeLayerConfig bad = lf.config;
  bad.num_experts = half;
  bad.expert_begin = E - half + 1;
  ops::cuda::MoeLayerHostWeights w = lf.host;
  w.w13 = cut(lf.host.w13, 0);
  w.w13_scale = cut(lf.host.w13_scale, 0);
  w.w2 = cut(lf.host.w2, 0);
  w.w2_scale = cut(lf.host.w2_scale, 0);
  const std::string msg = test::error_message(
      [&] { ops::cuda::MoeLayerCuda layer(bad, w, main_->get(), side_->get()); },
      ErrorCode::kInvalidArgument);
  EXPECT_TRUE(test::contains(msg, "experts [9, 17) are not among the router's 16")) << msg;
}

// The shared expert as one more expert of the FP8 routed GEMMs (MoeLayerConfig::shared_in_experts:
// pair k of every token, FP8 like the routed experts), gated (Qwen) and ungated (DeepSeek), with
// three adapters that also target it (per-expert and shared-outer) and base tokens: every decode
// LoRA path and the prefill and register GEMM paths against the reference with the shared
// expert's FP8 activations, per token; the seam-2 expand in the finalize (the default at this size)
// bit-equal to the side-stream expand; graph replays bit-equal to the eager run; the no-LoRA
// pipeline bit-equal to a LoRA forward of base tokens and to the base tokens of the mixed batch.
TEST_F(Sm90_MoeLayer, SharedExpertAmongTheRoutedExpertsMatchesReference) {
  // The shared expert's activations are FP8 too: one more quantization per row whose codes can flip
  // between the reference's fp32 and the GPU's bf16-rounded inputs, so a row may reach PERF.md's
  // FP8 bound (cosine 0.999, relative error 0.0447; 0.0406 seen in the 300-token forward).
  const double max_row_error = 0.0447;
  for (const bool gate : {true, false}) {
    SCOPED_TRACE(gate ? "gated shared expert" : "ungated shared expert");
    std::mt19937_64 rng(test::test_seed(gate ? 540 : 541));
    const int H = 256, I = 128, E = 16, k = 4, T = 37;
    auto lf = make_layer(H, I, E, k, I, gate, RouterKind::kSoftmaxTopK, 300, 3, 24, rng,
                         /*shared_in_experts=*/true);
    ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
    std::vector<HostAdapter> adapters = {make_adapter(lf, 8, false, rng),
                                         make_adapter(lf, 16, true, rng),
                                         make_adapter(lf, 13, false, rng)};
    std::vector<ops::MoeLoraRef> refs;
    for (int s = 0; s < 3; ++s) {
      layer.set_adapter(s, adapters[s].gpu());
      refs.push_back(adapters[s].ref());
    }
    Tensor x = bf16_round(test::random_normal({T, H}, rng));
    Tensor logits = test::random_normal({T, E}, rng, 3.0f);
    std::vector<int32_t> slots(T);
    for (int t = 0; t < T; ++t) slots[t] = (t % 4) - 1;  // -1, 0, 1, 2
    for (const auto path : kDecodeLoraPaths) {
      SCOPED_TRACE(decode_lora_name(path));
      layer.set_decode_lora_path(path);
      check_rows(run(layer, x, slots, logits), x, slots, lf, refs, logits, max_row_error);
    }
    layer.set_decode_lora_path(ops::cuda::DecodeLoraPath::kSideStream);
    const Tensor eager = run(layer, x, slots, logits);
    for (const auto gemm : {ops::cuda::GemmPath::kPrefill, ops::cuda::GemmPath::kDecodeRegister}) {
      SCOPED_TRACE(gemm == ops::cuda::GemmPath::kPrefill ? "prefill GEMM" : "register decode GEMM");
      layer.set_gemm_path(gemm);
      check_rows(run(layer, x, slots, logits), x, slots, lf, refs, logits, max_row_error);
    }
    layer.set_gemm_path(ops::cuda::GemmPath::kAuto);
    ops::cuda::SideStreamScheduling side_expand;
    side_expand.seam2_expand_in_finalize_max_tokens = 0;
    layer.set_side_stream_scheduling(side_expand);
    EXPECT_EQ(test::max_abs_diff(run(layer, x, slots, logits), eager), 0.0)
        << "the seam-2 expand on the side stream against the one in the finalize";
    layer.set_side_stream_scheduling({});
    expect_graph_replays_equal(layer, x, slots, logits, eager);
    const std::vector<int32_t> base(T, -1);
    const Tensor no_lora = run(layer, x, base, logits, /*lora=*/false);
    EXPECT_EQ(test::max_abs_diff(no_lora, run(layer, x, base, logits, /*lora=*/true)), 0.0);
    for (int t = 0; t < T; t += 4)  // slot -1 in the mixed batch
      for (int c = 0; c < H; ++c)
        ASSERT_EQ(eager.item_f32(t * H + c), no_lora.item_f32(t * H + c)) << "base token " << t;
    // The single-adapter path (slot 1, shared-outer: dense shrinks) with base tokens, against the
    // reference and the segmented path.
    std::vector<int32_t> single(T, 1);
    for (int t = 0; t < T; t += 3) single[t] = -1;
    const Tensor one = run(layer, x, single, logits, true, /*single_slot=*/1);
    check_rows(one, x, single, lf, refs, logits, max_row_error);
    EXPECT_TRUE(test::close_bf16(one, run(layer, x, single, logits, true, -1)))
        << "single adapter path";
    // A prefill-sized forward: the tensor-core LoRA kernels, the shared expert's down shrink
    // gathering its rows' activations through token_shared_row, the CUTLASS GEMMs.
    const int Tp = 300;
    Tensor xp = bf16_round(test::random_normal({Tp, H}, rng));
    Tensor lp = test::random_normal({Tp, E}, rng, 3.0f);
    std::vector<int32_t> sp(Tp);
    for (int t = 0; t < Tp; ++t) sp[t] = (t % 4) - 1;
    check_rows(run(layer, xp, sp, lp), xp, sp, lf, refs, lp, max_row_error);
  }
}

// What shared_in_experts cannot hold is refused, naming it: a shared expert of another size, a
// shared expert given in bf16, and the expert GEMV chain (which runs the shared expert itself).
TEST_F(Sm90_MoeLayer, SharedExpertAmongTheRoutedExpertsRefusals) {
  std::mt19937_64 rng(test::test_seed(542));
  auto make = [&](const LayerFixture& lf) {
    ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
  };
  auto other_size =
      make_layer(256, 128, 8, 2, 256, true, RouterKind::kSoftmaxTopK, 8, 1, 16, rng, true);
  EXPECT_TRUE(test::contains(test::error_message([&] { make(other_size); }),
                             "shared expert of the routed experts' size (Is = 256, I = 128)"));
  auto bf16_shared = make_layer(256, 128, 8, 2, 128, true, RouterKind::kSoftmaxTopK, 8, 1, 16, rng);
  bf16_shared.config.shared_in_experts = true;
  EXPECT_TRUE(test::contains(test::error_message([&] { make(bf16_shared); }),
                             "shared_w13 (shared_in_experts)"));
  auto lf = make_layer(256, 128, 8, 2, 128, true, RouterKind::kSoftmaxTopK, 8, 1, 16, rng, true);
  ops::cuda::MoeLayerCuda layer(lf.config, lf.host, main_->get(), side_->get());
  layer.set_gemm_path(ops::cuda::GemmPath::kGemv);
  Tensor x = bf16_round(test::random_normal({4, 256}, rng));
  EXPECT_TRUE(test::contains(
      test::error_message([&] {
        run(layer, x, std::vector<int32_t>(4, -1), test::random_normal({4, 8}, rng), false);
      }),
      "shared_in_experts"));
}

}  // namespace
}  // namespace moelora
