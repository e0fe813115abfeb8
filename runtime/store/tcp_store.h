#pragma once
// The TCP rendezvous store: a server that rank 0 hosts in-process, and a
// client (a Store, see store.h) on every rank, rank 0 included.
//
// Server: one thread runs an epoll loop over non-blocking sockets (its work
// per event does not grow with the number of connections). It binds to
// the address it is given (port 0 picks a free port; port() reports it).
// Every connection must open with a hello carrying the per-job token. A wrong
// token, a frame over maxMessageBytes (refused from its header, never
// allocated), or bytes that are not the protocol get an error reply where
// possible and that connection is closed; the server logs a warning and keeps
// serving everyone else. get and wait are parked on the server and answered
// when their keys appear, or with the missing keys when their deadline passes.
// stop() wakes the loop through a self-pipe, closes every socket and joins the
// thread within its deadline.
//
// Client: thread-safe. Each call borrows an idle connection from a small pool
// (or opens one), so a get that waits never holds up a heartbeat on another
// thread. Connecting is non-blocking and polled against the call's deadline;
// while nobody listens yet (rank 0 not up) it retries until the deadline, then
// raises TimeoutError naming host:port. A connection that drops is reopened
// and the call retried while the deadline allows, except:
//  - add whose request was already sent raises CommError (it may have been
//    applied; retrying could count twice);
//  - a server that accepted this client before and now refuses connections is
//    gone (rank 0 exited): CommError at once, no waiting.
// A refused token is a ConfigError; a reply that breaks the protocol is a
// CommError.

#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "runtime/store/socket.h"
#include "runtime/store/store.h"

namespace bulkhead {

struct TcpStoreOptions {
  // Server: the address to bind ("0.0.0.0" for every interface). Client: the
  // server's address (numeric, or a name the system resolver knows).
  std::string host = "127.0.0.1";
  // Server: 0 picks a free port. Client: the server's port.
  uint16_t port = 0;
  // Unset: BULKHEAD_STORE_TOKEN. Server and clients must agree.
  std::optional<std::string> token;
  // Unset: BULKHEAD_STORE_MAX_MESSAGE. The largest request or reply body.
  std::optional<int64_t> maxMessageBytes;
  // Server only: connections beyond this many are closed at once, with a
  // warning; 0: no cap but the process's descriptor limit (which the server
  // raises to its hard limit).
  int maxConnections = 0;
  // This process's rank, carried by the errors this store raises.
  int rank = -1;
  // Client only: who runs the server, for the client's messages ("did rank 0 exit?").
  std::string serverOwner = "rank 0";
};

class TcpStoreServer {
 public:
  // Binds, listens and starts the serving thread. Does not block.
  // CommError when the address cannot be bound; ConfigError on a bad option.
  explicit TcpStoreServer(TcpStoreOptions options = {});
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;
  // stop() with a 2 s deadline.
  ~TcpStoreServer();

  const std::string& host() const { return host_; }
  // The bound port (the one picked when the options asked for 0).
  uint16_t port() const { return port_; }
  // "127.0.0.1:29500"
  std::string endpoint() const;

  // Wakes the loop, closes every connection and joins the thread. If the
  // thread has not ended by the deadline, it is logged and left to end on its
  // own; stop() returns either way. Idempotent.
  void stop(Deadline deadline);
  bool running() const { return thread_.joinable(); }

  class Loop;  // tcp_store_server.cc

 private:
  std::string host_;
  uint16_t port_ = 0;
  std::shared_ptr<Loop> loop_;
  std::future<void> finished_;
  std::thread thread_;
};

class TcpStoreClient final : public Store {
 public:
  // Does not connect: the first call (or connect()) does, under its deadline.
  explicit TcpStoreClient(TcpStoreOptions options);
  ~TcpStoreClient() override;

  // Opens and authenticates one connection now, so that a wrong address or
  // token shows at startup rather than at first use.
  void connect(Deadline deadline);

  void set(const std::string& key, const std::string& value, Deadline deadline) override;
  std::string get(const std::string& key, Deadline deadline) override;
  std::optional<std::string> tryGet(const std::string& key, Deadline deadline) override;
  std::vector<std::optional<std::string>> multiGet(const std::vector<std::string>& keys, Deadline deadline) override;
  void multiSet(const std::vector<std::pair<std::string, std::string>>& pairs, Deadline deadline) override;
  std::vector<std::string> setAndGather(const SetAndGather& round, Deadline deadline) override;
  int64_t add(const std::string& key, int64_t delta, Deadline deadline) override;
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired,
                         Deadline deadline) override;
  void wait(const std::vector<std::string>& keys, Deadline deadline) override;
  bool erase(const std::string& key, Deadline deadline) override;
  std::string describe() const override;

 private:
  // What a call does, for its retries and messages. Read, Write and
  // WaitForKeys are idempotent: retried on a dropped connection while the
  // deadline allows. Count (add) is retried only if its request was not sent.
  enum class Call { Read, Write, Count, WaitForKeys };

  Fd openConnection(Deadline deadline);
  // Sends one request (built by makeFrame for each attempt, so a wait's
  // timeout counts from its send) and returns the reply body after its Ok
  // status. A TimedOut reply raises TimeoutError naming the missing keys;
  // `subject` names the call in every message.
  std::string roundTrip(const std::function<std::string()>& makeFrame, const std::string& subject, Call call,
                        Deadline deadline);
  void returnConnection(Fd fd);

  TcpStoreOptions options_;
  std::string token_;
  int64_t maxMessageBytes_;
  std::string endpoint_;
  std::mutex mutex_;
  std::vector<Fd> idle_;        // guarded by mutex_
  bool everConnected_ = false;  // guarded by mutex_
};

// The store message limit: the option, else BULKHEAD_STORE_MAX_MESSAGE;
// ConfigError unless it lies in [1 KiB, 1 GiB].
int64_t resolveMaxMessageBytes(const std::optional<int64_t>& option);

}  // namespace bulkhead
