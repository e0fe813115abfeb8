// The TCP store server: one thread, one epoll loop, non-blocking sockets.
// Only the loop thread touches the data and the connections; other threads
// reach it through the self-pipe (stop) and nothing else.
#include <fmt/format.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <limits>
#include <map>
#include <optional>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"
#include "runtime/store_protocol.h"
#include "runtime/tcp_store.h"

namespace bulkhead {

using namespace store_protocol;

namespace {

constexpr size_t kReadChunk = 64 * 1024;

// A Get, Wait or SetAndGather waiting on the server for its keys. It is listed under the
// first key still missing (keys[next]); when that key appears it moves on to
// the next missing one, or is answered.
struct ParkedRequest {
  Op op = Op::Wait;
  std::vector<std::string> keys;
  size_t next = 0;
  Deadline expires = Deadline::never();
};

struct Connection {
  uint64_t id = 0;
  Fd fd;
  std::string peer;
  std::string input;   // bytes received and not yet handled
  std::string output;  // reply bytes not yet sent
  bool authenticated = false;
  bool dead = false;    // closed at the end of this loop iteration
  uint32_t events = 0;  // what epoll watches for on it
  std::optional<ParkedRequest> parked;
};

}  // namespace

class TcpStoreServer::Loop {
 public:
  Loop(TcpStoreOptions options, std::string endpoint, Fd listener)
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

  // Safe from any thread: one byte on the self-pipe wakes poll().
  void requestStop() {
    stopping_ = true;
    char byte = 1;
    [[maybe_unused]] ssize_t written = ::write(wakeWrite_.get(), &byte, 1);  // a full pipe already wakes it
  }

