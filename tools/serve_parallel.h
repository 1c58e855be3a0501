// `moelora serve --tp N`: one process per rank, started and supervised by the command the user
// ran (src/dist/launcher.h), joined over TCP (src/dist/socket_group.h). Rank 0 serves HTTP with
// an Engine over dist::ShardedExecutor; the other ranks run dist::run_sharded_worker.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <string>

#include "moelora/engine.h"
#include "runtime/executor.h"

namespace moelora::tools {

struct ParallelArgs {
  int tp = 1;
  int ep = 0;  // 0: as --tp
  bool dp_attention = false;
  bool moe_dispatch = false;
  int nnodes = 1;
  int node_rank = 0;
  std::string dist_init_addr;  // HOST:PORT of rank 0's rendezvous; default 127.0.0.1:any
  double dist_timeout_s = 300;
  double dist_collective_timeout_s = 60;  // SocketGroupOptions::collective_timeout
  // Set by the launcher on the processes it starts.
  int dist_rank = -1;
  int dist_listen_fd = -1;

  int world() const { return tp; }
  bool launcher() const { return tp > 1 && dist_rank < 0; }
  bool worker() const { return dist_rank > 0; }
  bool rank0() const { return dist_rank == 0; }
};

void add_parallel_options(CLI::App& app, ParallelArgs& args);

// Checks the combination (kInvalidArgument naming the flag; kUnsupported for a GPU with --tp > 1,
// whose shards are not built yet).
void check_parallel_args(const ParallelArgs& args, const std::string& device);

// The launcher: starts this node's ranks (this program with the same arguments plus the rank's)
// and supervises them; returns the job's exit code.
int launch_serve_ranks(const ParallelArgs& args);

// Rank 0: joins the group, loads the model and cuts its share; the Engine runs on the result.
std::unique_ptr<runtime::Executor> make_rank0_executor(const ParallelArgs& args,
                                                       const EngineOptions& options);

// A worker rank: joins, loads, cuts its share, runs rank 0's commands until told to stop.
int run_worker_rank(const ParallelArgs& args, const EngineOptions& options);

}  // namespace moelora::tools
