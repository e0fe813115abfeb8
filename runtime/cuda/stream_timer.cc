#include "runtime/cuda/stream_timer.h"

#if BULKHEAD_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <cuda_runtime_api.h>
#endif

namespace bulkhead {

#if BULKHEAD_TORCH_CUDA

struct StreamTimer::Impl {
  explicit Impl(c10::Device device) : device(device) {}
  c10::Device device;
  at::cuda::CUDAEvent from{cudaEventDefault}, to{cudaEventDefault};  // with timing
  bool started = false, stopped = false;
};

void StreamTimer::start() {
  if (!impl_) return;
  impl_->from.record(at::cuda::getCurrentCUDAStream(impl_->device.index()));
  impl_->started = true;
  impl_->stopped = false;
}

void StreamTimer::stop() {
  if (!impl_ || !impl_->started) return;
  impl_->to.record(at::cuda::getCurrentCUDAStream(impl_->device.index()));
  impl_->stopped = true;
}

std::optional<double> StreamTimer::elapsed() const {
  if (!impl_ || !impl_->stopped || !impl_->to.query()) return std::nullopt;
  return impl_->from.elapsed_time(impl_->to) / 1e3;
}

StreamTimer::StreamTimer(c10::Device device) {
  if (device.is_cuda()) impl_ = std::make_unique<Impl>(device);
}

#else

struct StreamTimer::Impl {};

void StreamTimer::start() {}
void StreamTimer::stop() {}
std::optional<double> StreamTimer::elapsed() const { return std::nullopt; }
StreamTimer::StreamTimer(c10::Device) {}

#endif

StreamTimer::~StreamTimer() = default;
StreamTimer::StreamTimer(StreamTimer&&) noexcept = default;
StreamTimer& StreamTimer::operator=(StreamTimer&&) noexcept = default;

}  // namespace bulkhead
