#pragma once
// train_moe --profile FILE: a Chrome trace (ATen ops and GPU kernels) of a few
// steps, each a "step" range, for bench/profile_summary.py. Needs libtorch
// with CUDA and its Kineto profiler; elsewhere start() raises ConfigError.

#include <memory>
#include <string>

namespace at {
struct RecordFunction;
}

namespace bulkhead::examples {

// The most memory the caching allocator has handed out on `deviceIndex` since the start, in GiB; -1 where
// libtorch has no CUDA.
double peakDeviceMemoryGiB(int deviceIndex);

class StepProfile {
 public:
  explicit StepProfile(std::string path) : path_(std::move(path)) {}
  bool enabled() const { return !path_.empty(); }
  void start();
  // Writes the trace to the path given (and ".rank<r>" on ranks above 0).
  void stop(int rank);

 private:
  std::string path_;
  bool running_ = false;
};

// A "step" range in the trace while it lives (nothing when not profiling).
class StepRange {
 public:
  explicit StepRange(bool on);
  ~StepRange();
  StepRange(const StepRange&) = delete;
  StepRange& operator=(const StepRange&) = delete;

 private:
  std::unique_ptr<at::RecordFunction> guard_;
};

}  // namespace bulkhead::examples
