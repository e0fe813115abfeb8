#include "runtime/store/socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <memory>

#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::net {
namespace {

struct AddressListDeleter {
  void operator()(addrinfo* list) const { freeaddrinfo(list); }
};
using AddressList = std::unique_ptr<addrinfo, AddressListDeleter>;

AddressList resolve(const std::string& host, uint16_t port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* list = nullptr;
  std::string service = std::to_string(port);
  int status = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &list);
  if (status != 0)
    throw CommError(
        fmt::format("cannot resolve store address {}: {}; check the host name (MASTER_ADDR) "
                    "or pass a numeric address",
                    formatEndpoint(host, port), gai_strerror(status)));
  return AddressList(list);
}

// Milliseconds for poll(): rounded up, so a wait never spins on a 0 timeout
// while time remains; -1 (forever) only for a never-deadline.
int pollTimeoutMs(Deadline deadline) {
  if (deadline.isNever()) return -1;
  double ms = std::ceil(deadline.remainingSeconds() * 1000.0);
  return static_cast<int>(std::min(ms, 60'000.0));
}

void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // latency only: failure is harmless
}

}  // namespace

std::string formatEndpoint(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

std::string errorText(int error) { return error == 0 ? "connection closed by peer" : std::strerror(error); }

std::string peerName(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  char host[128] = "?";
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    char service[16] = "";
    if (getnameinfo(reinterpret_cast<sockaddr*>(&address), length, host, sizeof(host), service, sizeof(service),
                    NI_NUMERICHOST | NI_NUMERICSERV) == 0)
      return fmt::format("{}:{}", host, service);
  }
  return host;
}

void raiseDescriptorLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0 || limit.rlim_cur >= limit.rlim_max) return;
  limit.rlim_cur = limit.rlim_max;
  if (::setrlimit(RLIMIT_NOFILE, &limit) != 0)
    log::debug("store", "could not raise the descriptor limit: {}", errorText(errno));
}

void raiseSocketError(const std::string& what, int error, std::string_view advice) {
  std::string message = fmt::format("{} failed: {} (errno {}); ", what, errorText(error), error);
  if (error == ETIMEDOUT)
    throw TimeoutError(message + std::string(advice.empty() ? "the network dropped the connection: check the path "
                                                              "between this rank and the store server"
                                                            : advice),
                       {.expected = "a live TCP connection"});
  throw CommError(message + std::string(advice.empty() ? "check that the store server (rank 0) still runs and is "
                                                         "reachable from this rank"
                                                       : advice),
                  {.expected = "a working TCP connection"});
}

void makeNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) raiseSocketError("fcntl(O_NONBLOCK)", errno);
  if (fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) raiseSocketError("fcntl(FD_CLOEXEC)", errno);
}

Fd listenOn(const std::string& host, uint16_t port, int backlog) {
  AddressList addresses = resolve(host, port, /*passive=*/true);
  int lastError = 0;
  for (addrinfo* address = addresses.get(); address; address = address->ai_next) {
    Fd fd(::socket(address->ai_family, address->ai_socktype, address->ai_protocol));
    if (!fd.valid()) {
      lastError = errno;
      continue;
    }
    int one = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), address->ai_addr, address->ai_addrlen) == 0 && ::listen(fd.get(), backlog) == 0) {
      makeNonBlocking(fd.get());
      return fd;
    }
    lastError = errno;
  }
  raiseSocketError(fmt::format("bind and listen on {}", formatEndpoint(host, port)), lastError,
                   "pass an address of this host, and a free port (or port 0 to pick any free one)");
}

uint16_t localPort(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) raiseSocketError("getsockname", errno);
  if (address.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&address)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&address)->sin_port);
}

bool waitReady(int fd, short events, Deadline deadline) {
  while (true) {
    pollfd entry{.fd = fd, .events = events, .revents = 0};
    int ready = ::poll(&entry, 1, pollTimeoutMs(deadline));
    if (ready > 0) return true;
    if (ready < 0 && errno != EINTR) raiseSocketError("poll", errno);
    if (deadline.expired()) return false;
  }
}

ConnectResult connectOnce(const std::string& host, uint16_t port, Deadline deadline, Fd& connected, int& lastError) {
  AddressList addresses = resolve(host, port, /*passive=*/false);
  for (addrinfo* address = addresses.get(); address; address = address->ai_next) {
    Fd fd(::socket(address->ai_family, address->ai_socktype, address->ai_protocol));
    if (!fd.valid()) {
      lastError = errno;
      continue;
    }
    makeNonBlocking(fd.get());
    int status = ::connect(fd.get(), address->ai_addr, address->ai_addrlen);
    if (status != 0 && errno != EINPROGRESS && errno != EINTR) {
      lastError = errno;
      continue;
    }
    if (status != 0) {
      if (!waitReady(fd.get(), POLLOUT, deadline)) {
        lastError = ETIMEDOUT;
        return ConnectResult::DeadlinePassed;
      }
      int error = 0;
      socklen_t length = sizeof(error);
      if (getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length) != 0) error = errno;
      if (error != 0) {
        lastError = error;
        continue;
      }
    }
    setNoDelay(fd.get());
    connected = std::move(fd);
    return ConnectResult::Connected;
  }
  return deadline.expired() ? ConnectResult::DeadlinePassed : ConnectResult::Refused;
}

long sendSome(int fd, std::string_view bytes, int& error) {
  while (true) {
    ssize_t sent = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (sent >= 0) return sent;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    error = errno;
    return -1;
  }
}

long receiveSome(int fd, char* buffer, size_t capacity, int& error) {
  while (true) {
    ssize_t received = ::recv(fd, buffer, capacity, 0);
    if (received > 0) return received;
    if (received == 0) {
      error = 0;
      return -1;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    error = errno;
    return -1;
  }
}

bool sendAll(int fd, std::string_view bytes, Deadline deadline, const std::string& peer) {
  while (!bytes.empty()) {
    int error = 0;
    long sent = sendSome(fd, bytes, error);
    if (sent < 0) raiseSocketError(fmt::format("send to store {}", peer), error);
    bytes.remove_prefix(static_cast<size_t>(sent));
    if (!bytes.empty() && !waitReady(fd, POLLOUT, deadline)) return false;
  }
  return true;
}

bool receiveExactly(int fd, char* buffer, size_t size, Deadline deadline, const std::string& peer) {
  size_t done = 0;
  while (done < size) {
    int error = 0;
    long received = receiveSome(fd, buffer + done, size - done, error);
    if (received < 0) raiseSocketError(fmt::format("receive from store {}", peer), error);
    done += static_cast<size_t>(received);
    if (done < size && !waitReady(fd, POLLIN, deadline)) return false;
  }
  return true;
}

}  // namespace bulkhead::net
