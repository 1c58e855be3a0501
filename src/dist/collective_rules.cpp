// The collective rules shared by every Communicator (collective_rules.h).
#include "dist/collective_rules.h"

#include <algorithm>
#include <functional>

#include "core/error.h"

namespace moelora::dist::detail {

namespace {

using ::moelora::detail::concat;

bool overlap(const float* a, size_t a_count, const float* b, size_t b_count) {
  if (a_count == 0 || b_count == 0) return false;
  const std::less<const float*> before;
  return before(a, b + b_count) && before(b, a + a_count);
}

Call make_call(Op op, std::span<const float> send, std::span<float> recv) {
  Call call;
  call.op = op;
  call.send = send.data();
  call.send_count = send.size();
  call.recv = recv.data();
  call.recv_count = recv.size();
  return call;
}

// all_to_all_v's own arguments: one count per rank, none negative, sums within the buffers.
std::string check_counts(const char* what, std::span<const int64_t> counts, int size,
                         size_t buffer_size, const char* buffer) {
  if (counts.size() != static_cast<size_t>(size)) {
    return concat(what, " has ", counts.size(), " entries, expected one per rank (", size, ")");
  }
  uint64_t total = 0;
  for (int r = 0; r < size; ++r) {
    if (counts[r] < 0) return concat(what, "[", r, "] is ", counts[r], ", expected >= 0");
    total += static_cast<uint64_t>(counts[r]);
    if (total > buffer_size) {
      return concat(what, "[0..", r, "] sum to ", total, " floats but ", buffer, " has only ",
                    buffer_size);
    }
  }
  return "";
}

// out (count) = sum over ranks r of calls[r].send[offset, offset + count), in rank order.
void sum_in_rank_order(const std::vector<Call>& calls, size_t offset, size_t count, float* out) {
  std::copy_n(calls[0].send + offset, count, out);
  for (size_t r = 1; r < calls.size(); ++r) {
    const float* in = calls[r].send + offset;
    for (size_t i = 0; i < count; ++i) out[i] += in[i];
  }
}

}  // namespace

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllReduceSum: return "all_reduce_sum";
    case Op::kAllGather: return "all_gather";
    case Op::kReduceScatterSum: return "reduce_scatter_sum";
    case Op::kAllToAllV: return "all_to_all_v";
    case Op::kBroadcast: return "broadcast";
    case Op::kBarrier: return "barrier";
  }
  return "unknown collective";
}

Call all_reduce_call(std::span<float> inout) {
  return make_call(Op::kAllReduceSum, inout, inout);
}

Call all_gather_call(std::span<const float> send, std::span<float> recv, int rank, int size) {
  Call call = make_call(Op::kAllGather, send, recv);
  const size_t count = send.size();
  if (recv.size() != size_t(size) * count) {
    call.local_error = concat("recv has ", recv.size(), " floats, expected size ", size, " x send ",
                              count, " = ", size_t(size) * count);
  } else if (send.data() != recv.data() + size_t(rank) * count &&
             overlap(send.data(), count, recv.data(), recv.size())) {
    call.local_error =
        "send overlaps recv (the only allowed overlap is in place: send == recv"
        " + rank * send.size())";
  }
  return call;
}

Call reduce_scatter_call(std::span<const float> send, std::span<float> recv, int rank, int size) {
  Call call = make_call(Op::kReduceScatterSum, send, recv);
  const size_t count = recv.size();
  if (send.size() != size_t(size) * count) {
    call.local_error = concat("send has ", send.size(), " floats, expected size ", size, " x recv ",
                              count, " = ", size_t(size) * count);
  } else if (recv.data() != send.data() + size_t(rank) * count &&
             overlap(send.data(), send.size(), recv.data(), count)) {
    call.local_error =
        "recv overlaps send (the only allowed overlap is in place: recv == send"
        " + rank * recv.size())";
  }
  return call;
}

