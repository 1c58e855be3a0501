// Ranks in separate processes over TCP (socket_group.h).
//
// Wire protocol (frames of tcp.h; every rank talks only to rank 0, a star):
//   join      worker -> 0  kHello {magic, version, rank, size, fingerprint}
//             0 -> worker  kWelcome {welcome} once all ranks are in, or kReject {reason}
//   step      0 -> worker  kCommand {bytes}; worker -> 0 kReply {error, "" = done}
//   collective worker -> 0  kCall {op, seq, counts, root, local error, floats}
//             0 -> worker  kResult {floats} or kVerdict {why the calls disagree}
//   any time  kAbort {reason}: the sender broke the group
#include "dist/socket_group.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "dist/messages.h"

namespace moelora::dist {

namespace {

using detail::Op;
using ::moelora::detail::concat;

enum Tag : uint32_t {
  kHello = 1,
  kWelcome,
  kReject,
  kCommand,
  kReply,
  kCall,
  kResult,
  kVerdict,
  kAbort,
};

const char* tag_name(uint32_t tag) {
  switch (tag) {
    case kHello: return "hello";
    case kWelcome: return "welcome";
    case kReject: return "reject";
    case kCommand: return "command";
    case kReply: return "reply";
    case kCall: return "collective call";
    case kResult: return "collective result";
    case kVerdict: return "collective verdict";
    case kAbort: return "abort";
    default: return "unknown frame";
  }
}

// A join request is a fingerprint of a few hundred bytes; a stranger announcing more is dropped
// without reading it.
constexpr uint64_t kMaxJoinPayload = 64 * 1024;

// Appends what `connection` has to read now, without waiting, to `bytes` (at most `limit` in
// all). False when the peer closed the connection or it failed.
bool read_available(const Connection& connection, std::vector<std::byte>& bytes, size_t limit) {
  std::byte chunk[4096];
  while (bytes.size() < limit) {
    const ssize_t got =
        ::recv(connection.fd(), chunk, std::min(sizeof(chunk), limit - bytes.size()), MSG_DONTWAIT);
    if (got > 0) {
      bytes.insert(bytes.end(), chunk, chunk + got);
      continue;
    }
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (got < 0 && errno == EINTR) continue;
    return false;  // closed (0) or broken
  }
  return true;
}

// The frame at the start of `bytes` once all of it has arrived, else nullopt; kInvalidArgument
// for a length beyond max_payload.
std::optional<Frame> complete_frame(const std::vector<std::byte>& bytes, uint64_t max_payload) {
  if (bytes.size() < kFrameHeaderBytes) return std::nullopt;
  const auto [tag, length] = read_frame_header(bytes.data());
  Frame frame;
  frame.tag = tag;
  MOELORA_CHECK(length <= max_payload, ErrorCode::kInvalidArgument, "a join frame announces ",
                length, " bytes, more than the ", max_payload, " a join request may have");
  if (bytes.size() < kFrameHeaderBytes + length) return std::nullopt;
  frame.payload.assign(bytes.begin() + kFrameHeaderBytes,
                       bytes.begin() + static_cast<std::ptrdiff_t>(kFrameHeaderBytes + length));
  return frame;
}

std::span<const std::byte> as_bytes(const std::string& s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

std::string text_of(const Frame& frame) {
  return std::string(reinterpret_cast<const char*>(frame.payload.data()), frame.payload.size());
}

std::string peer_name(int rank, const std::string& address) {
  return concat("rank ", rank, " (", address, ")");
}

// The abort message `peer` sent before it closed, if one is waiting: a send that failed because
// the peer broke the group is reported with the peer's cause.
std::string pending_abort(Connection& peer) {
  try {
    if (!peer.readable()) return "";
    // Readable: the frame (or the close) is there or on its way; give its pieces a moment.
    std::optional<Frame> frame = peer.receive(Clock::now() + std::chrono::milliseconds(200));
    if (frame && frame->tag == kAbort) return text_of(*frame);
  } catch (const Error&) {  // nothing readable: the plain error stands
  }
  return "";
}

}  // namespace

SocketGroup::SocketGroup(int rank, int size, std::chrono::milliseconds collective_timeout)
    : rank_(rank), size_(size), collective_timeout_(collective_timeout) {}

SocketGroup::~SocketGroup() = default;

std::unique_ptr<SocketGroup> SocketGroup::join(const SocketGroupOptions& o) {
  MOELORA_CHECK(o.size >= 1 && o.rank >= 0 && o.rank < o.size, ErrorCode::kInvalidArgument,
                "process group: rank ", o.rank, " of ", o.size, " is not a rank of the group");
  MOELORA_CHECK(o.join_timeout.count() > 0 && o.collective_timeout.count() > 0,
                ErrorCode::kInvalidArgument, "process group: timeouts must be positive (join ",
                o.join_timeout.count(), " ms, collective ", o.collective_timeout.count(), " ms)");
  std::unique_ptr<SocketGroup> group(new SocketGroup(o.rank, o.size, o.collective_timeout));
  const Clock::time_point deadline = Clock::now() + o.join_timeout;
  const std::string join_seconds = concat(o.join_timeout.count() / 1000.0, " s");

  if (o.rank != 0) {
    Connection root = connect_until(o.address, deadline);
    root.set_peer(peer_name(0, o.address.text()));
    root.send(kHello, encode_join({kProtocolVersion, o.rank, o.size, o.fingerprint}));
    // Rank 0 refuses the group at the same deadline; wait a little longer to hear why.
    const auto slack =
        std::min<std::chrono::milliseconds>(o.join_timeout, std::chrono::seconds(10));
    std::optional<Frame> answer = root.receive(deadline + slack);
    MOELORA_CHECK(answer.has_value(), ErrorCode::kInternal, "rank ", o.rank, ": rank 0 at ",
                  o.address.text(), " did not admit the group within the ", join_seconds,
                  " join timeout");
    MOELORA_CHECK(answer->tag != kReject, ErrorCode::kInvalidArgument, "rank ", o.rank,
                  ": rank 0 refused the group: ", text_of(*answer));
    MOELORA_CHECK(answer->tag == kWelcome, ErrorCode::kInternal, "rank ", o.rank, ": rank 0 at ",
                  o.address.text(), " answered the join with a ", tag_name(answer->tag),
                  " frame: is that a moelora rank 0 of the same version?");
    group->welcome_ = text_of(*answer);
    group->peers_.push_back(std::move(root));
    return group;
  }

  group->welcome_ = o.welcome;
  group->peers_.resize(static_cast<size_t>(o.size));
  if (o.size == 1) {
    if (o.listen_fd >= 0) Listener::adopt(o.listen_fd).close();  // nobody will join
    return group;
  }
  Listener listener = o.listen_fd >= 0 ? Listener::adopt(o.listen_fd) : Listener::bind(o.address);
  std::vector<char> joined(static_cast<size_t>(o.size), 0);
  joined[0] = 1;
  int missing = o.size - 1;
  // Refuses every rank admitted so far with `reason` and throws it.
  auto refuse_all = [&](const std::string& reason) {
    for (Connection& c : group->peers_) {
      if (!c.valid()) continue;
      try {
        c.send(kReject, as_bytes(reason));
      } catch (const Error&) {  // that rank is gone already; the others still hear it
      }
    }
    MOELORA_THROW(ErrorCode::kInvalidArgument, reason);
  };
  // Connections that have not introduced themselves yet, each with the time it gets to do so.
  // They are watched together with the listener, so a slow or silent one (a port scanner, a
  // health check) delays nobody else.
  struct Pending {
    Connection connection;
    Clock::time_point until;
    std::vector<std::byte> bytes;  // what it sent so far: the frame is read without blocking
  };
  constexpr size_t kMaxPending = 64;  // beyond it the oldest stranger is dropped
  std::vector<Pending> pending;
  // Handles one complete join request from `incoming`: admits the rank, ignores a stranger,
  // or refuses the group (throws).
  auto admit = [&](Connection incoming, const Frame& hello) {
    if (hello.tag != kHello) return;
    std::optional<JoinRequest> request;
    try {
      request = decode_join(hello.payload);
    } catch (const Error&) {
      return;
    }
    if (!request) return;
    if (request->version != kProtocolVersion) {
      try {
        incoming.send(kReject,
                      as_bytes(concat("protocol version ", request->version, ", rank 0 speaks ",
                                      kProtocolVersion, ": run one moelora build everywhere")));
      } catch (const Error&) {
      }
      return;
    }
    const int32_t rank = request->rank, size = request->size;
    const std::string& fingerprint = request->fingerprint;
    const std::string who = concat("rank ", rank, " (from ", incoming.peer(), ")");
    incoming.set_peer(peer_name(rank, incoming.peer()));
    const bool in_range = rank >= 1 && rank < o.size;
    const bool duplicate = in_range && joined[static_cast<size_t>(rank)];
    std::string problem;
    if (size != o.size)
      problem = concat(who, " expects a group of ", size, " ranks, rank 0 of ", o.size);
    else if (!in_range)
      problem = concat(who, " is not a worker rank of a group of ", o.size);
    else if (duplicate)
      problem = concat(who,
                       " joined twice: two processes were given the same rank (check "
                       "--node-rank on every node)");
    else if (fingerprint != o.fingerprint)
      problem = concat(who, " runs something else than rank 0: rank 0 '", o.fingerprint, "', rank ",
                       rank, " '", fingerprint, "' (every rank needs the same model and options)");
    if (!problem.empty()) {
      try {
        incoming.send(kReject, as_bytes(problem));
      } catch (const Error&) {
      }
      refuse_all(problem);
    }
    group->peers_[static_cast<size_t>(rank)] = std::move(incoming);
    joined[static_cast<size_t>(rank)] = 1;
    --missing;
  };
  while (missing > 0) {
    const Clock::time_point now = Clock::now();
    if (now >= deadline) {
      refuse_all(concat(detail::rank_list(joined, false), " of ", o.size, " did not join ",
                        o.address.text(), " within the ", join_seconds, " join timeout (",
                        detail::rank_list(joined, true),
                        " joined); start them, or check --nnodes, --node-rank and "
                        "--dist-init-addr on every node"));
    }
    // Strangers whose time is up are dropped.
    std::erase_if(pending, [&](const Pending& p) { return p.until <= now; });
    std::vector<pollfd> watched = {{listener.fd(), POLLIN, 0}};
    for (const Pending& p : pending) watched.push_back({p.connection.fd(), POLLIN, 0});
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    const int ready = ::poll(watched.data(), watched.size(),
                             static_cast<int>(std::clamp<int64_t>(wait.count(), 0, 100)));
    if (ready < 0 && errno != EINTR)
      MOELORA_THROW(ErrorCode::kInternal, "waiting for ranks to join ", o.address.text(),
                    " failed: ", std::strerror(errno));
    if (ready <= 0) continue;  // EINTR or nothing yet: look at the clock again
    // Newest first, so erasing one leaves the indices of those still to visit alone.
    for (size_t i = watched.size() - 1; i >= 1; --i) {
      if (watched[i].revents == 0) continue;
      Pending& p = pending[i - 1];
      bool drop = false;
      std::optional<Frame> hello;
      try {
        drop = !read_available(p.connection, p.bytes, kFrameHeaderBytes + kMaxJoinPayload);
        if (!drop) hello = complete_frame(p.bytes, kMaxJoinPayload);
      } catch (const Error&) {  // a length beyond a join request's: a stranger
        drop = true;
      }
      if (!drop && !hello) continue;  // part of a frame so far
      Connection connection = std::move(p.connection);
      pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i - 1));
      if (hello) admit(std::move(connection), *hello);
    }
    if (watched[0].revents != 0) {
      std::optional<Connection> c;
      try {
        c = listener.accept(Clock::now());
      } catch (const Error&) {  // out of descriptors for a moment: the next round tries again
      }
      // A rank sends its request right after connecting; a stranger gets this long.
      if (c) {
        if (pending.size() == kMaxPending) pending.erase(pending.begin());
        pending.push_back({std::move(*c), Clock::now() + std::chrono::seconds(3), {}});
      }
    }
  }
  for (int r = 1; r < o.size; ++r)
    group->peers_[static_cast<size_t>(r)].send(kWelcome, as_bytes(o.welcome));
  return group;
}

