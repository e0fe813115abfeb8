#pragma once
// Rank-prefixed logging. Every line carries the rank, the level and a
// subsystem tag, so one grep across all ranks' logs tells a story:
//   [bulkhead 3/8 +12.345s WARN comm] ...
// The level comes from BULKHEAD_LOG_LEVEL.

#include <fmt/format.h>

#include <string_view>

namespace bulkhead::log {

enum class Level { Error = 0, Warn = 1, Info = 2, Debug = 3, Trace = 4 };

// Called once the world is known; before that lines show "?".
void setRank(int rank, int size);
bool enabled(Level level);
void write(Level level, std::string_view subsystem, std::string_view message);
// Parses "error", "warn", ...; a ConfigError names the knob otherwise.
Level parseLevel(std::string_view text);

template <typename... Args>
void error(std::string_view subsystem, fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(Level::Error)) write(Level::Error, subsystem, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void warn(std::string_view subsystem, fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(Level::Warn)) write(Level::Warn, subsystem, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void info(std::string_view subsystem, fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(Level::Info)) write(Level::Info, subsystem, fmt::format(format, std::forward<Args>(args)...));
}
template <typename... Args>
void debug(std::string_view subsystem, fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(Level::Debug)) write(Level::Debug, subsystem, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace bulkhead::log
