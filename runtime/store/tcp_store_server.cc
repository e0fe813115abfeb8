// The TCP store server: one thread, one epoll loop, non-blocking sockets
// (runtime/store/tcp_store_loop.h). This file holds the loop, the connections and
// the sockets; tcp_store_operations.cc the operations.
#include <fmt/format.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <future>

#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"
#include "runtime/store/tcp_store_loop.h"

namespace bulkhead {

using namespace store_protocol;

namespace {

constexpr size_t kReadChunk = 64 * 1024;

}  // namespace

TcpStoreServer::Loop::Loop(TcpStoreOptions options, std::string endpoint, Fd listener)
    : options_(std::move(options)),
      endpoint_(std::move(endpoint)),
      token_(options_.token.value_or(env::kStoreToken.text())),
      maxMessageBytes_(static_cast<size_t>(resolveMaxMessageBytes(options_.maxMessageBytes))),
      listener_(std::move(listener)) {
  int ends[2];
  if (::pipe(ends) != 0) net::raiseSocketError("pipe for the store server's wake-up", errno);
  wakeRead_ = Fd(ends[0]);
  wakeWrite_ = Fd(ends[1]);
  net::makeNonBlocking(wakeRead_.get());
  net::makeNonBlocking(wakeWrite_.get());
  int epoll = ::epoll_create1(EPOLL_CLOEXEC);
  if (epoll < 0) net::raiseSocketError("epoll_create1 for the store server", errno);
  epoll_ = Fd(epoll);
  watch(wakeRead_.get(), kWakeId, EPOLLIN);
  watch(listener_.get(), kListenerId, EPOLLIN);
}

void TcpStoreServer::Loop::requestStop() {
  stopping_ = true;
  char byte = 1;
  [[maybe_unused]] ssize_t written = ::write(wakeWrite_.get(), &byte, 1);  // a full pipe already wakes it
}

void TcpStoreServer::Loop::run() {
  log::info("store", "store server listening on {}", endpoint_);
  std::vector<epoll_event> ready(1024);
  while (!stopping_) {
    int count = ::epoll_wait(epoll_.get(), ready.data(), static_cast<int>(ready.size()), waitTimeoutMs());
    if (count < 0 && errno != EINTR) {
      log::error("store", "store server {}: epoll_wait failed: {}; it stops serving", endpoint_, net::errorText(errno));
      break;
    }
    if (stopping_) break;
    for (int i = 0; i < count; ++i) {
      const uint64_t id = ready[i].data.u64;
      const uint32_t revents = ready[i].events;
      if (id == kWakeId) {
        drainWakePipe();
        continue;
      }
      if (id == kListenerId) {
        acceptAll();
        continue;
      }
      auto it = connections_.find(id);
      if (it == connections_.end() || it->second->dead) continue;
      Connection& connection = *it->second;
      if (revents & EPOLLOUT) flush(connection);
      if (!connection.dead && (revents & (EPOLLIN | EPOLLHUP | EPOLLERR))) receive(connection);
    }
    expireParkedRequests();
    closeDeadConnections();
  }
  listener_.reset();  // first, so no client reconnects in between
  for (auto& [id, connection] : connections_) unpark(*connection);
  connections_.clear();
  log::info("store", "store server {} stopped", endpoint_);
}

void TcpStoreServer::Loop::watch(int fd, uint64_t id, uint32_t events) {
  epoll_event event{};
  event.events = events;
  event.data.u64 = id;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &event) != 0)
    net::raiseSocketError("epoll_ctl for the store server", errno);
}

void TcpStoreServer::Loop::updateInterest(Connection& connection) {
  if (connection.dead) return;
  uint32_t wanted =
      (connection.output.size() < maxMessageBytes_ ? EPOLLIN : 0u) | (connection.output.empty() ? 0u : EPOLLOUT);
  if (wanted == connection.events) return;
  epoll_event event{};
  event.events = wanted;
  event.data.u64 = connection.id;
  if (::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, connection.fd.get(), &event) != 0) {
    connection.dead = true;
    return;
  }
  connection.events = wanted;
}

int TcpStoreServer::Loop::waitTimeoutMs() {
  std::optional<Deadline> earliest;
  for (auto it = expiring_.begin(); it != expiring_.end();) {
    auto found = connections_.find(*it);
    if (found == connections_.end() || !found->second->parked || found->second->parked->expires.isNever()) {
      it = expiring_.erase(it);
      continue;
    }
    const Deadline& expires = found->second->parked->expires;
    earliest = earliest ? earliest->earliest(expires) : expires;
    ++it;
  }
  if (!earliest) return -1;
  auto ms = std::chrono::ceil<std::chrono::milliseconds>(earliest->remaining()).count();
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 60'000));
}

void TcpStoreServer::Loop::drainWakePipe() {
  char bytes[64];
  while (::read(wakeRead_.get(), bytes, sizeof(bytes)) > 0) {
  }
}

