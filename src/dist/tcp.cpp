// Framed messages over TCP (tcp.h).
#include "dist/tcp.h"

#include <arpa/inet.h>

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <thread>
#include <utility>

#include "core/error.h"

namespace moelora::dist {

namespace {

using ::moelora::detail::concat;

// Milliseconds poll() may wait: what is left before the deadline, at most a second (also without
// a deadline), so a long wait rechecks the clock.
int poll_timeout_ms(std::optional<Clock::time_point> deadline) {
  if (!deadline) return 1000;
  const auto left =
      std::chrono::duration_cast<std::chrono::milliseconds>(*deadline - Clock::now()).count();
  if (left <= 0) return 0;
  return static_cast<int>(std::min<int64_t>(left, 1000));
}

std::string errno_text(int error) {
  return std::string(std::strerror(error));
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() {
    if (list != nullptr) freeaddrinfo(list);
  }
};

// getaddrinfo for a TCP address; "" when it resolved, else the reason.
std::string resolve(const HostPort& address, bool passive, AddrInfo& out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  const std::string port = std::to_string(address.port);
  const int rc = getaddrinfo(address.host.empty() ? nullptr : address.host.c_str(), port.c_str(),
                             &hints, &out.list);
  return rc == 0 ? "" : gai_strerror(rc);
}

// Small frames go out at once; a peer whose host vanished (no FIN, no RST) is noticed by the
// kernel's keepalive probes (30 s idle, then 3 probes 10 s apart) and unacknowledged data times
// out after 2 minutes, so a blocked receive or send ends with an error instead of waiting forever.
// Best effort: not every socket type takes them (the tests' socketpairs do not).
void set_socket_options(int fd) {
  const int one = 1, idle = 30, interval = 10, probes = 3, user_timeout_ms = 120000;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof(probes));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

// Connects fd to addr, giving up at the deadline (a blocking connect can wait minutes when SYNs
// are dropped). "" when connected, else the reason.
std::string connect_before(int fd, const sockaddr* addr, socklen_t size,
                           Clock::time_point deadline) {
  const int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  std::string error;
  if (::connect(fd, addr, size) != 0) {
    if (errno != EINPROGRESS) {
      error = errno_text(errno);
    } else {
      for (;;) {
        pollfd p{fd, POLLOUT, 0};
        const int ready = ::poll(&p, 1, poll_timeout_ms(deadline));
        if (ready < 0 && errno == EINTR) continue;
        if (ready == 0 && Clock::now() < deadline) continue;
        if (ready <= 0) {
          error = ready == 0 ? "no answer before the deadline" : errno_text(errno);
          break;
        }
        int so_error = 0;
        socklen_t len = sizeof(so_error);
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &len);
        if (so_error != 0) error = errno_text(so_error);
        break;
      }
    }
  }
  fcntl(fd, F_SETFL, flags);
  return error;
}

}  // namespace

std::string HostPort::text() const {
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" +
         std::to_string(port);
}

HostPort parse_host_port(const std::string& text, const std::string& what) {
  const std::string expected = concat(what, " '", text,
                                      "' is not HOST:PORT (a host name or address and a port in "
                                      "1..65535, e.g. 10.0.0.1:29500)");
  HostPort out;
  std::string port;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find(']');
    MOELORA_CHECK(close != std::string::npos && close + 1 < text.size() && text[close + 1] == ':',
                  ErrorCode::kInvalidArgument, expected);
    out.host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    MOELORA_CHECK(colon != std::string::npos && text.find(':') == colon,
                  ErrorCode::kInvalidArgument, expected);
    out.host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  MOELORA_CHECK(!out.host.empty() && !port.empty() && port.size() <= 5 &&
                    port.find_first_not_of("0123456789") == std::string::npos,
                ErrorCode::kInvalidArgument, expected);
  out.port = std::stoi(port);
  MOELORA_CHECK(out.port >= 1 && out.port <= 65535, ErrorCode::kInvalidArgument, expected);
  return out;
}

// ---- Connection ----

Connection::Connection(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {
  set_socket_options(fd_);
}

Connection::~Connection() {
  close();
}

Connection::Connection(Connection&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), peer_(std::move(other.peer_)) {}

Connection& Connection::operator=(Connection&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    peer_ = std::move(other.peer_);
  }
  return *this;
}

