#include "runtime/log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>

#include "runtime/env.h"
#include "runtime/errors.h"

namespace bulkhead::log {
namespace {

std::atomic<int> currentRank{-1};
std::atomic<int> currentSize{-1};
const auto startTime = std::chrono::steady_clock::now();

Level configuredLevel() {
  static const Level level = parseLevel(env::kLogLevel.text());
  return level;
}

const char* name(Level level) {
  switch (level) {
    case Level::Error:
      return "ERROR";
    case Level::Warn:
      return "WARN";
    case Level::Info:
      return "INFO";
    case Level::Debug:
      return "DEBUG";
    case Level::Trace:
      return "TRACE";
  }
  return "?";
}

}  // namespace

Level parseLevel(std::string_view text) {
  if (text == "error") return Level::Error;
  if (text == "warn" || text == "warning") return Level::Warn;
  if (text == "info") return Level::Info;
  if (text == "debug") return Level::Debug;
  if (text == "trace") return Level::Trace;
  throw ConfigError(
      fmt::format("{}='{}' is not a log level; use error, warn, info, debug or trace", env::kLogLevel.name(), text));
}

void setRank(int rank, int size) {
  currentRank = rank;
  currentSize = size;
}

bool enabled(Level level) { return static_cast<int>(level) <= static_cast<int>(configuredLevel()); }

void write(Level level, std::string_view subsystem, std::string_view message) {
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - startTime).count();
  int rank = currentRank, size = currentSize;
  std::string who = rank >= 0 ? fmt::format("{}/{}", rank, size) : std::string("?");
  // One fwrite per line keeps lines of concurrent threads whole.
  std::string line = fmt::format("[bulkhead {} +{:.3f}s {} {}] {}\n", who, elapsed, name(level), subsystem, message);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace bulkhead::log
