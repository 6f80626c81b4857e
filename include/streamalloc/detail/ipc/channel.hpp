#pragma once

// The socket between an exporting pool and its importers: a Unix-domain SOCK_SEQPACKET socket.
// Sequenced packets keep each protocol message whole (protocol.hpp), carry the file
// descriptors of physical memory with SCM_RIGHTS, and report a peer that is gone, however it
// ended (exit, crash, SIGKILL), as a read of 0 bytes: how an exporter learns to release what
// a dead importer held.

#include <streamalloc/shareable_handle.hpp>

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace streamalloc::detail::ipc {

[[noreturn]] inline void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), "streamalloc IPC: " + what);
}

/// The socket address of `path`: a file system path, or, with a leading '@', a name in Linux's
/// abstract namespace (nothing on disk, gone with the last socket).
inline std::pair<sockaddr_un, socklen_t> socket_address(std::string_view path) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof a.sun_path) {
    throw std::invalid_argument("streamalloc IPC: socket path '" + std::string(path) + "' must have 1 to " +
                                std::to_string(sizeof a.sun_path - 1) + " characters");
  }
  std::memcpy(a.sun_path, path.data(), path.size());
  if (path.front() == '@') a.sun_path[0] = '\0';
  return {a, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size())};
}

inline unique_fd new_socket() {
  unique_fd s(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!s) throw_errno("socket");
  return s;
}

/// A socket listening at `path`. A socket file left there by a process that exited is
/// replaced; one another process still listens on is not.
inline unique_fd listen_at(std::string_view path) {
  const auto [addr, len] = socket_address(path);
  unique_fd s = new_socket();
  if (::bind(s.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    if (errno != EADDRINUSE || path.front() == '@') throw_errno("bind to '" + std::string(path) + "'");
    unique_fd probe = new_socket();
    if (::connect(probe.get(), reinterpret_cast<const sockaddr*>(&addr), len) == 0) {
      throw std::invalid_argument("streamalloc IPC: another process serves '" + std::string(path) + "' already");
    }
    struct stat st{};
    if (::stat(std::string(path).c_str(), &st) != 0 || !S_ISSOCK(st.st_mode)) {
      throw std::invalid_argument("streamalloc IPC: '" + std::string(path) + "' exists and is not a socket");
    }
    ::unlink(std::string(path).c_str());  // a stale socket: nobody answers on it
    if (::bind(s.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0) throw_errno("bind to '" + std::string(path) + "'");
  }
  if (::listen(s.get(), 64) != 0) throw_errno("listen");
  return s;
}

/// A socket connected to the exporter listening at `path`.
inline unique_fd connect_to(std::string_view path) {
  const auto [addr, len] = socket_address(path);
  unique_fd s = new_socket();
  if (::connect(s.get(), reinterpret_cast<const sockaddr*>(&addr), len) != 0) {
    const int e = errno;
    throw std::invalid_argument("streamalloc IPC: no exporting pool at '" + std::string(path) +
                                "' (connect: " + std::strerror(e) + ")");
  }
  return s;
}

/// Sends one message, with file descriptor `fd` when it is not -1. Never raises SIGPIPE: a
/// peer that is gone is an error (EPIPE) here.
inline void send_message(int socket, const void* data, std::size_t bytes, int fd = -1) {
  iovec io{const_cast<void*>(data), bytes};
  msghdr m{};
  m.msg_iov = &io;
  m.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))]{};
  if (fd >= 0) {
    m.msg_control = control;
    m.msg_controllen = sizeof control;
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  }
  ssize_t n;
  do {
    n = ::sendmsg(socket, &m, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) throw_errno("send");
}

/// How long a side expecting an answer, or more requests, polls before it sleeps: a thread
/// woken from sleep costs tens of microseconds, more than the whole exchange otherwise.
inline constexpr std::chrono::microseconds spin_before_sleep{200};

/// Receives one message into `data` (at most `capacity` bytes) and the descriptor sent with
/// it, if any, into `fd`. Returns its size; 0 when the peer is gone. `spin`: polls that long
/// for the message before sleeping on it.
inline std::size_t receive_message(int socket, void* data, std::size_t capacity, unique_fd* fd = nullptr,
                                   std::chrono::microseconds spin = std::chrono::microseconds{0}) {
  if (spin.count() > 0) {
    const auto until = std::chrono::steady_clock::now() + spin;
    pollfd p{socket, POLLIN, 0};
    while (::poll(&p, 1, 0) == 0 && std::chrono::steady_clock::now() < until) {
    }
  }
  iovec io{data, capacity};
  msghdr m{};
  m.msg_iov = &io;
  m.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))]{};
  m.msg_control = control;
  m.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(socket, &m, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    if (errno == ECONNRESET) return 0;
    throw_errno("receive");
  }
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c != nullptr; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    int received = -1;
    std::memcpy(&received, CMSG_DATA(c), sizeof(int));
    unique_fd owned(received);  // closed here unless the caller wants it
    if (fd != nullptr) *fd = std::move(owned);
  }
  if ((m.msg_flags & MSG_TRUNC) != 0) {
    throw std::invalid_argument("streamalloc IPC: a message longer than " + std::to_string(capacity) +
                                " bytes (not from a streamalloc peer of this version?)");
  }
  return static_cast<std::size_t>(n);
}

}  // namespace streamalloc::detail::ipc
