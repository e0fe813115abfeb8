#include "runtime/cuda/cuda_graph.h"

#include <fmt/format.h>

#include <chrono>
#include <thread>

#include "runtime/backoff.h"
#include "runtime/diagnosis/checked_region.h"
#include "runtime/errors.h"

#if BULKHEAD_TORCH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace bulkhead {

#if BULKHEAD_TORCH_CUDA

struct CapturedGraph::Impl {
  Impl(GraphOptions options, c10::Device device) : options(std::move(options)), device(device) {}
  GraphOptions options;
  c10::Device device;
  at::cuda::CUDAGraph graph;
};

namespace {

// `to` waits for the work queued on `from` so far, without the host waiting.
void follow(const c10::cuda::CUDAStream& from, const c10::cuda::CUDAStream& to) {
  at::cuda::CUDAEvent event;
  event.record(from);
  event.block(to);
}

}  // namespace

CapturedGraph::CapturedGraph(c10::Device device, const std::function<void()>& step, GraphOptions options)
    : impl_(std::make_unique<Impl>(std::move(options), device)) {
  if (!device.is_cuda())
    throw ConfigError(fmt::format("CUDA graph '{}': device {} is not a GPU", impl_->options.name, device.str()),
                      {.expected = "a cuda device"});
  const c10::cuda::CUDAGuard onDevice(device);
  const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream(device.index());
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device.index());
  follow(caller, side);
  {
    const c10::cuda::CUDAStreamGuard onSide(side);
    for (int i = 0; i < impl_->options.warmupRuns; ++i) step();
    std::optional<CheckedRegion> region;
    if (impl_->options.store && !impl_->options.comms.empty())
      region.emplace(
          impl_->options.store, impl_->options.comms,
          CheckedRegionOptions{.name = "graph-" + impl_->options.name, .deadline = impl_->options.checkDeadline});
    // Thread-local: the watchdog and heartbeat threads' CUDA calls do not invalidate the capture.
    impl_->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
    try {
      step();
    } catch (...) {
      try {
        impl_->graph.capture_end();  // leaves the stream out of capture; the graph is not used
      } catch (...) {
      }
      throw;
    }
    impl_->graph.capture_end();
    if (region) region->end();
  }
  follow(side, caller);
}

CapturedGraph::~CapturedGraph() = default;

void CapturedGraph::launch() {
  const c10::cuda::CUDAGuard onDevice(impl_->device);
  impl_->graph.replay();
}

void CapturedGraph::replay(Deadline deadline) {
  const c10::cuda::CUDAGuard onDevice(impl_->device);
  const auto started = Deadline::Clock::now();
  impl_->graph.replay();
  at::cuda::CUDAEvent done;
  done.record(c10::cuda::getCurrentCUDAStream(impl_->device.index()));
  Backoff backoff(std::chrono::microseconds(500));
  while (!done.query()) {
    if (deadline.expired())
      throw TimeoutError(fmt::format("CUDA graph '{}': a replay did not complete within {:.3f} s; the GPU may still "
                                     "be running it (a graph cannot be cancelled). Look for a stalled kernel or a "
                                     "peer that never joined a captured collective, or extend the deadline",
                                     impl_->options.name, secondsSince(started)),
                         {.expected = "the replay to complete by its deadline"});
    backoff.pause(deadline);
  }
}

#else

struct CapturedGraph::Impl {};

CapturedGraph::CapturedGraph(c10::Device device, const std::function<void()>&, GraphOptions options) {
  throw ConfigError(fmt::format("CUDA graph '{}' on {}: this build's libtorch has no CUDA", options.name, device.str()),
                    {.expected = "a build against a CUDA libtorch"});
}

CapturedGraph::~CapturedGraph() = default;
void CapturedGraph::launch() {}
void CapturedGraph::replay(Deadline) {}

#endif

}  // namespace bulkhead