void SocketGroup::check_usable(const char* what) const {
  if (!broken_.load()) return;
  std::lock_guard<std::mutex> lock(reason_mutex_);
  MOELORA_THROW(ErrorCode::kInternal, what, " on rank ", rank_,
                ": the process group is broken: ", reason_);
}

void SocketGroup::fail(const std::string& reason) {
  std::string first;
  {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    if (reason_.empty()) reason_ = reason;
    first = reason_;  // after an abort() from another thread, its reason is the cause
  }
  if (!broken_.exchange(true)) {
    const std::string message = concat("rank ", rank_, ": ", first);
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(1);
    for (Connection& c : peers_) {
      if (!c.valid()) continue;
      try {
        c.send(kAbort, as_bytes(message), {}, deadline);
      } catch (const Error&) {  // that peer is gone; tell the rest
      }
      c.shutdown();
    }
  }
  MOELORA_THROW(ErrorCode::kInternal, first);
}

void SocketGroup::break_group(const std::string& reason) {
  try {
    fail(reason);
  } catch (const Error&) {  // fail() always throws; the caller has its own error to report
  }
}

void SocketGroup::check_peers() {
  if (broken_.load() || rank_ != 0) return;
  for (int r = 1; r < size_; ++r) {
    Connection& peer = peers_[static_cast<size_t>(r)];
    if (!peer.readable()) continue;
    std::string cause;
    try {
      // Readable: an abort frame, a stray frame or the close; give a frame's pieces a second.
      std::optional<Frame> frame = peer.receive(Clock::now() + std::chrono::seconds(1));
      if (frame && frame->tag == kAbort)
        cause = "the group was aborted by " + text_of(*frame);
      else if (frame)
        cause = concat("rank ", r, " sent a ", tag_name(frame->tag), " frame between commands");
    } catch (const Error& e) {
      cause = concat("between commands: ", e.what());
    }
    if (!cause.empty()) return break_group(cause);
  }
}

