// TcpStore behaviour beyond the Store contract: authentication, hostile and
// malformed input on raw sockets, unreachable servers, shutdown, and threads
// sharing one client. Real sockets on 127.0.0.1 throughout.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <vector>

#include "runtime/store/socket.h"
#include "runtime/store/store_protocol.h"
#include "tests/runtime/store_harness.h"

using namespace bulkhead;
using namespace bulkhead::testing;
namespace wire = bulkhead::store_protocol;

namespace {

// A plain blocking socket to the server, reads bounded to 3 s.
Fd rawConnect(uint16_t port) {
  Fd fd(::socket(AF_INET, SOCK_STREAM, 0));
  REQUIRE(fd.valid());
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  timeval limit{.tv_sec = 3, .tv_usec = 0};
  setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof(limit));
  return fd;
}

void rawSend(int fd, const std::string& bytes) {
  REQUIRE(::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size()));
}

// Every byte the server sends until it closes the connection; `closed` tells
// whether it did (rather than the 3 s read limit passing).
std::string readUntilClosed(int fd, bool& closed) {
  std::string bytes;
  char chunk[4096];
  while (true) {
    ssize_t got = ::recv(fd, chunk, sizeof(chunk), 0);
    if (got <= 0) {
      closed = got == 0 || errno == ECONNRESET;
      return bytes;
    }
    bytes.append(chunk, static_cast<size_t>(got));
  }
}

// Splits a byte stream into frame bodies.
std::vector<std::string> frames(const std::string& bytes) {
  std::vector<std::string> bodies;
  size_t offset = 0;
  while (bytes.size() - offset >= wire::kHeaderBytes) {
    auto length = wire::bodyLength(std::string_view(bytes).substr(offset));
    REQUIRE(length.has_value());
    REQUIRE(bytes.size() - offset - wire::kHeaderBytes >= *length);
    bodies.push_back(bytes.substr(offset + wire::kHeaderBytes, *length));
    offset += wire::kHeaderBytes + *length;
  }
  CHECK(offset == bytes.size());
  return bodies;
}

// The refusal reason and text of a reply body; fails the test if it is not one.
std::pair<wire::Refusal, std::string> refusal(const std::string& body) {
  wire::FrameReader reader(body);
  REQUIRE(static_cast<wire::Status>(reader.u8()) == wire::Status::Refused);
  auto reason = static_cast<wire::Refusal>(reader.u8());
  return {reason, reader.str()};
}

std::string hello(const std::string& token) {
  return wire::FrameWriter().u8(uint8_t(wire::Op::Hello)).u32(wire::kVersion).str(token).finish();
}

// A port on 127.0.0.1 that nobody listens on: bound, then released.
uint16_t closedPort() {
  Fd probe = net::listenOn("127.0.0.1", 0, 1);
  return net::localPort(probe.get());
}

void checkServes(Store& store, std::mt19937_64& rng) {
  std::string value = randomBytes(rng, 100);
  store.set("alive", value, seconds(5));
  CHECK(store.get("alive", seconds(5)) == value);
}

}  // namespace

TEST_CASE("a client with the wrong token is refused with ConfigError; authenticated clients keep working") {
  TcpHarness harness;
  std::mt19937_64 rng(21);
  auto good = harness.client();
  checkServes(*good, rng);
  TcpStoreOptions options = harness.clientOptions();
  options.token = harness.token + "x";
  TcpStoreClient intruder(options);
  auto [error, elapsed] = expectError<ConfigError>([&] { intruder.set("alive", "overwritten", seconds(2)); });
  INFO(error.what());
  CHECK(std::string(error.what()).find("wrong store token") != std::string::npos);
  CHECK(error.expected() == "the job's store token");
  CHECK(elapsed < 1.0);
  CHECK_THROWS_AS(TcpStoreClient(TcpStoreOptions{.port = harness.server.port(), .token = ""}).connect(seconds(2)),
                  ConfigError);
  checkServes(*good, rng);
  CHECK(good->add("n", 2, seconds(5)) == 2);
}

