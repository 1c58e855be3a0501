// Framed messages over TCP between the processes of one serving job (socket_group.h): the
// control plane of every multi-process run (which rank joins, the commands of each step, the
// NCCL unique id), and the CPU backend's collectives.
//
// A frame is [tag u32][payload length u64][payload], little-endian as the hosts are. Every wait
// takes a deadline (none where waiting is the point: a worker between steps; TCP keepalive then
// notices a peer whose host vanished), and a peer that closes its end turns a send or a receive
// into an error that names it, never a hang or a SIGPIPE.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

namespace moelora::dist {

using Clock = std::chrono::steady_clock;

// Longest payload a receive accepts; a longer length is a corrupt or foreign stream.
inline constexpr uint64_t kMaxFramePayload = uint64_t{8} << 30;

struct Frame {
  uint32_t tag = 0;
  std::vector<std::byte> payload;
};

// A frame on the wire: tag u32, payload length u64 (host order: both ends are one build), payload.
inline constexpr size_t kFrameHeaderBytes = 12;
struct FrameHeader {
  uint32_t tag = 0;
  uint64_t length = 0;
};
// The header in its kFrameHeaderBytes wire bytes, and back.
void write_frame_header(const FrameHeader& header, std::byte* out);
FrameHeader read_frame_header(const std::byte* bytes);

// "HOST:PORT" (a name, an IPv4 address or a bracketed IPv6 address). kInvalidArgument naming
// `what` (the flag) and the text when it is not one.
struct HostPort {
  std::string host;
  int port = 0;
  std::string text() const;
};
HostPort parse_host_port(const std::string& text, const std::string& what);

class Connection {
 public:
  Connection() = default;
  Connection(int fd, std::string peer);  // takes the socket
  ~Connection();
  Connection(Connection&& other) noexcept;
  Connection& operator=(Connection&& other) noexcept;
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  // What errors call the other end ("rank 2 (127.0.0.1:41234)"); set by the owner.
  const std::string& peer() const { return peer_; }
  void set_peer(std::string peer) { peer_ = std::move(peer); }

  // One frame whose payload is head followed by body. Throws kInternal naming the peer when the
  // connection is closed or broken, or when the peer stops reading and the frame is not out by
  // the deadline (nullopt: no deadline; the keepalive still ends it when the peer's host is gone).
  void send(uint32_t tag, std::span<const std::byte> head, std::span<const std::byte> body = {},
            std::optional<Clock::time_point> deadline = std::nullopt);
  // The next frame, or nullopt when the deadline passes first (nullopt deadline: wait as long as
  // it takes). Throws kInternal naming the peer when it closed the connection, and
  // kInvalidArgument for a frame longer than max_payload (the buffer grows only as the bytes
  // arrive). A frame cut off by the deadline leaves the stream unusable: the caller treats the
  // connection as broken.
  std::optional<Frame> receive(std::optional<Clock::time_point> deadline,
                               uint64_t max_payload = kMaxFramePayload);

  // Whether a receive would return at once (data, or the peer's close) without waiting.
  bool readable() const;
  // Wakes a receive blocked on another thread (it fails as closed); the socket stays open until
  // the destructor or close().
  void shutdown();
  void close();

 private:
  // Reads exactly n bytes; false at the deadline.
  bool read_exact(std::byte* out, size_t n, std::optional<Clock::time_point> deadline);

  int fd_ = -1;
  std::string peer_;
};

class Listener {
 public:
  Listener() = default;
  // Listens on host:port (port 0: any free port). kInvalidArgument naming the address when it
  // cannot (in use, not an address of this machine).
  static Listener bind(const HostPort& address);
  // A listening socket opened by another process and inherited (the launcher binds the
  // rendezvous port before it starts the ranks, so the port cannot be taken in between).
  static Listener adopt(int fd);
  ~Listener();
  Listener(Listener&& other) noexcept;
  Listener& operator=(Listener&& other) noexcept;
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  bool valid() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  int port() const;
  // The next connection, or nullopt at the deadline.
  std::optional<Connection> accept(Clock::time_point deadline);
  void close();

 private:
  int fd_ = -1;
};

// Connects to address, retrying while nobody listens there yet (the other process may still be
// starting) until the deadline. kInternal naming the address and the last error at the deadline.
Connection connect_until(const HostPort& address, Clock::time_point deadline);

// Little-endian payload building and checked reading. A read past the end throws
// kInvalidArgument naming `what` (the frame being decoded): a malformed frame is an error, not a
// crash.
class ByteWriter {
 public:
  template <typename T>
  ByteWriter& put(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>);
    append(&value, sizeof(T));
    return *this;
  }
  ByteWriter& put_string(const std::string& s);
  template <typename T>
  ByteWriter& put_vector(std::span<const T> values) {
    static_assert(std::is_trivially_copyable_v<T>);
    put<uint64_t>(values.size());
    append(values.data(), values.size_bytes());
    return *this;
  }
  const std::vector<std::byte>& bytes() const { return bytes_; }
  std::vector<std::byte> take() { return std::move(bytes_); }

 private:
  void append(const void* data, size_t n);

  std::vector<std::byte> bytes_;
};

class ByteReader {
 public:
  ByteReader(std::span<const std::byte> bytes, std::string what)
      : bytes_(bytes), what_(std::move(what)) {}
  template <typename T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    T value;
    std::memcpy(&value, take(sizeof(T)), sizeof(T));
    return value;
  }
  std::string get_string();
  template <typename T>
  std::vector<T> get_vector() {
    const uint64_t n = get<uint64_t>();
    check_available(n, sizeof(T));
    std::vector<T> values(n);
    if (n > 0) std::memcpy(values.data(), take(n * sizeof(T)), n * sizeof(T));
    return values;
  }
  size_t remaining() const { return bytes_.size() - offset_; }

 private:
  const std::byte* take(size_t n);
  void check_available(uint64_t count, size_t item_size) const;

  std::span<const std::byte> bytes_;
  size_t offset_ = 0;
  std::string what_;
};

}  // namespace moelora::dist