Call all_to_all_call(std::span<const float> send, std::span<const int64_t> send_counts,
                     std::span<float> recv, std::span<const int64_t> recv_counts, int size) {
  Call call = make_call(Op::kAllToAllV, send, recv);
  call.send_counts = send_counts;
  call.recv_counts = recv_counts;
  call.local_error = check_counts("send_counts", send_counts, size, send.size(), "send");
  if (call.local_error.empty()) {
    call.local_error = check_counts("recv_counts", recv_counts, size, recv.size(), "recv");
  }
  if (call.local_error.empty() && overlap(send.data(), send.size(), recv.data(), recv.size())) {
    call.local_error = "send overlaps recv";
  }
  return call;
}

Call broadcast_call(std::span<float> buf, int root, int size) {
  Call call = make_call(Op::kBroadcast, buf, buf);
  call.root = root;
  if (root < 0 || root >= size) {
    call.local_error = concat("root ", root, " is out of range [0, ", size, ")");
  }
  return call;
}

Call barrier_call() {
  return make_call(Op::kBarrier, {}, {});
}

std::string check_remote_call(const Call& call, int rank, int size) {
  const uint64_t n = static_cast<uint64_t>(size);
  switch (call.op) {
    case Op::kAllReduceSum:
      if (call.recv_count != call.send_count)
        return concat("recv count ", call.recv_count, " differs from send count ", call.send_count,
                      " (all_reduce_sum works in place)");
      break;
    case Op::kAllGather:
      if (call.recv_count % n != 0 || call.recv_count / n != call.send_count)
        return concat("recv has ", call.recv_count, " floats, expected size ", size, " x send ",
                      call.send_count);
      break;
    case Op::kReduceScatterSum:
      if (call.send_count % n != 0 || call.send_count / n != call.recv_count)
        return concat("send has ", call.send_count, " floats, expected size ", size, " x recv ",
                      call.recv_count);
      break;
    case Op::kAllToAllV: {
      std::string error = check_counts("send_counts", call.send_counts, size,
                                       static_cast<size_t>(call.send_count), "send");
      if (error.empty())
        error = check_counts("recv_counts", call.recv_counts, size,
                             static_cast<size_t>(call.recv_count), "recv");
      if (!error.empty()) return error;
      break;
    }
    case Op::kBroadcast:
      if (call.root < 0 || call.root >= size)
        return concat("root ", call.root, " is out of range [0, ", size, ")");
      if (call.recv_count != call.send_count)
        return concat("recv count ", call.recv_count, " differs from send count ", call.send_count,
                      " (broadcast works in place)");
      break;
    case Op::kBarrier:
      if (call.send_count != 0 || call.recv_count != 0)
        return concat("a barrier with ", call.send_count, " / ", call.recv_count, " floats");
      break;
  }
  const bool reads_data = call.op != Op::kBroadcast || call.root == rank;
  if (reads_data && call.send_count > 0 && call.send == nullptr)
    return concat("the call carries no data for its ", call.send_count, " floats");
  return "";
}

std::string rank_list(const std::vector<char>& selected, bool want) {
  std::string names;
  int count = 0;
  for (size_t r = 0; r < selected.size(); ++r) {
    if (static_cast<bool>(selected[r]) != want) continue;
    names += (count++ ? ", " : "") + std::to_string(r);
  }
  return (count == 1 ? "rank " : "ranks ") + names;
}

