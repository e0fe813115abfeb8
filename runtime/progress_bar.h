#pragma once
// The one progress bar: "\r<label> [#####.....] <text>" redrawn in place on a
// terminal, at most once per interval (and always at the end); nothing at all
// when the stream is not a terminal or the bar is off, so logs stay clean.

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace bulkhead {

struct ProgressBarOptions {
  std::FILE* stream = stderr;
  std::string label;  // before the bar ("" for none)
  int width = 30;     // characters inside the brackets
  std::chrono::milliseconds interval{100};
  bool enabled = true;  // false: draws nothing (for example off rank 0, or under CI)
};

class ProgressBar {
 public:
  explicit ProgressBar(ProgressBarOptions options = {});

  // Whether the bar draws: enabled and the stream is a terminal.
  bool active() const { return active_; }
  // Redraws the bar at done / total with `text` after it; at done >= total it
  // is drawn whatever the interval, and ends its line when `finish` is set.
  void draw(int64_t done, int64_t total, const std::string& text, bool finish = false);
  // Erases the bar's line so that a normal line can be printed in its place.
  void clear();

 private:
  ProgressBarOptions options_;
  bool active_;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace bulkhead
