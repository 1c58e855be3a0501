// The payloads the ranks of a job send each other (socket_group.h, sharded_executor.h), encoded
// with tcp.h's ByteWriter and decoded with its checked ByteReader: a malformed payload (a
// stranger on the port, a corrupt stream, a rank of another build) is a kInvalidArgument error
// naming the message, never a crash or an unbounded allocation.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dist/collective_rules.h"
#include "dist/tcp.h"

namespace moelora::dist {

// A worker's introduction at the join.
struct JoinRequest {
  uint32_t version = 0;
  int32_t rank = -1;
  int32_t size = -1;
  std::string fingerprint;
};
inline constexpr uint32_t kProtocolVersion = 1;
std::vector<std::byte> encode_join(const JoinRequest& request);
// nullopt when the payload does not start with moelora's magic number (not one of ours).
std::optional<JoinRequest> decode_join(std::span<const std::byte> payload);

// One rank's call of a collective as it travels to rank 0 (the floats only where the collective
// reads them: not a broadcast's non-root buffers).
struct CollectiveMessage {
  detail::Op op = detail::Op::kBarrier;
  uint64_t seq = 0;
  uint64_t send_count = 0;
  uint64_t recv_count = 0;
  int32_t root = 0;
  std::string local_error;
  std::vector<int64_t> send_counts, recv_counts;
  std::vector<float> data;  // empty or send_count floats
};
// Header of `call` for collective #seq; the floats follow as the frame's body.
std::vector<std::byte> encode_collective_head(const detail::Call& call, uint64_t seq,
                                              uint64_t floats);
CollectiveMessage decode_collective(std::span<const std::byte> payload, int from);
// The Call that rank 0 checks and computes with; points into `m`.
detail::Call call_of(const CollectiveMessage& m);

// A step of the serving loop from rank 0 to the workers (sharded_executor.h).
struct ShardCommand {
  enum class Kind : uint8_t { kWriteSlot = 1, kClearSlot, kForward, kStop };
  struct Entry {
    int64_t sequence = -1;
    int32_t slot = -1;
    std::vector<int32_t> tokens;
  };
  Kind kind = Kind::kStop;
  std::vector<int64_t> frees;  // sequences rank 0 freed since the last command
  int32_t slot = -1;           // write / clear
  std::string adapter_name;    // write
  std::string adapter_dir;     // write
  int64_t max_lora_rank = 0;   // write
  std::vector<Entry> entries;  // forward
};
std::vector<std::byte> encode_command(const ShardCommand& command);
ShardCommand decode_command(std::span<const std::byte> payload);

}  // namespace moelora::dist
