// The TCP store client: a pool of authenticated connections, one request at a
// time on each, every wait polled against the call's deadline.
#include <fmt/format.h>

#include <cerrno>
#include <functional>

#include "runtime/backoff.h"
#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"
#include "runtime/store/store_protocol.h"
#include "runtime/store/tcp_store.h"

namespace bulkhead {

using namespace store_protocol;

namespace {

using Clock = Deadline::Clock;

// A parked get or wait is answered by the server (with the keys still
// missing) when the client's deadline passes; its answer may trail the
// client's clock by a network hop, so the client waits this much longer for it.
constexpr auto kReportGrace = std::chrono::milliseconds(100);
// Idle connections kept for reuse; more concurrent callers open more.
constexpr size_t kIdleConnections = 8;

// A reply that breaks the protocol: not retried, raised as CommError.
struct ProtocolViolation {
  std::string message;
};

uint32_t timeoutMsFor(Deadline deadline) {
  if (deadline.isNever()) return kNoTimeout;
  auto ms = std::chrono::ceil<std::chrono::milliseconds>(deadline.remaining()).count();
  return static_cast<uint32_t>(std::min<int64_t>(ms, kNoTimeout - 1));
}

// Sends `frame` and reads one reply body; nullopt when a deadline passed
// first. `sent` turns true once every byte of the request is out.
std::optional<std::string> exchange(int fd, const std::string& frame, Deadline sendDeadline, Deadline replyDeadline,
                                    int64_t maxMessageBytes, const std::string& peer, bool& sent) {
  if (!net::sendAll(fd, frame, sendDeadline, peer)) return std::nullopt;
  sent = true;
  char header[kHeaderBytes];
  if (!net::receiveExactly(fd, header, kHeaderBytes, replyDeadline, peer)) return std::nullopt;
  std::optional<uint32_t> length = bodyLength(std::string_view(header, kHeaderBytes));
  if (!length)
    throw ProtocolViolation{
        fmt::format("the reply is not a Bulkhead store frame (bad magic): is {} a "
                    "Bulkhead store server?",
                    peer)};
  if (*length == 0 || *length > static_cast<uint64_t>(maxMessageBytes))
    throw ProtocolViolation{
        fmt::format("the reply announces {} bytes, outside 1..{} (BULKHEAD_STORE_MAX_MESSAGE); "
                    "use the same limit on every rank",
                    *length, maxMessageBytes)};
  std::string body(*length, '\0');
  if (!net::receiveExactly(fd, body.data(), body.size(), replyDeadline, peer)) return std::nullopt;
  return body;
}

// Raises the error a Refused reply stands for.
[[noreturn]] void raiseRefusal(FrameReader& reader, const std::string& subject, const std::string& store, int rank) {
  auto reason = static_cast<Refusal>(reader.u8());
  std::string text = fmt::format("{} on store {} was refused: {}", subject, store, reader.str());
  ErrorContext context{.rank = rank};
  switch (reason) {
    case Refusal::Unauthorized:
      context.expected = "the job's store token";
      throw ConfigError(text, context);
    case Refusal::TooLarge:
    case Refusal::NotAnInteger:
    case Refusal::BadRequest:
      throw ConfigError(text, context);
    case Refusal::Malformed:
      break;
  }
  throw CommError(text, context);
}

}  // namespace

int64_t resolveMaxMessageBytes(const std::optional<int64_t>& option) {
  int64_t value = option ? *option : env::kStoreMaxMessage.integer();
  if (value < 1024 || value > (int64_t(1) << 30))
    throw ConfigError(fmt::format("the store message limit is {} bytes; use 1024 to 1073741824 ({} or "
                                  "TcpStoreOptions.maxMessageBytes)",
                                  value, env::kStoreMaxMessage.name()),
                      {.expected = "1 KiB to 1 GiB"});
  return value;
}

TcpStoreClient::TcpStoreClient(TcpStoreOptions options)
    : options_(std::move(options)),
      token_(options_.token.value_or(env::kStoreToken.text())),
      maxMessageBytes_(resolveMaxMessageBytes(options_.maxMessageBytes)),
      endpoint_(net::formatEndpoint(options_.host, options_.port)) {
  if (options_.port == 0)
    throw ConfigError(fmt::format("TcpStoreClient for host {} has port 0; pass the port the server reports "
                                  "(TcpStoreServer::port(), or MASTER_PORT)",
                                  options_.host),
                      {.rank = options_.rank, .expected = "the server's port"});
}

TcpStoreClient::~TcpStoreClient() = default;

std::string TcpStoreClient::describe() const { return "tcp://" + endpoint_; }

void TcpStoreClient::connect(Deadline deadline) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!idle_.empty()) return;
  }
  returnConnection(openConnection(deadline));
}

