// Encoding and checked decoding of the ranks' messages (messages.h).
#include "dist/messages.h"

#include "core/error.h"

namespace moelora::dist {

namespace {

using ::moelora::detail::concat;

constexpr uint64_t kMagic = 0x7473696461726f6cULL;  // "loradist"

}  // namespace

std::vector<std::byte> encode_join(const JoinRequest& r) {
  ByteWriter out;
  out.put(kMagic).put(r.version).put(r.rank).put(r.size).put_string(r.fingerprint);
  return out.take();
}

std::optional<JoinRequest> decode_join(std::span<const std::byte> payload) {
  ByteReader in(payload, "a join request");
  if (payload.size() < sizeof(uint64_t) || in.get<uint64_t>() != kMagic) return std::nullopt;
  JoinRequest r;
  r.version = in.get<uint32_t>();
  r.rank = in.get<int32_t>();
  r.size = in.get<int32_t>();
  r.fingerprint = in.get_string();
  MOELORA_CHECK(in.remaining() == 0, ErrorCode::kInvalidArgument, "a join request has ",
                in.remaining(), " bytes after its end");
  return r;
}

std::vector<std::byte> encode_collective_head(const detail::Call& call, uint64_t seq,
                                              uint64_t floats) {
  ByteWriter head;
  head.put(static_cast<uint8_t>(call.op)).put(seq).put<uint64_t>(call.send_count);
  head.put<uint64_t>(call.recv_count).put<int32_t>(call.root).put_string(call.local_error);
  head.put_vector(call.send_counts).put_vector(call.recv_counts);
  head.put<uint64_t>(floats);  // the body is read as a vector of this many floats
  return head.take();
}

CollectiveMessage decode_collective(std::span<const std::byte> payload, int from) {
  const std::string what = concat("the collective call of rank ", from);
  ByteReader in(payload, what);
  CollectiveMessage m;
  const auto op = in.get<uint8_t>();
  MOELORA_CHECK(op < detail::kNumOps, ErrorCode::kInvalidArgument, what, " names collective ",
                int(op), ", which does not exist");
  m.op = static_cast<detail::Op>(op);
  m.seq = in.get<uint64_t>();
  m.send_count = in.get<uint64_t>();
  m.recv_count = in.get<uint64_t>();
  m.root = in.get<int32_t>();
  m.local_error = in.get_string();
  m.send_counts = in.get_vector<int64_t>();
  m.recv_counts = in.get_vector<int64_t>();
  m.data = in.get_vector<float>();
  MOELORA_CHECK(m.data.empty() || m.data.size() == m.send_count, ErrorCode::kInvalidArgument, what,
                " carries ", m.data.size(), " floats for a send count of ", m.send_count);
  MOELORA_CHECK(in.remaining() == 0, ErrorCode::kInvalidArgument, what, " has ", in.remaining(),
                " bytes after its end");
  return m;
}

detail::Call call_of(const CollectiveMessage& m) {
  detail::Call call;
  call.op = m.op;
  call.send = m.data.empty() ? nullptr : m.data.data();
  call.send_count = m.send_count;
  call.recv_count = m.recv_count;
  call.send_counts = m.send_counts;
  call.recv_counts = m.recv_counts;
  call.root = m.root;
  call.local_error = m.local_error;
  return call;
}

std::vector<std::byte> encode_command(const ShardCommand& c) {
  ByteWriter out;
  out.put(static_cast<uint8_t>(c.kind)).put_vector(std::span<const int64_t>(c.frees));
  switch (c.kind) {
    case ShardCommand::Kind::kWriteSlot:
      out.put(c.slot).put_string(c.adapter_name).put_string(c.adapter_dir).put(c.max_lora_rank);
      break;
    case ShardCommand::Kind::kClearSlot: out.put(c.slot); break;
    case ShardCommand::Kind::kForward:
      out.put<uint64_t>(c.entries.size());
      for (const ShardCommand::Entry& e : c.entries)
        out.put(e.sequence).put(e.slot).put_vector(std::span<const int32_t>(e.tokens));
      break;
    case ShardCommand::Kind::kStop: break;
  }
  return out.take();
}

ShardCommand decode_command(std::span<const std::byte> payload) {
  ByteReader in(payload, "a command from rank 0");
  ShardCommand c;
  const auto kind = in.get<uint8_t>();
  MOELORA_CHECK(kind >= 1 && kind <= 4, ErrorCode::kInvalidArgument,
                "a command from rank 0 has unknown kind ", int(kind),
                ": are all ranks the same moelora build?");
  c.kind = static_cast<ShardCommand::Kind>(kind);
  c.frees = in.get_vector<int64_t>();
  switch (c.kind) {
    case ShardCommand::Kind::kWriteSlot:
      c.slot = in.get<int32_t>();
      c.adapter_name = in.get_string();
      c.adapter_dir = in.get_string();
      c.max_lora_rank = in.get<int64_t>();
      break;
    case ShardCommand::Kind::kClearSlot: c.slot = in.get<int32_t>(); break;
    case ShardCommand::Kind::kForward: {
      const auto count = in.get<uint64_t>();
      // Each entry takes at least 20 bytes: a count beyond that is a lie, not an allocation.
      MOELORA_CHECK(count <= in.remaining() / 20, ErrorCode::kInvalidArgument,
                    "a forward command announces ", count, " entries in ", in.remaining(),
                    " bytes");
      c.entries.resize(count);
      for (ShardCommand::Entry& e : c.entries) {
        e.sequence = in.get<int64_t>();
        e.slot = in.get<int32_t>();
        e.tokens = in.get_vector<int32_t>();
      }
      break;
    }
    case ShardCommand::Kind::kStop: break;
  }
  MOELORA_CHECK(in.remaining() == 0, ErrorCode::kInvalidArgument, "a command from rank 0 has ",
                in.remaining(), " bytes after its end");
  return c;
}

}  // namespace moelora::dist