std::string check_calls(const std::vector<Call>& calls, uint64_t seq) {
  const int size = static_cast<int>(calls.size());
  const Call& first = calls[0];
  const char* name = op_name(first.op);
  for (int r = 1; r < size; ++r) {
    if (calls[r].op != first.op) {
      return concat("collective #", seq, ": rank ", r, " called ", op_name(calls[r].op),
                    ", expected ", name, " as called by rank 0 (every rank must call the same",
                    " collectives in the same order)");
    }
  }
  for (int r = 0; r < size; ++r) {
    if (!calls[r].local_error.empty()) {
      return concat(name, " at collective #", seq, ": rank ", r, ": ", calls[r].local_error);
    }
  }
  // The first rank whose `what` differs from rank 0's.
  auto same_on_all = [&](const char* what, auto value_of) -> std::string {
    for (int r = 1; r < size; ++r) {
      if (value_of(calls[r]) != value_of(first)) {
        return concat(name, " at collective #", seq, ": rank ", r, " has ", what, " ",
                      value_of(calls[r]), ", expected ", value_of(first), " as on rank 0");
      }
    }
    return "";
  };
  auto send_count = [](const Call& c) { return c.send_count; };
  switch (first.op) {
    case Op::kAllReduceSum: return same_on_all("count", send_count);
    case Op::kAllGather: return same_on_all("send count", send_count);
    case Op::kReduceScatterSum:
      return same_on_all("recv count", [](const Call& c) { return c.recv_count; });
    case Op::kBroadcast: {
      std::string error = same_on_all("root", [](const Call& c) { return c.root; });
      return error.empty() ? same_on_all("count", send_count) : error;
    }
    case Op::kAllToAllV:
      for (int from = 0; from < size; ++from) {
        for (int to = 0; to < size; ++to) {
          const int64_t sent = calls[from].send_counts[to];
          const int64_t expected = calls[to].recv_counts[from];
          if (sent == expected) continue;
          return concat(name, " at collective #", seq, ": rank ", from, " sends ", sent,
                        " floats to rank ", to, " but rank ", to, " expects ", expected,
                        " from rank ", from, " (send_counts[", to, "] on rank ", from,
                        " must equal recv_counts[", from, "] on rank ", to, ")");
        }
      }
      return "";
    case Op::kBarrier: return "";
  }
  return "";
}

size_t result_count(const Call& own, int size) {
  switch (own.op) {
    case Op::kAllReduceSum:
    case Op::kBroadcast: return own.send_count;
    case Op::kAllGather: return static_cast<size_t>(size) * own.send_count;
    case Op::kReduceScatterSum: return own.recv_count;
    case Op::kAllToAllV: {
      size_t total = 0;
      for (int64_t c : own.recv_counts) total += static_cast<size_t>(std::max<int64_t>(c, 0));
      return total;
    }
    case Op::kBarrier: return 0;
  }
  return 0;
}

void collective_result(const std::vector<Call>& calls, int rank, float* out) {
  const Call& own = calls[rank];
  const int size = static_cast<int>(calls.size());
  switch (own.op) {
    case Op::kAllReduceSum: sum_in_rank_order(calls, 0, own.send_count, out); return;
    case Op::kAllGather: {
      const size_t count = own.send_count;
      for (int r = 0; r < size; ++r) {
        float* block = out + size_t(r) * count;  // (count)
        if (calls[r].send != block) std::copy_n(calls[r].send, count, block);
      }
      return;
    }
    case Op::kReduceScatterSum:
      sum_in_rank_order(calls, size_t(rank) * own.recv_count, own.recv_count, out);
      return;
    case Op::kAllToAllV: {
      size_t recv_offset = 0;
      for (int from = 0; from < size; ++from) {
        const Call& sender = calls[from];
        size_t send_offset = 0;  // where the sender's block for this rank starts
        for (int r = 0; r < rank; ++r) send_offset += size_t(sender.send_counts[r]);
        const size_t count = size_t(own.recv_counts[from]);
        std::copy_n(sender.send + send_offset, count, out + recv_offset);
        recv_offset += count;
      }
      return;
    }
    case Op::kBroadcast:
      // Only the root's buffer is read, and the root does not write it.
      if (rank != own.root) std::copy_n(calls[own.root].send, own.send_count, out);
      return;
    case Op::kBarrier: return;
  }
}

}  // namespace moelora::dist::detail