  void run() {
    log::info("store", "store server listening on {}", endpoint_);
    std::vector<epoll_event> ready(1024);
    while (!stopping_) {
      int count = ::epoll_wait(epoll_.get(), ready.data(), static_cast<int>(ready.size()), waitTimeoutMs());
      if (count < 0 && errno != EINTR) {
        log::error("store", "store server {}: epoll_wait failed: {}; it stops serving", endpoint_,
                   net::errorText(errno));
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

 private:
  static constexpr uint64_t kWakeId = ~uint64_t{0}, kListenerId = ~uint64_t{0} - 1;

  void watch(int fd, uint64_t id, uint32_t events) {
    epoll_event event{};
    event.events = events;
    event.data.u64 = id;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &event) != 0)
      net::raiseSocketError("epoll_ctl for the store server", errno);
  }

  // Reads while its pending replies are bounded (a client that does not read
  // its replies is not read from either), writes while replies are pending.
  void updateInterest(Connection& connection) {
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

  // Until the earliest parked request with a deadline expires; only those are
  // looked at, not every connection.
  int waitTimeoutMs() {
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

  void drainWakePipe() {
    char bytes[64];
    while (::read(wakeRead_.get(), bytes, sizeof(bytes)) > 0) {
    }
  }

  void acceptAll() {
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

  void receive(Connection& connection) {
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

  // Handles every complete frame in the input, in order, until one parks.
  void handleBufferedFrames(Connection& connection) {
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

  void handleRequest(Connection& connection, std::string_view body) {
    try {
      FrameReader reader(body);
      auto op = static_cast<Op>(reader.u8());
      if (!connection.authenticated && op != Op::Hello) {
        refuse(connection, Refusal::Unauthorized, "the first message of a connection must be a hello", true);
        return;
      }
      dispatch(connection, op, reader);
    } catch (const Error& error) {
      refuse(connection, Refusal::Malformed, error.message(), true);
    } catch (const std::exception& error) {  // e.g. bad_alloc: this connection goes, the server stays
      refuse(connection, Refusal::BadRequest, error.what(), true);
    }
  }

  // One handler per operation; each reads its request to the end before it
  // changes anything, so a malformed request changes nothing.
  void dispatch(Connection& connection, Op op, FrameReader& reader) {
    switch (op) {
      case Op::Hello:
        return onHello(connection, reader);
      case Op::Set:
        return onSet(connection, reader);
      case Op::MultiSet:
        return onMultiSet(connection, reader);
      case Op::Get:
      case Op::Wait:
      case Op::SetAndGather:
        return onParked(connection, op, reader);
      case Op::TryGet:
        return onTryGet(connection, reader);
      case Op::MultiGet:
        return onMultiGet(connection, reader);
      case Op::Add:
        return onAdd(connection, reader);
      case Op::CompareSet:
        return onCompareSet(connection, reader);
      case Op::Erase:
        return onErase(connection, reader);
    }
    refuse(connection, Refusal::Malformed, fmt::format("unknown operation {}", static_cast<int>(op)), true);
  }

  void onHello(Connection& connection, FrameReader& reader) {
    uint32_t version = reader.u32();
    std::string token = reader.str();
    reader.expectEnd();
    if (version != kVersion)
      return refuse(connection, Refusal::BadRequest,
                    fmt::format("protocol version {} is not this server's {}; use one Bulkhead build on every rank",
                                version, kVersion),
                    true);
    if (!sameToken(token, token_))
      return refuse(connection, Refusal::Unauthorized,
                    "wrong store token: every rank must use the job's token (BULKHEAD_STORE_TOKEN, or the one "
                    "the launcher shares through MPI)",
                    true);
    connection.authenticated = true;
    return reply(connection, FrameWriter().u8(uint8_t(Status::Ok)).finish());
  }

  void onSet(Connection& connection, FrameReader& reader) {
    std::string key = reader.str(), value = reader.str();
    reader.expectEnd();
    store(key, std::move(value));
    return reply(connection, FrameWriter().u8(uint8_t(Status::Ok)).finish());
  }

  void onMultiSet(Connection& connection, FrameReader& reader) {
    uint32_t pairs = reader.count(8);
    std::vector<std::pair<std::string, std::string>> items;
    items.reserve(pairs);
    for (uint32_t i = 0; i < pairs; ++i) {
      std::string key = reader.str();
      items.emplace_back(std::move(key), reader.str());
    }
    reader.expectEnd();  // a malformed request sets nothing
    for (auto& [key, value] : items) store(key, std::move(value));
    return reply(connection, FrameWriter().u8(uint8_t(Status::Ok)).finish());
  }

  void onParked(Connection& connection, Op op, FrameReader& reader) {
    ParkedRequest request{.op = op};
    std::optional<std::pair<std::string, std::string>> set;
    std::string erase;
    if (op == Op::SetAndGather) {
      std::string key = reader.str();
      set.emplace(std::move(key), reader.str());
      erase = reader.str();
    }
    uint32_t keys = op == Op::Get ? 1 : reader.count(4);
    for (uint32_t i = 0; i < keys; ++i) request.keys.push_back(reader.str());
    uint32_t timeoutMs = reader.u32();
    reader.expectEnd();  // a malformed request sets and erases nothing
    if (set) {
      if (set->first.empty() || request.keys.end() != std::find(request.keys.begin(), request.keys.end(), ""))
        return refuse(connection, Refusal::BadRequest, "setAndGather with an empty key", false);
      if (!erase.empty()) data_.erase(erase);
      store(set->first, std::move(set->second));
    }
    if (timeoutMs != kNoTimeout) {
      request.expires = Deadline::after(std::chrono::milliseconds(timeoutMs));
      expiring_.insert(connection.id);
    }
    connection.parked = std::move(request);
    return advanceParked(connection);
  }

  void onTryGet(Connection& connection, FrameReader& reader) {
    std::string key = reader.str();
    reader.expectEnd();
    auto it = data_.find(key);
    FrameWriter writer;
    writer.u8(uint8_t(Status::Ok)).u8(it != data_.end()).str(it != data_.end() ? it->second : "");
    return reply(connection, writer.finish());
  }

  void onMultiGet(Connection& connection, FrameReader& reader) {
    uint32_t keys = reader.count(4);
    FrameWriter writer;
    writer.u8(uint8_t(Status::Ok)).u32(keys);
    for (uint32_t i = 0; i < keys; ++i) {
      auto it = data_.find(reader.str());
      writer.u8(it != data_.end()).str(it != data_.end() ? it->second : "");
      if (writer.bodySize() > maxMessageBytes_) return refuseLargeReply(connection, keys);
    }
    reader.expectEnd();
    return reply(connection, writer.finish());
  }

  void onAdd(Connection& connection, FrameReader& reader) {
    std::string key = reader.str();
    int64_t delta = reader.i64();
    reader.expectEnd();
    int64_t current = 0;
    if (auto it = data_.find(key); it != data_.end()) {
      std::optional<int64_t> parsed = parseStoreInteger(it->second);
      if (!parsed)
        return refuse(connection, Refusal::NotAnInteger,
                      fmt::format("add on key '{}', which holds a value that is not a decimal integer", key), false);
      current = *parsed;
    }
    int64_t updated = 0;
    if (__builtin_add_overflow(current, delta, &updated))
      return refuse(connection, Refusal::BadRequest,
                    fmt::format("add of {} to key '{}' ({}) overflows int64", delta, key, current), false);
    store(key, std::to_string(updated));
    return reply(connection, FrameWriter().u8(uint8_t(Status::Ok)).i64(updated).finish());
  }

  void onCompareSet(Connection& connection, FrameReader& reader) {
    std::string key = reader.str(), expected = reader.str(), desired = reader.str();
    reader.expectEnd();
    auto it = data_.find(key);
    bool matches = it == data_.end() ? expected.empty() : (!expected.empty() && it->second == expected);
    if (matches) store(key, desired);
    it = data_.find(key);
    FrameWriter writer;
    writer.u8(uint8_t(Status::Ok)).str(it != data_.end() ? it->second : "");
    return reply(connection, writer.finish());
  }

  void onErase(Connection& connection, FrameReader& reader) {
    std::string key = reader.str();
    reader.expectEnd();
    bool existed = data_.erase(key) > 0;
    return reply(connection, FrameWriter().u8(uint8_t(Status::Ok)).u8(existed).finish());
  }

  // A reply with the values of `keys` keys would exceed the message limit.
  void refuseLargeReply(Connection& connection, size_t keys) {
    refuse(connection, Refusal::TooLarge,
           fmt::format("the values of these {} keys exceed the store's message limit of {} bytes; ask for fewer "
                       "keys at once",
                       keys, maxMessageBytes_),
           false);
  }

  void store(const std::string& key, std::string value) {
    data_[key] = std::move(value);
    auto waiting = waiters_.find(key);
    if (waiting == waiters_.end()) return;
    std::vector<uint64_t> ids = std::move(waiting->second);
    waiters_.erase(waiting);
    for (uint64_t id : ids) {
      auto it = connections_.find(id);
      if (it == connections_.end() || it->second->dead || !it->second->parked) continue;
      Connection& connection = *it->second;
      advanceParked(connection);
      if (!connection.parked) handleBufferedFrames(connection);
    }
  }

  // Answers a parked request whose keys all exist, or lists it under the
  // first key still missing. A wait counts a key erased after it appeared as
  // seen; a gather needs the values, so it looks at every key again first.
  void advanceParked(Connection& connection) {
    ParkedRequest& request = *connection.parked;
    while (request.next < request.keys.size() && data_.count(request.keys[request.next])) ++request.next;
    if (request.next == request.keys.size() && request.op != Op::Wait)
      request.next = static_cast<size_t>(
          std::find_if(request.keys.begin(), request.keys.end(), [&](const auto& key) { return !data_.count(key); }) -
          request.keys.begin());
    if (request.next < request.keys.size()) {
      waiters_[request.keys[request.next]].push_back(connection.id);
      return;
    }
    FrameWriter writer;
    writer.u8(uint8_t(Status::Ok));
    if (request.op == Op::Get) writer.str(data_.at(request.keys.front()));
    const size_t keys = request.keys.size();
    if (request.op == Op::SetAndGather) {
      writer.u32(static_cast<uint32_t>(keys));
      for (const std::string& key : request.keys) {
        writer.str(data_.at(key));
        if (writer.bodySize() > maxMessageBytes_) {
          connection.parked.reset();
          return refuseLargeReply(connection, keys);
        }
      }
    }
    connection.parked.reset();
    reply(connection, writer.finish());
  }

  void expireParkedRequests() {
    std::vector<uint64_t> due;
    for (uint64_t id : expiring_) {
      auto it = connections_.find(id);
      if (it != connections_.end() && !it->second->dead && it->second->parked && it->second->parked->expires.expired())
        due.push_back(id);
    }
    for (uint64_t id : due) {
      Connection& connection = *connections_.at(id);
      expiring_.erase(id);
      std::vector<std::string> missing;
      for (const std::string& key : connection.parked->keys)
        if (!data_.count(key)) missing.push_back(key);
      unpark(connection);
      FrameWriter writer;
      writer.u8(uint8_t(Status::TimedOut)).u32(static_cast<uint32_t>(missing.size()));
      for (const std::string& key : missing) writer.str(key);
      reply(connection, writer.finish());
      handleBufferedFrames(connection);
    }
  }

  // Takes a parked request off the waiting list of its key.
  void unpark(Connection& connection) {
    if (!connection.parked) return;
    const ParkedRequest& request = *connection.parked;
    if (request.next < request.keys.size()) {
      auto waiting = waiters_.find(request.keys[request.next]);
      if (waiting != waiters_.end()) {
        std::erase(waiting->second, connection.id);
        if (waiting->second.empty()) waiters_.erase(waiting);
      }
    }
    connection.parked.reset();
  }

  void reply(Connection& connection, std::string frame) {
    connection.output += frame;
    flush(connection);
  }

  void flush(Connection& connection) {
    int error = 0;
    long sent = net::sendSome(connection.fd.get(), connection.output, error);
    if (sent < 0) {
      log::debug("store", "store server {}: sending to {} failed: {}", endpoint_, connection.peer,
                 net::errorText(error));
      connection.dead = true;
      return;
    }
    connection.output.erase(0, static_cast<size_t>(sent));
    updateInterest(connection);
  }

  // Tells the client why (best effort, one non-blocking send) and, for
  // protocol violations, closes the connection.
  void refuse(Connection& connection, Refusal reason, const std::string& text, bool closeConnection) {
    if (closeConnection)
      log::warn("store", "store server {}: closing the connection from {}: {}", endpoint_, connection.peer, text);
    reply(connection, refusalFrame(reason, text));
    if (closeConnection) connection.dead = true;
  }

  void closeDeadConnections() {
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

  TcpStoreOptions options_;
  std::string endpoint_;
  std::string token_;
  size_t maxMessageBytes_;
  Fd listener_, wakeRead_, wakeWrite_;
  std::atomic<bool> stopping_{false};
  uint64_t nextId_ = 1;
  Fd epoll_;
  std::unordered_map<uint64_t, std::unique_ptr<Connection>> connections_;
  std::unordered_set<uint64_t> expiring_;  // connections whose parked request has a deadline
  std::unordered_map<std::string, std::string> data_;
  std::unordered_map<std::string, std::vector<uint64_t>> waiters_;  // key -> connections parked on it
};

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
