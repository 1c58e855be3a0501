// The messages ranks send each other over TCP (dist/messages.h): the first input byte picks the
// decoder (0: a join request, 1: a collective call, 2: a serving command), the rest is the
// payload. A payload that decodes is encoded again and must decode to the same message, and a
// collective call goes through rank 0's checks of a remote call; anything else must end in
// moelora::Error, without a crash or an allocation the payload did not pay for.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>

#include "core/error.h"
#include "dist/messages.h"

namespace {

using namespace moelora;
using namespace moelora::dist;

void require(bool ok) {
  if (!ok) std::abort();  // a round trip that changed the message: a finding
}

void join(std::span<const std::byte> payload) {
  const std::optional<JoinRequest> r = decode_join(payload);
  if (!r) return;
  const std::vector<std::byte> again = encode_join(*r);
  require(again.size() == payload.size() &&
          std::memcmp(again.data(), payload.data(), payload.size()) == 0);
}

void collective(std::span<const std::byte> payload) {
  const CollectiveMessage m = decode_collective(payload, 1);
  const dist::detail::Call call = call_of(m);
  // What rank 0 checks before it trusts the counts; an accepted call's result fits its data.
  if (dist::detail::check_remote_call(call, 1, 2).empty() &&
      call.op == dist::detail::Op::kAllToAllV) {
    uint64_t sent = 0;
    for (int64_t c : call.send_counts) sent += static_cast<uint64_t>(c);
    require(sent <= call.send_count && (call.send_count == 0 || call.send != nullptr));
  }
  std::vector<std::byte> again = encode_collective_head(call, m.seq, m.data.size());
  const auto* floats = reinterpret_cast<const std::byte*>(m.data.data());
  again.insert(again.end(), floats, floats + m.data.size() * sizeof(float));
  require(again.size() == payload.size() &&
          std::memcmp(again.data(), payload.data(), payload.size()) == 0);
}

void command(std::span<const std::byte> payload) {
  const ShardCommand c = decode_command(payload);
  const std::vector<std::byte> again = encode_command(c);
  require(again.size() == payload.size() &&
          std::memcmp(again.data(), payload.data(), payload.size()) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(data + 1), size - 1);
  try {
    switch (data[0] % 3) {
      case 0: join(payload); break;
      case 1: collective(payload); break;
      default: command(payload); break;
    }
  } catch (const Error&) {
  }
  return 0;
}