void TcpStoreClient::returnConnection(Fd fd) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (idle_.size() < kIdleConnections) idle_.push_back(std::move(fd));
}

Fd TcpStoreClient::openConnection(Deadline deadline) {
  auto started = Clock::now();
  Backoff backoff(std::chrono::milliseconds(50));
  int lastError = 0;
  while (true) {
    Fd fd;
    net::ConnectResult result = net::connectOnce(options_.host, options_.port, deadline, fd, lastError);
    if (result == net::ConnectResult::Connected) {
      std::string hello = FrameWriter().u8(uint8_t(Op::Hello)).u32(kVersion).str(token_).finish();
      std::optional<std::string> body;
      bool sent = false;
      try {
        body = exchange(fd.get(), hello, deadline, deadline, maxMessageBytes_, endpoint_, sent);
      } catch (const ProtocolViolation& violation) {
        throw CommError(fmt::format("hello to store {}: {}", describe(), violation.message), {.rank = options_.rank});
      } catch (const CommError&) {
        lastError = ECONNRESET;  // dropped during the hello (a server at its connection limit): try again
        result = net::ConnectResult::Refused;
      }
      if (body) {
        FrameReader reader(*body);
        if (static_cast<Status>(reader.u8()) != Status::Ok) raiseRefusal(reader, "hello", describe(), options_.rank);
        std::lock_guard<std::mutex> lock(mutex_);
        everConnected_ = true;
        return fd;
      }
      if (result == net::ConnectResult::Connected)
        throw TimeoutError(fmt::format("store server {} accepted a connection but did not answer its hello within "
                                       "{:.2f} s; check that {} is a Bulkhead store server and that {} is not "
                                       "stalled, or extend the deadline",
                                       endpoint_, secondsSince(started), endpoint_, options_.serverOwner),
                           {.rank = options_.rank, .expected = "a hello reply from the store server"});
    }
    if (result == net::ConnectResult::DeadlinePassed || deadline.expired())
      throw TimeoutError(fmt::format("could not connect to the store server at {} within {:.2f} s (last error: {}); "
                                     "check that {} started the server, that {} is reachable from this host, "
                                     "or extend the deadline ({})",
                                     endpoint_, secondsSince(started), net::errorText(lastError), options_.serverOwner,
                                     endpoint_, env::kInitTimeout.name()),
                         {.rank = options_.rank, .expected = "a store server listening at " + endpoint_});
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (everConnected_ && lastError == ECONNREFUSED)
        throw CommError(fmt::format("the store server at {} refuses connections after this client had reached it: "
                                    "it stopped (did {} exit?); look for {}'s error",
                                    endpoint_, options_.serverOwner, options_.serverOwner),
                        {.rank = options_.rank, .expected = "the store server to outlive its clients"});
    }
    backoff.pause(deadline);
  }
}

