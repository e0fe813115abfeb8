#pragma once
// fn(0) ... fn(n-1) on up to `threads` threads, the caller's among them; the
// first exception any call throws is rethrown here once all threads stopped
// (calls not yet started are skipped). For checksums, copies and reads of
// independent chunks (checkpoint files, the experts' initial draws). parallelForWorkers passes each call its thread's index
// as well (0 .. threads-1), for per-thread buffers.

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace bulkhead {

template <typename Fn>
void parallelForWorkers(int64_t n, int threads, Fn&& fn) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  std::atomic<bool> stop{false};
  std::exception_ptr failure;
  std::mutex failureMutex;
  auto work = [&](int worker) {
    for (int64_t i; !stop.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < n;) {
      try {
        fn(worker, i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(failureMutex);
        if (!failure) failure = std::current_exception();
        stop = true;
      }
    }
  };
  int helpers = static_cast<int>(std::min<int64_t>(n, threads)) - 1;
  std::vector<std::thread> pool;
  pool.reserve(helpers > 0 ? helpers : 0);
  for (int t = 0; t < helpers; ++t) {
    try {
      pool.emplace_back(work, t + 1);
    } catch (const std::system_error&) {
      break;  // fewer threads, same result
    }
  }
  work(0);
  for (auto& thread : pool) thread.join();
  if (failure) std::rethrow_exception(failure);
}

template <typename Fn>
void parallelFor(int64_t n, int threads, Fn&& fn) {
  parallelForWorkers(n, threads, [&](int, int64_t i) { fn(i); });
}

}  // namespace bulkhead
