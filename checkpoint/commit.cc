#include "checkpoint/commit.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoint/manifest.h"
#include "runtime/backoff.h"

namespace bulkhead::checkpoint::commit {
namespace {

constexpr size_t kPartBytes = 256 << 10;
constexpr size_t kPartsPerFetch = 16;  // keeps one multiGet reply near 4 MiB

// One store round trip inside a wait bounded by the caller's deadline.
Deadline roundTrip() { return Deadline::afterSeconds(5); }

}  // namespace

Failure Failure::of(const std::exception& error) {
  if (const auto* typed = dynamic_cast<const Error*>(&error)) {
    std::string where = typed->rank() >= 0 ? fmt::format("on rank {}: ", typed->rank()) : "";
    std::string expected = typed->expected().empty() ? "" : fmt::format(" (expected: {})", typed->expected());
    return {typed->kind(), where + typed->message() + expected};
  }
  return {"Error", error.what()};
}

std::string Failure::encode() const { return fmt::format("failed {} {}", kind, escape(message)); }

std::optional<Failure> Failure::decode(const std::string& text) {
  if (text.rfind("failed ", 0) != 0) return std::nullopt;
  size_t space = text.find(' ', 7);
  if (space == std::string::npos) return Failure{text.substr(7), ""};
  auto message = unescape(text.substr(space + 1));
  return Failure{text.substr(7, space - 7), message.value_or(text.substr(space + 1))};
}

void Failure::raise(int rank) const {
  ErrorContext context{.rank = rank};
  if (kind == "IoError") throw IoError(message, context);
  if (kind == "TimeoutError") throw TimeoutError(message, context);
  if (kind == "ConfigError") throw ConfigError(message, context);
  if (kind == "CommError") throw CommError(message, context);
  throw CheckpointError(message, context);
}

void Exchange::publish(const std::string& report, Deadline deadline) {
  size_t parts = std::max<size_t>(1, (report.size() + kPartBytes - 1) / kPartBytes);
  for (size_t i = 0; i < parts; ++i)
    store_->set(key(fmt::format("report/{}/{}", rank_, i)), report.substr(i * kPartBytes, kPartBytes), deadline);
  store_->set(key(fmt::format("status/{}", rank_)), fmt::format("ok {}", parts), deadline);
  store_->add(key("count"), 1, deadline);
}

void Exchange::publishFailure(const Failure& failure, Deadline deadline) {
  std::string text = fmt::format("{} {}", rank_, failure.encode());
  store_->set(key(fmt::format("status/{}", rank_)), failure.encode(), deadline);
  store_->compareSet(key("failure"), "", text, deadline);
  store_->add(key("count"), 1, deadline);
}

std::optional<Failure> Exchange::gather(std::vector<std::string>& reports, Deadline deadline) {
  auto started = Deadline::Clock::now();
  Backoff backoff(std::chrono::milliseconds(20));
  for (;;) {
    auto values = store_->multiGet({key("count"), key("failure")}, roundTrip());
    if (values[1]) {
      // "<rank> failed <kind> <message>"
      size_t space = values[1]->find(' ');
      auto failure = Failure::decode(values[1]->substr(space + 1));
      if (failure) return failure;
      return Failure{"CheckpointError", *values[1]};
    }
    int64_t count = values[0] ? parseStoreInteger(*values[0]).value_or(0) : 0;
    if (count >= worldSize_) break;
    if (deadline.expired()) {
      std::vector<std::string> keys;
      for (int r = 0; r < worldSize_; ++r) keys.push_back(key(fmt::format("status/{}", r)));
      auto statuses = store_->multiGet(keys, roundTrip());
      std::vector<int> missing;
      for (int r = 0; r < worldSize_; ++r)
        if (!statuses[r]) missing.push_back(r);
      return Failure{"TimeoutError",
                     fmt::format("rank{} {} did not report {} within the checkpoint deadline ({:.1f} s): a stalled "
                                 "or dead writer, or a slow file system; raise BULKHEAD_CHECKPOINT_TIMEOUT if the "
                                 "storage is just slow",
                                 missing.size() == 1 ? "" : "s", fmt::join(missing, ","),
                                 missing.size() == 1 ? "its file" : "their files", secondsSince(started))};
    }
    backoff.pause(deadline);
  }
  std::vector<std::string> statusKeys;
  for (int r = 0; r < worldSize_; ++r) statusKeys.push_back(key(fmt::format("status/{}", r)));
  auto statuses = store_->multiGet(statusKeys, roundTrip());
  reportKeys_.clear();
  std::vector<std::pair<int, std::string>> parts;  // (rank, key)
  for (int r = 0; r < worldSize_; ++r) {
    const auto& status = statuses[r];
    if (!status) return Failure{"CheckpointError", fmt::format("rank {} counted its report but left no status", r)};
    if (auto failure = Failure::decode(*status)) return failure;
    size_t count = std::stoul(status->substr(3));
    for (size_t i = 0; i < count; ++i) parts.emplace_back(r, key(fmt::format("report/{}/{}", r, i)));
  }
  reports.assign(worldSize_, "");
  for (size_t begin = 0; begin < parts.size(); begin += kPartsPerFetch) {
    std::vector<std::string> keys;
    for (size_t i = begin; i < std::min(parts.size(), begin + kPartsPerFetch); ++i) keys.push_back(parts[i].second);
    auto values = store_->multiGet(keys, roundTrip());
    for (size_t i = 0; i < keys.size(); ++i) {
      if (!values[i]) return Failure{"CheckpointError", fmt::format("the report part {} is missing", keys[i])};
      reports[parts[begin + i].first] += *values[i];
      reportKeys_.push_back(keys[i]);
    }
  }
  return std::nullopt;
}

std::string Exchange::claim(const std::string& verdict, Deadline deadline) {
  return store_->compareSet(key("verdict"), "", verdict, deadline);
}

std::optional<std::string> Exchange::verdict(Deadline deadline) {
  try {
    return store_->get(key("verdict"), deadline);
  } catch (const TimeoutError&) {
    return std::nullopt;
  }
}

std::optional<std::string> Exchange::peekVerdict(Deadline deadline) { return store_->tryGet(key("verdict"), deadline); }

void Exchange::setCommitted(const std::string& outcome, Deadline deadline) {
  store_->set(key("committed"), outcome, deadline);
}

std::optional<std::string> Exchange::committed(Deadline deadline) {
  try {
    return store_->get(key("committed"), deadline);
  } catch (const TimeoutError&) {
    return std::nullopt;
  }
}

void Exchange::eraseReports(Deadline deadline) {
  for (const auto& name : reportKeys_) store_->erase(name, deadline);
  reportKeys_.clear();
}

}  // namespace bulkhead::checkpoint::commit