std::string TcpStoreClient::roundTrip(const std::function<std::string()>& makeFrame, const std::string& subject,
                                      Call call, Deadline deadline) {
  auto started = Clock::now();
  bool waits = call == Call::WaitForKeys;
  Deadline replyDeadline = waits && !deadline.isNever() ? Deadline::at(deadline.when() + kReportGrace) : deadline;
  ErrorContext context{.rank = options_.rank};
  while (true) {
    std::string frame = makeFrame();  // a wait's timeout is counted from each send
    if (frame.size() - kHeaderBytes > static_cast<size_t>(maxMessageBytes_))
      throw ConfigError(
          fmt::format("{} on store {}: the request is {} bytes, over the store's limit of {} bytes ({}); "
                      "keep store values small, or raise the limit on every rank",
                      subject, describe(), frame.size() - kHeaderBytes, maxMessageBytes_, env::kStoreMaxMessage.name()),
          {.rank = options_.rank, .expected = "a request within the store's message limit"});
    Fd fd;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        fd = std::move(idle_.back());
        idle_.pop_back();
      }
    }
    if (!fd.valid()) fd = openConnection(deadline);
    bool sent = false;
    std::optional<std::string> body;
    try {
      body = exchange(fd.get(), frame, deadline, replyDeadline, maxMessageBytes_, endpoint_, sent);
    } catch (const ProtocolViolation& violation) {
      throw CommError(fmt::format("{} on store {}: {}", subject, describe(), violation.message), context);
    } catch (const CommError& error) {
      if (call == Call::Count && sent)
        throw CommError(fmt::format("{} on store {}: the connection dropped after the request was sent, so it may "
                                    "or may not have been applied ({}); read the key to find out",
                                    subject, describe(), error.message()),
                        context);
      if (deadline.expired())
        throw TimeoutError(fmt::format("{} on store {}: {}", subject, describe(), error.message()), context);
      log::debug("store", "{} on store {}: the connection dropped ({}); reconnecting", subject, describe(),
                 error.message());
      continue;  // fd closes here; the next pass opens a fresh connection
    }
    if (!body) {
      bool writes = call == Call::Write || call == Call::Count;
      throw TimeoutError(
          fmt::format("{} on store {} did not complete within {:.2f} s: the server did not answer{}; "
                      "check that the store server ({}) is alive and not overloaded, or extend "
                      "the deadline",
                      subject, describe(), secondsSince(started),
                      writes ? " (the write may or may not have been applied)" : "", options_.serverOwner),
          context);
    }
    FrameReader reader(*body);
    auto status = static_cast<Status>(reader.u8());
    if (status == Status::Refused) raiseRefusal(reader, subject, describe(), options_.rank);
    returnConnection(std::move(fd));  // the connection is in step: reusable
    if (status == Status::TimedOut) {
      std::vector<std::string> missing(reader.count(4));
      for (std::string& key : missing) key = reader.str();
      context.expected = "keys set by other ranks before the deadline";
      throw TimeoutError(fmt::format("{} on store {}: {} {} not set within {:.2f} s; check that the ranks that set "
                                     "them are alive and use the same keys (and prefix), or extend the deadline",
                                     subject, describe(), missing.size() == 1 ? "key" : "keys", quoteKeys(missing),
                                     secondsSince(started)),
                         context);
    }
    if (status != Status::Ok)
      throw CommError(fmt::format("{} on store {}: unknown reply status {}", subject, describe(), int(status)),
                      context);
    return body->substr(1);
  }
}

void TcpStoreClient::set(const std::string& key, const std::string& value, Deadline deadline) {
  requireKey(key, *this, options_.rank);
  auto frame = [&] { return FrameWriter().u8(uint8_t(Op::Set)).str(key).str(value).finish(); };
  FrameReader(roundTrip(frame, fmt::format("set('{}')", key), Call::Write, deadline)).expectEnd();
}

std::string TcpStoreClient::get(const std::string& key, Deadline deadline) {
  requireKey(key, *this, options_.rank);
  auto frame = [&] { return FrameWriter().u8(uint8_t(Op::Get)).str(key).u32(timeoutMsFor(deadline)).finish(); };
  std::string body = roundTrip(frame, fmt::format("get('{}')", key), Call::WaitForKeys, deadline);
  FrameReader reader(body);
  std::string value = reader.str();
  reader.expectEnd();
  return value;
}

std::optional<std::string> TcpStoreClient::tryGet(const std::string& key, Deadline deadline) {
  requireKey(key, *this, options_.rank);
  auto frame = [&] { return FrameWriter().u8(uint8_t(Op::TryGet)).str(key).finish(); };
  std::string body = roundTrip(frame, fmt::format("tryGet('{}')", key), Call::Read, deadline);
  FrameReader reader(body);
  bool present = reader.u8() != 0;
  std::string value = reader.str();
  reader.expectEnd();
  return present ? std::optional<std::string>(std::move(value)) : std::nullopt;
}

std::vector<std::optional<std::string>> TcpStoreClient::multiGet(const std::vector<std::string>& keys,
                                                                 Deadline deadline) {
  if (keys.empty()) return {};
  for (const std::string& key : keys) requireKey(key, *this, options_.rank);
  auto frame = [&] {
    FrameWriter writer;
    writer.u8(uint8_t(Op::MultiGet)).u32(static_cast<uint32_t>(keys.size()));
    for (const std::string& key : keys) writer.str(key);
    return writer.finish();
  };
  std::string subject = fmt::format("multiGet({})", quoteKeys(keys, 4));
  std::string body = roundTrip(frame, subject, Call::Read, deadline);
  FrameReader reader(body);
  if (reader.count(5) != keys.size())
    throw CommError(fmt::format("{} on store {}: the reply holds a different number of values than keys asked", subject,
                                describe()),
                    {.rank = options_.rank});
  std::vector<std::optional<std::string>> values(keys.size());
  for (auto& value : values) {
    bool present = reader.u8() != 0;
    std::string text = reader.str();
    if (present) value = std::move(text);
  }
  reader.expectEnd();
  return values;
}