std::string SocketGroup::failure() const {
  std::lock_guard<std::mutex> lock(reason_mutex_);
  return reason_;
}

void SocketGroup::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(reason_mutex_);
    if (reason_.empty()) reason_ = concat("aborted on rank ", rank_, ": ", reason);
  }
  if (!broken_.exchange(true)) {
    for (Connection& c : peers_) c.shutdown();
  }
}

void SocketGroup::unexpected(const Frame& frame, int from, const char* expected) {
  if (frame.tag == kAbort) fail(concat("the group was aborted by ", text_of(frame)));
  if (frame.tag == kReply && !frame.payload.empty())
    fail(concat("rank ", from, " failed: ", text_of(frame)));
  fail(concat("rank ", from, " sent a ", tag_name(frame.tag), " frame where a ", expected,
              " was expected: the ranks disagree about the program (every rank must run the "
              "same commands and collectives in the same order)"));
}

void SocketGroup::send_command(std::span<const std::byte> command) {
  check_usable("send_command");
  MOELORA_CHECK(rank_ == 0, ErrorCode::kInternal, "send_command on rank ", rank_,
                ": only rank 0 sends commands");
  const Clock::time_point deadline = Clock::now() + collective_timeout_;
  for (int r = 1; r < size_; ++r) {
    try {
      peers_[static_cast<size_t>(r)].send(kCommand, command, {}, deadline);
    } catch (const Error& e) {
      fail(concat("sending a command to rank ", r, ": ", e.what()));
    }
  }
}

