#pragma once
// The one progress bar. On a terminal that a person watches it is
// "\r<label> [#####.....] <text>" redrawn in place, at most once per interval
// (and always at the end). Elsewhere (a file, a pipe, mpirun's or Slurm's
// forwarded output, CI) it never redraws: it prints a plain line
// "<label> [#####.....] <text>" at most once per plain interval and at the
// end, or nothing when that interval is zero (for a caller that logs its own
// lines), so a failed job's log shows its errors, not carriage returns.

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
  // Off a terminal: a plain line at most this often (and at the end); zero: none.
  std::chrono::milliseconds plainInterval{10000};
  bool enabled = true;  // false: draws nothing (for example off rank 0)
};

class ProgressBar {
 public:
  explicit ProgressBar(ProgressBarOptions options = {});

  // Whether `stream` is a terminal a person watches: a tty, TERM set and not
  // "dumb", not under CI, and not a rank's output forwarded by an MPI or
  // Slurm launcher (mpirun hands ranks a pseudo-terminal even in a batch job).
  static bool watched(std::FILE* stream);

  // Whether the bar redraws in place (enabled and watched).
  bool active() const { return active_; }
  // Draws the bar at done / total with `text` after it; at done >= total it
  // is drawn whatever the interval, and ends its line when `finish` is set.
  void draw(int64_t done, int64_t total, const std::string& text, bool finish = false);
  // Erases the bar's line so that a normal line can be printed in its place.
  void clear();

 private:
  std::string bar(int64_t done, int64_t total) const;

  ProgressBarOptions options_;
  bool active_;
  bool plain_;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace bulkhead
