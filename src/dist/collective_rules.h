// The rules every Communicator implementation shares: what one rank's call of a collective is,
// how the calls of all ranks are checked against each other (NCCL's contract, communicator.h),
// and what each rank receives once they agree. InProcessGroup (threads) and SocketGroup
// (processes, the calls gathered on rank 0) both run these, so a program that is wrong under one
// fails with the same message under the other.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moelora::dist::detail {

enum class Op : uint8_t {
  kAllReduceSum,
  kAllGather,
  kReduceScatterSum,
  kAllToAllV,
  kBroadcast,
  kBarrier
};
inline constexpr int kNumOps = 6;

const char* op_name(Op op);

// What one rank passed to one collective. The pointers are into the caller's buffers (or, on
// SocketGroup's rank 0, into the received frame) and stay valid until every rank's result has
// been computed.
struct Call {
  Op op = Op::kBarrier;
  const float* send = nullptr;  // (send_count) read by other ranks
  size_t send_count = 0;
  float* recv = nullptr;  // (recv_count) written by this rank only
  size_t recv_count = 0;
  std::span<const int64_t> send_counts;  // (group size) all_to_all_v only
  std::span<const int64_t> recv_counts;  // (group size) all_to_all_v only
  int root = 0;                          // broadcast only
  std::string local_error;  // what is wrong with this rank's own arguments; "" when nothing
};

// Rank `rank` of `size`'s call of each collective, its own arguments checked into local_error.
Call all_reduce_call(std::span<float> inout);
Call all_gather_call(std::span<const float> send, std::span<float> recv, int rank, int size);
Call reduce_scatter_call(std::span<const float> send, std::span<float> recv, int rank, int size);
Call all_to_all_call(std::span<const float> send, std::span<const int64_t> send_counts,
                     std::span<float> recv, std::span<const int64_t> recv_counts, int size);
Call broadcast_call(std::span<float> buf, int root, int size);
Call barrier_call();

// What is wrong with a call that arrived over the wire from rank `rank` of `size` (whose own
// checks ran in a process rank 0 cannot trust: another build, a corrupt stream): the call
// builders' checks again, the counts consistent with each other without overflow, and data where
// the collective reads it. "" when nothing is.
std::string check_remote_call(const Call& call, int rank, int size);

// Checks the calls of collective #seq against each other: the first disagreement as a message,
// "" when they agree. Every rank throws this one message, so all ranks report the same problem.
std::string check_calls(const std::vector<Call>& calls, uint64_t seq);

// Floats rank r receives from an agreed collective: all_reduce / reduce_scatter / broadcast its
// count, all_gather size x count, all_to_all_v the sum of its recv_counts, barrier 0.
// Known from the rank's own call alone (a worker checks rank 0's answer against it).
size_t result_count(const Call& own, int size);

// Writes rank `rank`'s result of agreed calls (check_calls returned "") to out
// (result_count floats). Reductions sum in rank order. all_gather skips the block that already
// holds the rank's own send (in place); broadcast writes nothing on the root.
void collective_result(const std::vector<Call>& calls, int rank, float* out);

// "ranks 1, 3" / "rank 2": the ranks r with selected[r] == want.
std::string rank_list(const std::vector<char>& selected, bool want);

}  // namespace moelora::dist::detail
