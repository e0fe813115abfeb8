#pragma once
// Internal to runtime/: the TCP store server's loop, shared by
// tcp_store_server.cc (the epoll loop, connections, sockets) and
// tcp_store_operations.cc (one handler per operation, the keys and the
// requests parked on them). One thread runs it; only that thread touches the
// data and the connections, other threads reach it through the self-pipe
// (requestStop) and nothing else.

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "runtime/deadline.h"
#include "runtime/fd.h"
#include "runtime/store/store_protocol.h"
#include "runtime/store/tcp_store.h"

namespace bulkhead {

class TcpStoreServer::Loop {
 public:
  Loop(TcpStoreOptions options, std::string endpoint, Fd listener);

  // Safe from any thread: one byte on the self-pipe wakes poll().
  void requestStop();
  void run();

 private:
  using Op = store_protocol::Op;
  using FrameReader = store_protocol::FrameReader;
  using Refusal = store_protocol::Refusal;

  // A Get, Wait or SetAndGather waiting on the server for its keys. It is
  // listed under the first key still missing (keys[next]); when that key
  // appears it moves on to the next missing one, or is answered.
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

  static constexpr uint64_t kWakeId = ~uint64_t{0}, kListenerId = ~uint64_t{0} - 1;

  // The loop, the connections and the sockets (tcp_store_server.cc).
  void watch(int fd, uint64_t id, uint32_t events);
  // Reads while its pending replies are bounded (a client that does not read
  // its replies is not read from either), writes while replies are pending.
  void updateInterest(Connection& connection);
  // Until the earliest parked request with a deadline expires; only those are
  // looked at, not every connection.
  int waitTimeoutMs();
  void drainWakePipe();
  void acceptAll();
  void receive(Connection& connection);
  // Handles every complete frame in the input, in order, until one parks.
  void handleBufferedFrames(Connection& connection);
  void reply(Connection& connection, std::string frame);
  void flush(Connection& connection);
  // Tells the client why (best effort, one non-blocking send) and, for
  // protocol violations, closes the connection.
  void refuse(Connection& connection, Refusal reason, const std::string& text, bool closeConnection);
  void closeDeadConnections();

  // The operations (tcp_store_operations.cc).
  void handleRequest(Connection& connection, std::string_view body);
  // One handler per operation; each reads its request to the end before it
  // changes anything, so a malformed request changes nothing.
  void dispatch(Connection& connection, Op op, FrameReader& reader);
  void onHello(Connection& connection, FrameReader& reader);
  void onSet(Connection& connection, FrameReader& reader);
  void onMultiSet(Connection& connection, FrameReader& reader);
  void onParked(Connection& connection, Op op, FrameReader& reader);
  void onTryGet(Connection& connection, FrameReader& reader);
  void onMultiGet(Connection& connection, FrameReader& reader);
  void onAdd(Connection& connection, FrameReader& reader);
  void onCompareSet(Connection& connection, FrameReader& reader);
  void onErase(Connection& connection, FrameReader& reader);
  // A reply with the values of `keys` keys would exceed the message limit.
  void refuseLargeReply(Connection& connection, size_t keys);
  // Sets a key and moves on the requests parked on it.
  void store(const std::string& key, std::string value);
  // Answers a parked request whose keys all exist, or lists it under the
  // first key still missing. A wait counts a key erased after it appeared as
  // seen; a gather needs the values, so it looks at every key again first.
  void advanceParked(Connection& connection);
  void expireParkedRequests();
  // Takes a parked request off the waiting list of its key.
  void unpark(Connection& connection);

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

}  // namespace bulkhead