std::vector<std::byte> SocketGroup::receive_command() {
  check_usable("receive_command");
  MOELORA_CHECK(rank_ != 0, ErrorCode::kInternal,
                "receive_command on rank 0: rank 0 sends the commands, the workers receive them");
  std::optional<Frame> frame;
  try {
    frame = peers_[0].receive(std::nullopt);
  } catch (const Error& e) {
    fail(e.what());
  }
  if (frame->tag != kCommand) unexpected(*frame, 0, "command");
  return std::move(frame->payload);
}

void SocketGroup::send_reply(const std::string& error) {
  check_usable("send_reply");
  try {
    peers_[0].send(kReply, as_bytes(error), {}, Clock::now() + collective_timeout_);
  } catch (const Error& e) {
    const std::string cause = pending_abort(peers_[0]);
    fail(cause.empty() ? std::string(e.what()) : "the group was aborted by " + cause);
  }
}

void SocketGroup::collect_replies(const std::string& what,
                                  std::optional<std::chrono::milliseconds> timeout) {
  check_usable("collect_replies");
  const std::chrono::milliseconds wait = timeout.value_or(collective_timeout_);
  const Clock::time_point deadline = Clock::now() + wait;
  std::string failures;
  for (int r = 1; r < size_; ++r) {
    std::optional<Frame> frame;
    try {
      frame = peers_[static_cast<size_t>(r)].receive(deadline);
    } catch (const Error& e) {
      fail(concat(what, ": ", e.what()));
    }
    if (!frame)
      fail(concat("rank ", r, " did not finish ", what, " within the ", wait.count(),
                  " ms timeout"));
    if (frame->tag != kReply) unexpected(*frame, r, "reply");
    if (!frame->payload.empty())
      failures += concat(failures.empty() ? "" : "; ", "rank ", r, ": ", text_of(*frame));
  }
  MOELORA_CHECK(failures.empty(), ErrorCode::kInternal, failures);
}