void Connection::send(uint32_t tag, std::span<const std::byte> head,
                      std::span<const std::byte> body, std::optional<Clock::time_point> deadline) {
  MOELORA_CHECK(fd_ >= 0, ErrorCode::kInternal, "cannot send to ", peer_,
                ": the connection is closed");
  std::byte header[kFrameHeaderBytes];
  write_frame_header({tag, head.size() + body.size()}, header);
  for (std::span<const std::byte> part :
       {std::span<const std::byte>(header, sizeof(header)), head, body}) {
    size_t done = 0;
    while (done < part.size()) {
      const ssize_t n =
          ::send(fd_, part.data() + done, part.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        // The peer's buffers are full: wait until it reads, up to the deadline.
        pollfd p{fd_, POLLOUT, 0};
        const int ready = ::poll(&p, 1, poll_timeout_ms(deadline));
        MOELORA_CHECK(ready != 0 || !deadline || Clock::now() < *deadline, ErrorCode::kInternal,
                      "sending to ", peer_,
                      " did not finish before the deadline: it stopped "
                      "reading (",
                      done, " of ", part.size(), " bytes of a frame part sent)");
        continue;
      }
      MOELORA_CHECK(n > 0, ErrorCode::kInternal, "the connection to ", peer_,
                    " broke while sending (", errno_text(errno),
                    "): its process exited or was killed");
      done += static_cast<size_t>(n);
    }
  }
}

bool Connection::read_exact(std::byte* out, size_t n, std::optional<Clock::time_point> deadline) {
  size_t done = 0;
  while (done < n) {
    pollfd p{fd_, POLLIN, 0};
    const int ready = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (ready < 0 && errno == EINTR) continue;
    MOELORA_CHECK(ready >= 0, ErrorCode::kInternal, "waiting for ", peer_,
                  " failed: ", errno_text(errno));
    if (ready == 0) {
      if (deadline && Clock::now() >= *deadline) return false;
      continue;
    }
    const ssize_t got = ::recv(fd_, out + done, n - done, 0);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    MOELORA_CHECK(got > 0, ErrorCode::kInternal, "the connection to ", peer_, " closed",
                  got < 0 ? " (" + errno_text(errno) + ")" : std::string(),
                  ": its process exited, was killed or gave up");
    done += static_cast<size_t>(got);
  }
  return true;
}

void write_frame_header(const FrameHeader& header, std::byte* out) {
  std::memcpy(out, &header.tag, 4);
  std::memcpy(out + 4, &header.length, 8);
}

FrameHeader read_frame_header(const std::byte* bytes) {
  FrameHeader header;
  std::memcpy(&header.tag, bytes, 4);
  std::memcpy(&header.length, bytes + 4, 8);
  return header;
}

std::optional<Frame> Connection::receive(std::optional<Clock::time_point> deadline,
                                         uint64_t max_payload) {
  MOELORA_CHECK(fd_ >= 0, ErrorCode::kInternal, "cannot receive from ", peer_,
                ": the connection is closed");
  std::byte header[kFrameHeaderBytes];
  if (!read_exact(header, sizeof(header), deadline)) return std::nullopt;
  const auto [tag, length] = read_frame_header(header);
  Frame frame;
  frame.tag = tag;
  MOELORA_CHECK(length <= max_payload, ErrorCode::kInvalidArgument, "a frame from ", peer_,
                " says its payload has ", length, " bytes, more than the ", max_payload,
                " a frame may have here: the stream is corrupt or not moelora's");
  // The buffer grows with the bytes that arrive, so a length that lies costs no memory.
  constexpr uint64_t kChunk = uint64_t{1} << 20;
  while (frame.payload.size() < length) {
    const size_t at = frame.payload.size();
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, length - at));
    frame.payload.resize(at + n);
    if (!read_exact(frame.payload.data() + at, n, deadline)) {
      MOELORA_THROW(ErrorCode::kInternal, "a frame from ", peer_, " stopped part-way (", at, " of ",
                    length, " bytes) at the deadline");
    }
  }
  return frame;
}