void TcpStoreClient::multiSet(const std::vector<std::pair<std::string, std::string>>& pairs, Deadline deadline) {
  if (pairs.empty()) return;
  std::vector<std::string> keys;
  for (const auto& [key, value] : pairs) {
    requireKey(key, *this, options_.rank);
    keys.push_back(key);
  }
  auto frame = [&] {
    FrameWriter writer;
    writer.u8(uint8_t(Op::MultiSet)).u32(static_cast<uint32_t>(pairs.size()));
    for (const auto& [key, value] : pairs) writer.str(key).str(value);
    return writer.finish();
  };
  std::string subject = fmt::format("multiSet({})", quoteKeys(keys, 4));
  FrameReader(roundTrip(frame, subject, Call::Write, deadline)).expectEnd();
}

int64_t TcpStoreClient::add(const std::string& key, int64_t delta, Deadline deadline) {
  requireKey(key, *this, options_.rank);
  auto frame = [&] { return FrameWriter().u8(uint8_t(Op::Add)).str(key).i64(delta).finish(); };
  std::string body = roundTrip(frame, fmt::format("add('{}', {})", key, delta), Call::Count, deadline);
  FrameReader reader(body);
  int64_t value = reader.i64();
  reader.expectEnd();
  return value;
}

std::string TcpStoreClient::compareSet(const std::string& key, const std::string& expected, const std::string& desired,
                                       Deadline deadline) {
  requireKey(key, *this, options_.rank);
  auto frame = [&] { return FrameWriter().u8(uint8_t(Op::CompareSet)).str(key).str(expected).str(desired).finish(); };
  std::string body = roundTrip(frame, fmt::format("compareSet('{}')", key), Call::Write, deadline);
  FrameReader reader(body);
  std::string value = reader.str();
  reader.expectEnd();
  return value;
}

std::vector<std::string> TcpStoreClient::setAndGather(const SetAndGather& round, Deadline deadline) {
  requireKey(round.key, *this, options_.rank);
  for (const std::string& key : round.keys) requireKey(key, *this, options_.rank);
  // Resent whole after a dropped connection: setting, erasing and waiting again is harmless.
  auto frame = [&] {
    FrameWriter writer;
    writer.u8(uint8_t(Op::SetAndGather)).str(round.key).str(round.value).str(round.erase);
    writer.u32(static_cast<uint32_t>(round.keys.size()));
    for (const std::string& key : round.keys) writer.str(key);
    return writer.u32(timeoutMsFor(deadline)).finish();
  };
  std::string subject = fmt::format("setAndGather('{}', {})", round.key, quoteKeys(round.keys, 4));
  std::string body = roundTrip(frame, subject, Call::WaitForKeys, deadline);  // the reader views it
  FrameReader reader(body);
  if (reader.count(4) != round.keys.size())
    throw CommError(fmt::format("{} on store {}: the reply holds a different number of values than keys asked", subject,
                                describe()),
                    {.rank = options_.rank});
  std::vector<std::string> values(round.keys.size());
  for (std::string& value : values) value = reader.str();
  reader.expectEnd();
  return values;
}

void TcpStoreClient::wait(const std::vector<std::string>& keys, Deadline deadline) {
  if (keys.empty()) return;
  for (const std::string& key : keys) requireKey(key, *this, options_.rank);
  auto frame = [&] {
    FrameWriter writer;
    writer.u8(uint8_t(Op::Wait)).u32(static_cast<uint32_t>(keys.size()));
    for (const std::string& key : keys) writer.str(key);
    return writer.u32(timeoutMsFor(deadline)).finish();
  };
  FrameReader(roundTrip(frame, fmt::format("wait({})", quoteKeys(keys, 4)), Call::WaitForKeys, deadline)).expectEnd();
}

bool TcpStoreClient::erase(const std::string& key, Deadline deadline) {
  requireKey(key, *this, options_.rank);
  auto frame = [&] { return FrameWriter().u8(uint8_t(Op::Erase)).str(key).finish(); };
  std::string body = roundTrip(frame, fmt::format("erase('{}')", key), Call::Write, deadline);
  FrameReader reader(body);
  bool existed = reader.u8() != 0;
  reader.expectEnd();
  return existed;
}

}  // namespace bulkhead