void TcpStoreServer::Loop::acceptAll() {
  while (true) {
    int fd = ::accept(listener_.get(), nullptr, nullptr);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        log::warn("store", "store server {}: accept failed: {}", endpoint_, net::errorText(errno));
      return;
    }
    Fd socket(fd);
    if (options_.maxConnections > 0 && connections_.size() >= static_cast<size_t>(options_.maxConnections)) {
      log::warn("store", "store server {}: refusing {}: already {} connections (maxConnections)", endpoint_,
                net::peerName(fd), connections_.size());
      continue;
    }
    try {
      net::makeNonBlocking(fd);
    } catch (const Error& error) {
      log::warn("store", "store server {}: dropping a new connection: {}", endpoint_, error.what());
      continue;
    }
    auto connection = std::make_unique<Connection>();
    connection->id = nextId_++;
    connection->peer = net::peerName(fd);
    connection->fd = std::move(socket);
    connection->events = EPOLLIN;
    try {
      watch(fd, connection->id, EPOLLIN);
    } catch (const Error& error) {
      log::warn("store", "store server {}: dropping a new connection: {}", endpoint_, error.what());
      continue;
    }
    connections_.emplace(connection->id, std::move(connection));
  }
}

void TcpStoreServer::Loop::receive(Connection& connection) {
  char chunk[kReadChunk];
  int error = 0;
  long received = net::receiveSome(connection.fd.get(), chunk, sizeof(chunk), error);
  if (received < 0) {
    if (error != 0)
      log::debug("store", "store server {}: connection from {} failed: {}", endpoint_, connection.peer,
                 net::errorText(error));
    connection.dead = true;
    return;
  }
  connection.input.append(chunk, static_cast<size_t>(received));
  handleBufferedFrames(connection);
  updateInterest(connection);
}

void TcpStoreServer::Loop::handleBufferedFrames(Connection& connection) {
  size_t consumed = 0;
  while (!connection.dead && !connection.parked && connection.input.size() - consumed >= kHeaderBytes) {
    std::string_view rest = std::string_view(connection.input).substr(consumed);
    std::optional<uint32_t> length = bodyLength(rest);
    if (!length) {
      refuse(connection, Refusal::Malformed, "the bytes received are not a Bulkhead store frame (bad magic)", true);
      break;
    }
    if (*length > maxMessageBytes_) {
      refuse(connection, Refusal::TooLarge,
             fmt::format("a message of {} bytes exceeds this server's limit of {} bytes "
                         "(BULKHEAD_STORE_MAX_MESSAGE); keep store values small or raise the limit on every rank",
                         *length, maxMessageBytes_),
             true);
      break;
    }
    if (rest.size() - kHeaderBytes < *length) break;  // the rest of the body is still on its way
    consumed += kHeaderBytes + *length;
    handleRequest(connection, rest.substr(kHeaderBytes, *length));
  }
  connection.input.erase(0, consumed);
}

void TcpStoreServer::Loop::reply(Connection& connection, std::string frame) {
  connection.output += frame;
  flush(connection);
}

void TcpStoreServer::Loop::flush(Connection& connection) {
  int error = 0;
  long sent = net::sendSome(connection.fd.get(), connection.output, error);
  if (sent < 0) {
    log::debug("store", "store server {}: sending to {} failed: {}", endpoint_, connection.peer, net::errorText(error));
    connection.dead = true;
    return;
  }
  connection.output.erase(0, static_cast<size_t>(sent));
  updateInterest(connection);
}

void TcpStoreServer::Loop::refuse(Connection& connection, Refusal reason, const std::string& text,
                                  bool closeConnection) {
  if (closeConnection)
    log::warn("store", "store server {}: closing the connection from {}: {}", endpoint_, connection.peer, text);
  reply(connection, refusalFrame(reason, text));
  if (closeConnection) connection.dead = true;
}

void TcpStoreServer::Loop::closeDeadConnections() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (it->second->dead) {
      unpark(*it->second);
      expiring_.erase(it->first);
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

TcpStoreServer::TcpStoreServer(TcpStoreOptions options) : host_(options.host) {
  if (options.maxConnections < 0)
    throw ConfigError(
        fmt::format("TcpStoreOptions.maxConnections is {}; it must be 0 (no cap) or more", options.maxConnections),
        {.rank = options.rank});
  net::raiseDescriptorLimit();
  Fd listener = net::listenOn(options.host, options.port, /*backlog=*/1024);
  port_ = net::localPort(listener.get());
  loop_ = std::make_shared<Loop>(std::move(options), endpoint(), std::move(listener));
  std::promise<void> finished;
  finished_ = finished.get_future();
  // The thread shares the loop, so a thread left running past stop()'s
  // deadline never outlives what it uses.
  thread_ = std::thread([loop = loop_, finished = std::move(finished)]() mutable {
    try {
      loop->run();
    } catch (const std::exception& error) {
      log::error("store", "store server stopped serving: {}", error.what());
    }
    finished.set_value();
  });
}

TcpStoreServer::~TcpStoreServer() { stop(Deadline::after(std::chrono::seconds(2))); }

std::string TcpStoreServer::endpoint() const { return net::formatEndpoint(host_, port_); }

void TcpStoreServer::stop(Deadline deadline) {
  if (!thread_.joinable()) return;
  loop_->requestStop();
  bool ended = deadline.isNever() ? (finished_.wait(), true)
                                  : finished_.wait_for(deadline.remaining()) == std::future_status::ready;
  if (ended) {
    thread_.join();
  } else {
    log::error("store", "store server {} did not stop within its deadline; leaving its thread to end alone",
               endpoint());
    thread_.detach();
  }
}

}  // namespace bulkhead