bool Connection::readable() const {
  if (fd_ < 0) return false;
  pollfd p{fd_, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

void Connection::shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void Connection::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

// ---- Listener ----

Listener Listener::bind(const HostPort& address) {
  AddrInfo info;
  const std::string failed = resolve(address, /*passive=*/true, info);
  MOELORA_CHECK(failed.empty(), ErrorCode::kInvalidArgument, "cannot listen on ", address.text(),
                ": ", failed);
  std::string last_error = "no address";
  for (addrinfo* a = info.list; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      Listener listener;
      listener.fd_ = fd;
      return listener;
    }
    last_error = errno_text(errno);
    ::close(fd);
  }
  MOELORA_THROW(ErrorCode::kInvalidArgument, "cannot listen on ", address.text(), ": ", last_error,
                " (is another job using the port? pick another with --dist-init-addr)");
}

Listener Listener::adopt(int fd) {
  int accepting = 0;
  socklen_t size = sizeof(accepting);
  MOELORA_CHECK(fd >= 0 && getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &size) == 0 &&
                    accepting == 1,
                ErrorCode::kInvalidArgument, "file descriptor ", fd,
                " is not a listening socket (the launcher passes one to rank 0)");
  fcntl(fd, F_SETFD, FD_CLOEXEC);
  Listener listener;
  listener.fd_ = fd;
  return listener;
}

Listener::~Listener() {
  close();
}

Listener::Listener(Listener&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}

Listener& Listener::operator=(Listener&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

int Listener::port() const {
  sockaddr_storage addr{};
  socklen_t size = sizeof(addr);
  MOELORA_CHECK(getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &size) == 0,
                ErrorCode::kInternal, "getsockname failed: ", errno_text(errno));
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

std::optional<Connection> Listener::accept(Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd_, POLLIN, 0};
    const int ready = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (ready < 0 && errno == EINTR) continue;
    MOELORA_CHECK(ready >= 0, ErrorCode::kInternal,
                  "waiting for connections failed: ", errno_text(errno));
    if (ready == 0) {
      if (Clock::now() >= deadline) return std::nullopt;
      continue;
    }
    sockaddr_storage addr{};
    socklen_t size = sizeof(addr);
    const int fd = ::accept4(fd_, reinterpret_cast<sockaddr*>(&addr), &size, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      MOELORA_THROW(ErrorCode::kInternal, "accepting a connection failed: ", errno_text(errno));
    }
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (addr.ss_family == AF_INET) {
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(&addr);
      inet_ntop(AF_INET, &v4->sin_addr, host, sizeof(host));
      port = ntohs(v4->sin_port);
    } else if (addr.ss_family == AF_INET6) {
      const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&addr);
      inet_ntop(AF_INET6, &v6->sin6_addr, host, sizeof(host));
      port = ntohs(v6->sin6_port);
    }
    return Connection(fd, HostPort{host, port}.text());
  }
}

void Listener::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Connection connect_until(const HostPort& address, Clock::time_point deadline) {
  std::string last_error;
  for (;;) {
    AddrInfo info;
    last_error = resolve(address, /*passive=*/false, info);
    if (last_error.empty()) {
      for (addrinfo* a = info.list; a != nullptr; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
          last_error = errno_text(errno);
          continue;
        }
        last_error = connect_before(fd, a->ai_addr, a->ai_addrlen, deadline);
        if (last_error.empty()) return Connection(fd, address.text());
        ::close(fd);
      }
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  MOELORA_THROW(ErrorCode::kInternal, "cannot connect to ", address.text(), ": ", last_error,
                " (is rank 0 running there, and the address reachable from this machine?)");
}

// ---- payload codec ----

void ByteWriter::append(const void* data, size_t n) {
  if (n == 0) return;
  const size_t at = bytes_.size();
  bytes_.resize(at + n);
  std::memcpy(bytes_.data() + at, data, n);
}

ByteWriter& ByteWriter::put_string(const std::string& s) {
  return put_vector<char>(std::span<const char>(s.data(), s.size()));
}

std::string ByteReader::get_string() {
  const std::vector<char> chars = get_vector<char>();
  return std::string(chars.begin(), chars.end());
}

void ByteReader::check_available(uint64_t count, size_t item_size) const {
  MOELORA_CHECK(count <= remaining() / item_size, ErrorCode::kInvalidArgument, what_,
                " is malformed: it announces ", count, " items of ", item_size, " bytes with only ",
                remaining(), " bytes left");
}

const std::byte* ByteReader::take(size_t n) {
  MOELORA_CHECK(n <= remaining(), ErrorCode::kInvalidArgument, what_, " is malformed: ", n,
                " more bytes needed at offset ", offset_, " of ", bytes_.size());
  const std::byte* p = bytes_.data() + offset_;
  offset_ += n;
  return p;
}

}  // namespace moelora::dist
