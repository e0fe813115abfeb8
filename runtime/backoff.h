#pragma once
// Polling pace for wait loops: a few quick yields for operations that finish
// in microseconds, then sleeps that grow to a cap, so a rank waiting on a slow
// peer leaves its core to others (ranks are often oversubscribed on CPUs).
// Never sleeps past the deadline it is given.

#include <algorithm>
#include <chrono>
#include <thread>

#include "runtime/deadline.h"

namespace bulkhead {

class Backoff {
 public:
  explicit Backoff(std::chrono::microseconds cap = std::chrono::microseconds(200)) : cap_(cap) {}

  void pause(Deadline deadline) {
    if (++polls_ <= kYields) {
      std::this_thread::yield();
      return;
    }
    auto nap = std::min<Deadline::Clock::duration>(sleep_, deadline.remaining());
    std::this_thread::sleep_for(nap);
    sleep_ = std::min(cap_, sleep_ * 2);
  }

 private:
  static constexpr int kYields = 64;
  std::chrono::microseconds cap_;
  std::chrono::microseconds sleep_{10};
  int polls_ = 0;
};

}  // namespace bulkhead
