#pragma once
// A step captured into a CUDA graph (libtorch's at::cuda::CUDAGraph) and
// replayed as one bounded operation.
//
//   CapturedGraph graph(device, [&] { forwardBackward(staticInput); }, {.name = "moe-step"});
//   for (...) { staticInput.copy_(next); graph.replay(Deadline::afterSeconds(5)); }
//
// Contract:
// - The constructor runs `step` warmupRuns times eagerly on a side stream
//   (so allocations and library workspaces exist before capture), then
//   captures one run. Tensors the step reads and writes must be the same ones
//   at every replay: copy new inputs into them. Gradients accumulate as in
//   eager mode unless the step clears them.
// - Capture is a checked region (runtime/diagnosis/checked_region.h) over
//   GraphOptions::comms when a store is given: ranks that captured different
//   collectives fail at capture, every one of them, with DesyncError naming
//   the first difference, instead of hanging at replay.
// - replay(deadline) launches the graph on the current stream and waits until
//   it completed or the deadline passed: TimeoutError then (the GPU may still
//   run it: a graph cannot be cancelled). launch() does not wait.
// - A step that fails during capture ends the capture and rethrows; a layer
//   that cannot be captured says so itself (a dropless MoE layer: ConfigError).
// - Needs libtorch with CUDA; elsewhere the constructor is a ConfigError.

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/deadline.h"
#include "runtime/store/store.h"

namespace bulkhead {

struct GraphOptions {
  std::string name = "step";  // in messages and the checked region's keys
  int warmupRuns = 3;
  // With a store: capture is a checked region over these communicators.
  std::shared_ptr<Store> store;
  std::vector<CommunicatorPtr> comms;
  std::optional<Deadline> checkDeadline;  // the region's end; unset: BULKHEAD_COLLECTIVE_TIMEOUT
};

class CapturedGraph {
 public:
  CapturedGraph(c10::Device device, const std::function<void()>& step, GraphOptions options = {});
  ~CapturedGraph();
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  void replay(Deadline deadline);
  void launch();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace bulkhead