TEST_CASE("an oversized frame is refused from its header, its connection closed, and the server serves on") {
  std::mt19937_64 rng(22);
  std::string token = randomWord(rng, 16);
  constexpr int64_t kLimit = 64 * 1024;
  TcpStoreServer server({.port = 0, .token = token, .maxMessageBytes = kLimit});
  TcpStoreClient good({.port = server.port(), .token = token, .maxMessageBytes = kLimit});
  checkServes(good, rng);
  for (uint32_t announced : {uint32_t(kLimit + 1), uint32_t(0xfffffff0)}) {
    Fd raw = rawConnect(server.port());
    std::string header(wire::kHeaderBytes, '\0');
    std::string frame = hello(token);  // the header of a frame: magic, then the announced length
    header.replace(0, 4, frame.substr(0, 4));
    for (int i = 0; i < 4; ++i) header[4 + i] = static_cast<char>((announced >> (8 * i)) & 0xff);
    rawSend(raw.get(), frame + header + randomBytes(rng, 1000));
    bool closed = false;
    std::vector<std::string> replies = frames(readUntilClosed(raw.get(), closed));
    CHECK(closed);
    REQUIRE(replies.size() == 2);
    CHECK(static_cast<wire::Status>(replies[0][0]) == wire::Status::Ok);
    auto [reason, text] = refusal(replies[1]);
    CHECK(reason == wire::Refusal::TooLarge);
    CHECK(text.find(std::to_string(announced)) != std::string::npos);
    checkServes(good, rng);
  }
  // The client refuses to send one itself, and stays usable.
  auto [error, elapsed] = expectError<ConfigError>([&] { good.set("big", randomBytes(rng, kLimit), seconds(2)); });
  CHECK(std::string(error.what()).find("BULKHEAD_STORE_MAX_MESSAGE") != std::string::npos);
  checkServes(good, rng);
}

TEST_CASE("random bytes, a garbled body or a request before hello are refused and the server serves on") {
  TcpHarness harness;
  std::mt19937_64 rng(23);
  auto good = harness.client();
  std::string authenticated = hello(harness.token);
  std::string garbledBody = randomBytes(rng, 100);
  garbledBody[0] = static_cast<char>(0x7f);  // no such operation
  std::string garbled = wire::FrameWriter().finish();
  for (int i = 0; i < 4; ++i) garbled[4 + i] = static_cast<char>((100 >> (8 * i)) & 0xff);
  struct Case {
    const char* what;
    std::string bytes;
    size_t okReplies;
    wire::Refusal reason;
  };
  std::vector<Case> cases = {
      {"4 KiB of random bytes", randomBytes(rng, 4096), 0, wire::Refusal::Malformed},
      {"a frame of random bytes after hello", authenticated + garbled + garbledBody, 1, wire::Refusal::Malformed},
      {"a set before hello", wire::FrameWriter().u8(uint8_t(wire::Op::Set)).str("k").str("v").finish(), 0,
       wire::Refusal::Unauthorized},
      {"a truncated set after hello", authenticated + wire::FrameWriter().u8(uint8_t(wire::Op::Set)).u32(50).finish(),
       1, wire::Refusal::Malformed},
      {"a multiSet announcing 3 pairs and carrying 1 after hello",
       authenticated + wire::FrameWriter().u8(uint8_t(wire::Op::MultiSet)).u32(3).str("k").str("v").finish(), 1,
       wire::Refusal::Malformed},
      {"a multiSet before hello", wire::FrameWriter().u8(uint8_t(wire::Op::MultiSet)).u32(1).str("k").str("v").finish(),
       0, wire::Refusal::Unauthorized},
  };
  for (const Case& bad : cases) {
    INFO(bad.what);
    Fd raw = rawConnect(harness.server.port());
    rawSend(raw.get(), bad.bytes);
    bool closed = false;
    std::vector<std::string> replies = frames(readUntilClosed(raw.get(), closed));
    CHECK(closed);
    REQUIRE(replies.size() == bad.okReplies + 1);
    CHECK(refusal(replies.back()).first == bad.reason);
    checkServes(*good, rng);
  }
  CHECK_FALSE(good->tryGet("k", seconds(2)).has_value());
}

TEST_CASE("a client of a port where nobody listens raises TimeoutError within the deadline, naming host:port") {
  uint16_t port = closedPort();
  TcpStoreClient client({.port = port, .token = "t"});
  auto [error, elapsed] = expectError<TimeoutError>([&] { client.get("k", seconds(0.3)); });
  INFO(error.what());
  CHECK(elapsed >= 0.3);
  CHECK(elapsed < 0.8);
  CHECK(std::string(error.what()).find(fmt::format("127.0.0.1:{}", port)) != std::string::npos);
}

