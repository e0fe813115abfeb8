#pragma once
// The time a span of work takes on a device's current stream, read once the
// work has run, without waiting for it: start() and stop() record events in
// the stream's order, and elapsed() gives the span once both have fired. On a
// CPU, or in a build whose libtorch has no CUDA, it measures nothing.

#include <c10/core/Device.h>

#include <memory>
#include <optional>

namespace bulkhead {

class StreamTimer {
 public:
  explicit StreamTimer(c10::Device device);
  ~StreamTimer();
  StreamTimer(StreamTimer&&) noexcept;
  StreamTimer& operator=(StreamTimer&&) noexcept;

  void start();
  void stop();
  // Seconds from start() to stop() on the stream, once both have run; nullopt before, or where nothing is measured.
  std::optional<double> elapsed() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bulkhead
