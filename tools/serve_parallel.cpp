// `moelora serve --tp N`: the launcher, rank 0's executor and the worker ranks (serve_parallel.h).
#include "serve_parallel.h"

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli.h"
#include "core/error.h"
#include "dist/gpu_rank_model.h"
#include "dist/launcher.h"
#include "dist/sharded_executor.h"
#include "dist/socket_group.h"
#include "model/model.h"
#include "runtime/gpu_executor.h"
#if defined(MOELORA_WITH_NCCL)
#include "nccl/nccl_communicator.h"
#endif

namespace moelora::tools {

namespace {

using ::moelora::detail::concat;

std::chrono::milliseconds join_timeout(const ParallelArgs& a) {
  return std::chrono::milliseconds(static_cast<int64_t>(a.dist_timeout_s * 1000.0));  // checked
}

dist::ShardedModelOptions sharded_options(const ParallelArgs& a) {
  dist::ShardedModelOptions options;
  options.attention =
      a.dp_attention ? dist::AttentionSplit::kDataParallel : dist::AttentionSplit::kTensorParallel;
  if (a.moe_dispatch) {
    options.moe_combine = dist::MoeCombine::kDispatch;
    options.shared_expert = dist::SharedExpertSplit::kReplicated;
  }
  return options;
}

// What every rank must run alike, in words, so a mismatch at the join says what differs.
std::string fingerprint(const ParallelArgs& a, const EngineOptions& o) {
  namespace fs = std::filesystem;
  std::ifstream in(fs::path(o.model_dir) / "config.json", std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  uint64_t hash = 1469598103934665603ULL;  // FNV-1a of config.json
  for (char c : text.str()) hash = (hash ^ static_cast<unsigned char>(c)) * 1099511628211ULL;
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(hash));
  std::error_code ec;
  const fs::path dir = fs::weakly_canonical(o.model_dir, ec);
  return concat("model ", dir.string(), " (config.json ", hex, "), tp ", a.tp,
                a.dp_attention ? ", data-parallel attention" : "",
                a.moe_dispatch ? ", MoE token dispatch" : "", ", layers ", o.max_layers,
                ", max-batch-tokens ", o.max_batch_tokens, ", max-running ", o.max_running,
                ", adapter-slots ", o.adapter_slots, ", max-lora-rank ", o.max_lora_rank);
}

std::unique_ptr<model::Model> load_model(const EngineOptions& o, bool show_progress) {
  model::ModelOptions options;
  options.show_progress = show_progress;
  options.max_layers = o.max_layers;
  return std::make_unique<model::Model>(model::Model::load(o.model_dir, options));
}

bool on_gpus(const EngineOptions& o) {
  return o.device.rfind("cuda", 0) == 0;
}

std::unique_ptr<dist::SocketGroup> join(const ParallelArgs& a, const EngineOptions& o) {
  dist::SocketGroupOptions g;
#if defined(MOELORA_WITH_NCCL)
  // GPU ranks: rank 0 makes the NCCL group's id and every rank receives it at the join.
  if (on_gpus(o) && a.dist_rank == 0) g.welcome = dist::nccl_new_unique_id();
#endif
  g.rank = a.dist_rank;
  g.size = a.world();
  g.address = dist::parse_host_port(a.dist_init_addr, "--dist-init-addr");
  g.listen_fd = a.dist_listen_fd;
  g.join_timeout = join_timeout(a);
  g.collective_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(a.dist_collective_timeout_s * 1000.0));
  g.fingerprint = fingerprint(a, o);
  return dist::SocketGroup::join(g);
}

}  // namespace

void add_parallel_options(CLI::App& app, ParallelArgs& a) {
  app.add_option("--tp", a.tp,
                 "ranks (processes) to shard the model over: attention heads tensor parallel, "
                 "routed experts expert parallel, dense layers tensor parallel; --device cpu, or "
                 "--device cuda with one GPU per rank over NCCL")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--ep", a.ep,
                 "expert-parallel ranks (default and only choice: --tp; the experts are split "
                 "over the same ranks as the heads)");
  app.add_flag("--dp-attention", a.dp_attention,
               "data-parallel attention: every rank holds the whole attention and attends its "
               "own requests (for models whose heads are too few to split over --tp)");
  app.add_flag("--moe-dispatch", a.moe_dispatch,
               "with --dp-attention: send each token to its experts' ranks and back (all-to-all) "
               "instead of all-reducing every token to every rank; the shared expert replicated");
  app.add_option("--nnodes", a.nnodes, "machines the ranks are spread over (--tp divisible by it)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--node-rank", a.node_rank, "this machine's index among --nnodes")
      ->capture_default_str();
  app.add_option("--dist-init-addr", a.dist_init_addr,
                 "HOST:PORT where rank 0 (on node 0) waits for the others to join (needed with "
                 "--nnodes > 1; default: a free port on 127.0.0.1)");
  app.add_option("--dist-timeout", a.dist_timeout_s,
                 "seconds to wait for every rank to join and load its share before giving up")
      ->capture_default_str();
  app.add_option("--dist-collective-timeout", a.dist_collective_timeout_s,
                 "seconds a rank waits for the others at a collective (an all-reduce of a step) "
                 "before the group is aborted, naming the late rank")
      ->capture_default_str();
  // Set by the launcher on the processes it starts.
  app.add_option("--dist-rank", a.dist_rank, "")->group("");
  app.add_option("--dist-listen-fd", a.dist_listen_fd, "")->group("");
}