void SocketGroup::run(const detail::Call& call, float* out) {
  const char* name = detail::op_name(call.op);
  check_usable(name);
  const uint64_t seq = next_seq_++;
  const Clock::time_point deadline = Clock::now() + collective_timeout_;
  if (rank_ != 0) {
    const bool carries_data = call.op != Op::kBroadcast || call.root == rank_;
    const size_t floats = carries_data ? call.send_count : 0;
    const std::vector<std::byte> head = encode_collective_head(call, seq, floats);
    std::optional<Frame> answer;
    try {
      peers_[0].send(kCall, head, std::as_bytes(std::span<const float>(call.send, floats)),
                     deadline);
      // Rank 0 may wait up to its own timeout for a later rank before it answers.
      answer = peers_[0].receive(deadline + collective_timeout_);
    } catch (const Error& e) {
      const std::string cause = pending_abort(peers_[0]);
      fail(concat(name, " at collective #", seq, ": ",
                  cause.empty() ? std::string(e.what()) : "the group was aborted by " + cause));
    }
    if (!answer)
      fail(concat(name, " at collective #", seq, ": rank 0 did not answer within twice the ",
                  collective_timeout_.count(), " ms timeout"));
    if (answer->tag == kVerdict) MOELORA_THROW(ErrorCode::kInvalidArgument, text_of(*answer));
    if (answer->tag != kResult) unexpected(*answer, 0, "collective result");
    const size_t expected = detail::result_count(call, size_);
    if (answer->payload.size() != expected * sizeof(float))
      fail(concat(name, " at collective #", seq, ": rank 0 sent ", answer->payload.size(),
                  " bytes, expected ", expected * sizeof(float), " (", expected, " floats)"));
    if ((call.op != Op::kBroadcast || call.root != rank_) && !answer->payload.empty())
      std::memcpy(out, answer->payload.data(), answer->payload.size());
    return;
  }

  // Rank 0 gathers every call, checks them together and answers each rank.
  std::vector<CollectiveMessage> wire(static_cast<size_t>(size_));
  std::vector<detail::Call> calls(static_cast<size_t>(size_));
  calls[0] = call;
  std::vector<char> arrived(static_cast<size_t>(size_), 0);
  arrived[0] = 1;
  for (int r = 1; r < size_; ++r) {
    std::optional<Frame> frame;
    try {
      frame = peers_[static_cast<size_t>(r)].receive(deadline);
    } catch (const Error& e) {
      fail(concat(name, " at collective #", seq, ": ", e.what()));
    }
    if (!frame) {
      std::vector<char> late = arrived;
      for (int q = r; q < size_; ++q) late[static_cast<size_t>(q)] = 0;
      fail(concat(name, " at collective #", seq, ": rank ", r, " did not arrive within the ",
                  collective_timeout_.count(), " ms timeout (", detail::rank_list(late, true),
                  " waiting); the group is aborted"));
    }
    if (frame->tag != kCall) unexpected(*frame, r, "collective call");
    try {
      wire[static_cast<size_t>(r)] = decode_collective(frame->payload, r);
    } catch (const Error& e) {
      fail(e.what());
    }
    detail::Call& remote = calls[static_cast<size_t>(r)];
    remote = call_of(wire[static_cast<size_t>(r)]);
    if (remote.local_error.empty())
      remote.local_error = detail::check_remote_call(remote, r, size_);
    arrived[static_cast<size_t>(r)] = 1;
    if (wire[static_cast<size_t>(r)].seq != seq)
      fail(concat(name, ": rank ", r, " is at collective #", wire[static_cast<size_t>(r)].seq,
                  " while rank 0 is at #", seq));
  }
  const std::string verdict = detail::check_calls(calls, seq);
  if (!verdict.empty()) {
    for (int r = 1; r < size_; ++r) {
      try {
        peers_[static_cast<size_t>(r)].send(kVerdict, as_bytes(verdict), {}, deadline);
      } catch (const Error& e) {
        fail(concat(name, " at collective #", seq, ": ", e.what()));
      }
    }
    MOELORA_THROW(ErrorCode::kInvalidArgument, verdict);
  }
  std::vector<float> result;
  for (int r = 1; r < size_; ++r) {
    try {
      result.assign(detail::result_count(calls[static_cast<size_t>(r)], size_), 0.0f);
      detail::collective_result(calls, r, result.data());
    } catch (const std::exception& e) {  // memory for the result: the group cannot go on
      fail(concat(name, " at collective #", seq, ": the result for rank ", r, ": ", e.what()));
    }
    try {
      peers_[static_cast<size_t>(r)].send(kResult, std::as_bytes(std::span<const float>(result)),
                                          {}, deadline + collective_timeout_);
    } catch (const Error& e) {
      fail(concat(name, " at collective #", seq, ": ", e.what()));
    }
  }
  if (call.op == Op::kBroadcast && call.root == 0) return;
  // Into scratch first: rank 0's own buffers are calls[0]'s inputs (all_reduce is in place).
  scratch_.assign(detail::result_count(calls[0], size_), 0.0f);
  detail::collective_result(calls, 0, scratch_.data());
  std::copy(scratch_.begin(), scratch_.end(), out);
}

void SocketGroup::all_reduce_sum(std::span<float> inout) {
  run(detail::all_reduce_call(inout), inout.data());
}

void SocketGroup::all_gather(std::span<const float> send, std::span<float> recv) {
  run(detail::all_gather_call(send, recv, rank_, size_), recv.data());
}

void SocketGroup::reduce_scatter_sum(std::span<const float> send, std::span<float> recv) {
  run(detail::reduce_scatter_call(send, recv, rank_, size_), recv.data());
}

void SocketGroup::all_to_all_v(std::span<const float> send, std::span<const int64_t> send_counts,
                               std::span<float> recv, std::span<const int64_t> recv_counts) {
  run(detail::all_to_all_call(send, send_counts, recv, recv_counts, size_), recv.data());
}

void SocketGroup::broadcast(std::span<float> buf, int root) {
  run(detail::broadcast_call(buf, root, size_), buf.data());
}

void SocketGroup::barrier() {
  run(detail::barrier_call(), nullptr);
}

}  // namespace moelora::dist
