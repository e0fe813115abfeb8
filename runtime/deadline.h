#pragma once
// A Deadline is a point in time by which a blocking call must return.
// One deadline is passed down a call stack: nested calls share it and never
// restart the clock. Every blocking call in Bulkhead takes one.

#include <algorithm>
#include <chrono>

namespace bulkhead {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  static Deadline after(std::chrono::milliseconds timeout) { return Deadline(Clock::now() + timeout); }
  static Deadline afterSeconds(double seconds) {
    return after(std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0)));
  }
  static Deadline never() { return Deadline(Clock::time_point::max()); }
  static Deadline at(Clock::time_point when) { return Deadline(when); }

  bool isNever() const { return when_ == Clock::time_point::max(); }
  bool expired() const { return !isNever() && Clock::now() >= when_; }
  // Time left, zero once expired; a never-deadline reports a very long time.
  Clock::duration remaining() const {
    if (isNever()) return Clock::duration::max();
    return std::max(Clock::duration::zero(), when_ - Clock::now());
  }
  double remainingSeconds() const { return std::chrono::duration<double>(remaining()).count(); }
  Clock::time_point when() const { return when_; }
  // The earlier of the two: a nested call may shorten a deadline, never extend it.
  Deadline earliest(Deadline other) const { return when_ <= other.when_ ? *this : other; }

  friend bool operator==(Deadline a, Deadline b) { return a.when_ == b.when_; }

 private:
  explicit Deadline(Clock::time_point when) : when_(when) {}
  Clock::time_point when_;
};

// Seconds elapsed since `start` on the deadline clock (for messages and timings).
inline double secondsSince(Deadline::Clock::time_point start) {
  return std::chrono::duration<double>(Deadline::Clock::now() - start).count();
}

}  // namespace bulkhead
