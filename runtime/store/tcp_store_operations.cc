// The TCP store server's operations (runtime/store/tcp_store_loop.h): one handler
// per operation, each reading its request to the end before it changes
// anything; the keys; the requests parked on missing keys and their expiry.
#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "runtime/errors.h"
#include "runtime/store/tcp_store_loop.h"

namespace bulkhead {

using namespace store_protocol;

void TcpStoreServer::Loop::handleRequest(Connection& connection, std::string_view body) {
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

void TcpStoreServer::Loop::dispatch(Connection& connection, Op op, FrameReader& reader) {
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

void TcpStoreServer::Loop::onHello(Connection& connection, FrameReader& reader) {
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

void TcpStoreServer::Loop::onSet(Connection& connection, FrameReader& reader) {
  std::string key = reader.str(), value = reader.str();
  reader.expectEnd();
  store(key, std::move(value));
  return reply(connection, FrameWriter().u8(uint8_t(Status::Ok)).finish());
}

void TcpStoreServer::Loop::onMultiSet(Connection& connection, FrameReader& reader) {
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

void TcpStoreServer::Loop::onParked(Connection& connection, Op op, FrameReader& reader) {
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

void TcpStoreServer::Loop::onTryGet(Connection& connection, FrameReader& reader) {
  std::string key = reader.str();
  reader.expectEnd();
  auto it = data_.find(key);
  FrameWriter writer;
  writer.u8(uint8_t(Status::Ok)).u8(it != data_.end()).str(it != data_.end() ? it->second : "");
  return reply(connection, writer.finish());
}

void TcpStoreServer::Loop::onMultiGet(Connection& connection, FrameReader& reader) {
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

void TcpStoreServer::Loop::onAdd(Connection& connection, FrameReader& reader) {
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

void TcpStoreServer::Loop::onCompareSet(Connection& connection, FrameReader& reader) {
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

void TcpStoreServer::Loop::onErase(Connection& connection, FrameReader& reader) {
  std::string key = reader.str();
  reader.expectEnd();
  bool existed = data_.erase(key) > 0;
  return reply(connection, FrameWriter().u8(uint8_t(Status::Ok)).u8(existed).finish());
}

void TcpStoreServer::Loop::refuseLargeReply(Connection& connection, size_t keys) {
  refuse(connection, Refusal::TooLarge,
         fmt::format("the values of these {} keys exceed the store's message limit of {} bytes; ask for fewer "
                     "keys at once",
                     keys, maxMessageBytes_),
         false);
}

void TcpStoreServer::Loop::store(const std::string& key, std::string value) {
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

void TcpStoreServer::Loop::advanceParked(Connection& connection) {
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

void TcpStoreServer::Loop::expireParkedRequests() {
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

void TcpStoreServer::Loop::unpark(Connection& connection) {
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

}  // namespace bulkhead