void check_parallel_args(const ParallelArgs& a, const std::string& device) {
  MOELORA_CHECK(a.ep == 0 || a.ep == a.tp, ErrorCode::kInvalidArgument, "--ep ", a.ep,
                " with --tp ", a.tp,
                ": the routed experts are split over the same ranks as the "
                "attention heads; give --ep ",
                a.tp, " or leave it out");
  MOELORA_CHECK(a.tp % a.nnodes == 0, ErrorCode::kInvalidArgument, "--tp ", a.tp,
                " is not divisible by --nnodes ", a.nnodes,
                ": every node runs the same number of ranks");
  MOELORA_CHECK(a.node_rank >= 0 && a.node_rank < a.nnodes, ErrorCode::kInvalidArgument,
                "--node-rank ", a.node_rank, " is not in [0, --nnodes ", a.nnodes, ")");
  MOELORA_CHECK(a.nnodes == 1 || !a.dist_init_addr.empty(), ErrorCode::kInvalidArgument,
                "--nnodes ", a.nnodes,
                " needs --dist-init-addr HOST:PORT (an address of node 0 "
                "that every node can reach)");
  if (!a.dist_init_addr.empty()) (void)dist::parse_host_port(a.dist_init_addr, "--dist-init-addr");
  MOELORA_CHECK(a.dist_timeout_s > 0 && a.dist_timeout_s <= 86400, ErrorCode::kInvalidArgument,
                "--dist-timeout ", a.dist_timeout_s, " must be in (0, 86400] seconds");
  MOELORA_CHECK(a.dist_collective_timeout_s > 0 && a.dist_collective_timeout_s <= 86400,
                ErrorCode::kInvalidArgument, "--dist-collective-timeout ",
                a.dist_collective_timeout_s, " must be in (0, 86400] seconds");
  MOELORA_CHECK(!(a.dp_attention && a.tp == 1), ErrorCode::kInvalidArgument,
                "--dp-attention needs --tp > 1");
  MOELORA_CHECK(!a.moe_dispatch || a.dp_attention, ErrorCode::kInvalidArgument,
                "--moe-dispatch needs --dp-attention (with tensor-parallel attention every rank "
                "holds every token already)");
  MOELORA_CHECK(a.tp == 1 || device != "cuda" || (!a.dp_attention && !a.moe_dispatch),
                ErrorCode::kUnsupported,
                "--dp-attention and --moe-dispatch run on the CPU reference only (--device cpu); "
                "the GPU ranks split the attention heads (--tp alone)");
#if !defined(MOELORA_WITH_NCCL)
  MOELORA_CHECK(a.tp == 1 || device != "cuda", ErrorCode::kUnsupported, "--tp ", a.tp,
                " --device cuda: this build has no NCCL (the CUDA toolkit's, found by CMake next "
                "to it); run --tp ",
                a.tp, " with --device cpu (the sharded CPU reference) or one GPU with --tp 1");
#else
  MOELORA_CHECK(a.tp == 1 || device != "cuda" || runtime::cuda_device_available(),
                ErrorCode::kUnsupported, "--tp ", a.tp,
                " --device cuda: no CUDA device is visible on this machine; run --device cpu");
#endif
  MOELORA_CHECK(a.dist_rank < a.tp, ErrorCode::kInvalidArgument, "--dist-rank ", a.dist_rank,
                " is not a rank of --tp ", a.tp);
}