TEST_CASE("a client of a socket that listens but never accepts raises TimeoutError within the deadline") {
  Fd silent = net::listenOn("127.0.0.1", 0, 4);
  uint16_t port = net::localPort(silent.get());
  TcpStoreClient client({.port = port, .token = "t"});
  auto [error, elapsed] = expectError<TimeoutError>([&] { client.set("k", "v", seconds(0.4)); });
  INFO(error.what());
  CHECK(elapsed >= 0.4);
  CHECK(elapsed < 0.9);
  CHECK(std::string(error.what()).find(fmt::format("127.0.0.1:{}", port)) != std::string::npos);
}

TEST_CASE("a get that waits on one thread does not hold up other calls on the same client") {
  TcpHarness harness;
  auto shared = harness.client();
  std::mt19937_64 rng(25);
  std::string late = randomBytes(rng, 64);
  std::string seen;
  std::thread waiter([&] { seen = shared->get("late", seconds(20)); });
  auto started = Clock::now();
  for (int i = 0; i < 200; ++i) {
    std::string value = randomBytes(rng, 1 + rng() % 50);
    shared->set(fmt::format("beat/{}", i % 7), value, seconds(2));
    CHECK(shared->get(fmt::format("beat/{}", i % 7), seconds(2)) == value);
  }
  CHECK(secondsSince(started) < 5.0);
  shared->set("late", late, seconds(2));
  waiter.join();
  CHECK(seen == late);
}

TEST_CASE("stopping the server while clients wait takes under 2 s; the clients then get errors, not hangs") {
  auto harness = std::make_unique<TcpHarness>();
  constexpr int kClients = 4;
  std::vector<std::shared_ptr<Store>> clients;
  for (int i = 0; i < kClients; ++i) clients.push_back(harness->client());
  std::atomic<int> errors{0};
  std::atomic<int64_t> lastErrorAt{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&, i] {
      clients[i]->set(fmt::format("ready/{}", i), "1", seconds(5));
      try {
        clients[i]->get("never", seconds(10));
      } catch (const Error&) {
        ++errors;
        lastErrorAt = Clock::now().time_since_epoch().count();
      }
    });
  std::vector<std::string> ready;
  for (int i = 0; i < kClients; ++i) ready.push_back(fmt::format("ready/{}", i));
  clients[0]->wait(ready, seconds(5));
  auto stopping = Clock::now();
  harness->server.stop(seconds(2));
  CHECK(secondsSince(stopping) < 2.0);
  CHECK_FALSE(harness->server.running());
  for (auto& thread : threads) thread.join();
  CHECK(errors.load() == kClients);
  double errorDelay =
      std::chrono::duration<double>(Clock::time_point(Clock::duration(lastErrorAt.load())) - stopping).count();
  CHECK(errorDelay < 2.0);
  for (auto& client : clients) {
    auto [error, elapsed] = expectError<Error>([&] { client->add("n", 1, seconds(1)); });
    CHECK(elapsed < 1.5);
  }
  harness.reset();
}

TEST_CASE("a server asked for a port already in use raises CommError naming it") {
  TcpHarness harness;
  auto [error, elapsed] = expectError<CommError>([&] { TcpStoreServer({.port = harness.server.port()}); });
  CHECK(std::string(error.what()).find(harness.server.endpoint()) != std::string::npos);
}

TEST_CASE("the server holds more connections than a poll loop's old cap of 4,096, each served") {
  // Each connection a rank's: hello, then a set of its own key. 2 x 5,000
  // descriptors in this process (client and server ends).
  rlimit limit{};
  REQUIRE(getrlimit(RLIMIT_NOFILE, &limit) == 0);
  const int connections = 5000;
  TcpHarness harness;  // raises the soft limit to the hard one
  REQUIRE(getrlimit(RLIMIT_NOFILE, &limit) == 0);
  if (limit.rlim_cur < static_cast<rlim_t>(2 * connections + 256)) {
    WARN("descriptor limit " << limit.rlim_cur << " is too low for " << connections << " connections here");
    return;
  }
  std::mt19937_64 rng(4097);
  std::vector<Fd> sockets;
  std::vector<std::string> keys, values;
  for (int i = 0; i < connections; ++i) {
    keys.push_back(fmt::format("alive/{}", i));
    values.push_back(std::to_string(rng()));
    sockets.push_back(rawConnect(harness.server.port()));
    rawSend(sockets.back().get(),
            hello(harness.token) +
                wire::FrameWriter().u8(uint8_t(wire::Op::Set)).str(keys.back()).str(values.back()).finish());
  }
  auto reader = harness.client();
  reader->wait(keys, seconds(30));
  auto read = reader->multiGet(keys, seconds(30));
  int served = 0;
  for (int i = 0; i < connections; ++i) served += read[i] == values[i];
  CHECK(served == connections);
}
