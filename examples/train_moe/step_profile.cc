#include "examples/train_moe/step_profile.h"

#include <ATen/record_function.h>
#include <fmt/format.h>

#include "runtime/errors.h"

#if BULKHEAD_TRAIN_PROFILE
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <set>
#endif

namespace bulkhead::examples {

double peakDeviceMemoryGiB(int deviceIndex) {
#if BULKHEAD_TRAIN_PROFILE
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(deviceIndex));
  return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0 * 1024.0);  // [0]: both pools
#else
  (void)deviceIndex;
  return -1;
#endif
}

#if BULKHEAD_TRAIN_PROFILE
namespace {
const torch::profiler::impl::ProfilerConfig& config() {
  static const torch::profiler::impl::ProfilerConfig value(torch::profiler::impl::ProfilerState::KINETO);
  return value;
}
const std::set<torch::profiler::impl::ActivityType> kActivities{torch::profiler::impl::ActivityType::CPU,
                                                                torch::profiler::impl::ActivityType::CUDA};
}  // namespace

void StepProfile::start() {
  torch::autograd::profiler::prepareProfiler(config(), kActivities);
  torch::autograd::profiler::enableProfiler(config(), kActivities);
  running_ = true;
}

void StepProfile::stop(int rank) {
  if (!running_) return;
  running_ = false;
  auto trace = torch::autograd::profiler::disableProfiler();
  trace->save(rank == 0 ? path_ : fmt::format("{}.rank{}", path_, rank));
}

StepRange::StepRange(bool on) {
  if (!on) return;
  guard_ = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
  if (guard_->isActive()) guard_->before("step");
}

StepRange::~StepRange() = default;
#else
void StepProfile::start() {
  throw ConfigError("--profile needs libtorch with CUDA and its Kineto profiler, which this build does not have",
                    {.expected = "a build against a CUDA libtorch (see docs/performance.md)"});
}
void StepProfile::stop(int) {}
StepRange::StepRange(bool) {}
StepRange::~StepRange() = default;
#endif

}  // namespace bulkhead::examples