int launch_serve_ranks(const ParallelArgs& a) {
  const int per_node = a.tp / a.nnodes;
  const int first = a.node_rank * per_node;
  std::vector<std::string> base = cli::command_line();
  MOELORA_CHECK(!base.empty(), ErrorCode::kInternal, "the command line is unknown");
  std::error_code ec;
  base[0] = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  MOELORA_CHECK(!ec, ErrorCode::kInternal,
                "cannot find this program (/proc/self/exe): ", ec.message());

  // Node 0 binds the rendezvous before any rank starts and hands the socket to rank 0, so the
  // port cannot be taken in between and the workers find it at once.
  dist::Listener listener;
  std::string address = a.dist_init_addr;
  if (a.node_rank == 0) {
    const dist::HostPort where = address.empty()
                                     ? dist::HostPort{"127.0.0.1", 0}
                                     : dist::parse_host_port(address, "--dist-init-addr");
    listener = dist::Listener::bind(where);
    if (address.empty()) address = dist::HostPort{"127.0.0.1", listener.port()}.text();
  }
  std::vector<dist::RankProcess> ranks;
  for (int r = first; r < first + per_node; ++r) {
    dist::RankProcess p;
    p.rank = r;
    p.argv = base;
    p.argv.insert(p.argv.end(), {"--dist-rank", std::to_string(r)});
    if (a.dist_init_addr.empty()) p.argv.insert(p.argv.end(), {"--dist-init-addr", address});
    if (r == 0) {
      p.argv.insert(p.argv.end(), {"--dist-listen-fd", std::to_string(listener.fd())});
      p.inherit_fds.push_back(listener.fd());
    }
    // NVLink multicast stays off in every rank (on these hosts a program that uses it can take
    // the shared GPUs out of service); the NCCL communicator sets it too, this covers anything
    // else a rank starts.
    p.env.push_back("NCCL_NVLS_ENABLE=0");
    ranks.push_back(std::move(p));
  }
  dist::LaunchOptions options;
  options.log = [](const std::string& line) {
    std::fprintf(stderr, "moelora serve: %s\n", line.c_str());
    std::fflush(stderr);
  };
  options.started = [&](const std::vector<int>& pids) {
    listener.close();  // rank 0 has its own copy; a late connection must not wait on this one
    std::string line = concat("moelora serve: node ", a.node_rank, " of ", a.nnodes, " started");
    for (size_t i = 0; i < pids.size(); ++i)
      line += concat(i ? "," : "", " rank ", ranks[i].rank, " (pid ", pids[i], ")");
    std::printf("%s; rendezvous at %s\n", line.c_str(), address.c_str());
    std::fflush(stdout);
  };
  const int code = dist::launch_and_supervise(ranks, options);
  return code;
}

#if defined(MOELORA_WITH_NCCL)
// This rank's GPU model: its NCCL communicator (the id from the join) on its node-local GPU, and
// a GPU executor of its share.
std::unique_ptr<dist::RankModel> gpu_rank_model(const ParallelArgs& a, const EngineOptions& o,
                                                const dist::SocketGroup& group) {
  const int device = a.dist_rank % (a.tp / a.nnodes);
  const auto timeout =
      std::chrono::milliseconds(static_cast<int64_t>(a.dist_collective_timeout_s * 1000.0));
  std::unique_ptr<dist::NcclCommunicator> nccl =
      dist::NcclCommunicator::create(group.welcome(), a.dist_rank, a.tp, device, timeout);
  runtime::GpuExecutorOptions g = runtime::gpu_executor_options(o);
  g.device = device;
  g.show_progress = g.show_progress && a.dist_rank == 0;
  return std::make_unique<dist::GpuRankModel>(g, std::move(nccl),
                                              dist::ShardSpec{a.dist_rank, a.tp});
}
#endif

std::unique_ptr<runtime::Executor> make_rank0_executor(const ParallelArgs& a,
                                                       const EngineOptions& o) {
  std::unique_ptr<dist::SocketGroup> group = join(a, o);
#if defined(MOELORA_WITH_NCCL)
  if (on_gpus(o)) {
    std::unique_ptr<dist::RankModel> rank = gpu_rank_model(a, o, *group);
    return std::make_unique<dist::ShardedExecutor>(std::move(rank), std::move(group),
                                                   runtime::executor_limits(o), join_timeout(a));
  }
#endif
  std::unique_ptr<model::Model> model = load_model(o, o.show_progress);
  return std::make_unique<dist::ShardedExecutor>(std::move(model), std::move(group),
                                                 runtime::executor_limits(o), sharded_options(a),
                                                 join_timeout(a));
}

int run_worker_rank(const ParallelArgs& a, const EngineOptions& o) {
  std::unique_ptr<dist::SocketGroup> group = join(a, o);
#if defined(MOELORA_WITH_NCCL)
  if (on_gpus(o)) {
    dist::run_sharded_worker([&] { return gpu_rank_model(a, o, *group); }, *group);
    return 0;
  }
#endif
  std::unique_ptr<model::Model> model;
  try {
    model = load_model(o, /*show_progress=*/false);
  } catch (const std::exception& e) {
    group->send_reply(concat("rank ", a.dist_rank, " cannot load the model: ", e.what()));
    throw;
  }
  dist::run_sharded_worker(std::move(model), *group, runtime::executor_limits(o),
                           sharded_options(a));
  return 0;
}

}  // namespace moelora::tools
