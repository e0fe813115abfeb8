#pragma once
// How the distributed optimizer groups gradients for reduction, and how it
// learns that the backward has finished one.
//
// Buckets (planBuckets): parameters of one group (dense, expert) and dtype,
// taken in the REVERSE of the order the caller lists them (the order a
// backward produces gradients for a model listed in forward order, as
// PyTorch's DDP assumes), are cut into buckets of about `bucketBytes` of
// their reduction dtype; a larger parameter fills one alone. Buckets come in
// the order their last parameter is reached, so the first bucket is the first
// a backward completes. Parameters named in `atStep` (gradients the caller
// changes after the backward) form buckets of their own, placed last. Pure
// arithmetic: every rank computes the same plan from the same list.
//
// GradientHooks: calls `onReady(i)` each time autograd has accumulated a
// gradient into parameter i (a post hook on its AccumulateGrad node, kept
// alive by the hooks, so one backward after another reaches the same node).
// The call runs on the thread that runs that part of the backward (on a GPU,
// the device's autograd thread), with the gradient's stream current. Layers
// that write a leaf's gradient in place (moe/batched_linear.h) hand autograd
// no gradient, but the engine still runs the leaf's AccumulateGrad after the
// write, so these hooks see that gradient complete as well. A parameter that
// is not a leaf gets no hook. The destructor removes the hooks.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "parallel/parameter.h"

namespace torch::autograd {
struct Node;
}

namespace bulkhead::optim {

struct BucketPlan {
  parallel::ParamGroup group = parallel::ParamGroup::Dense;
  at::ScalarType dtype = at::kFloat;  // the parameters' dtype
  bool atStep = false;                // reduced when step() is called, never during the backward
  std::vector<size_t> members;        // indices into the caller's list, in bucket order
};

// `bytesPerElement(dtype)`: the size of a parameter dtype's reduction type.
std::vector<BucketPlan> planBuckets(const std::vector<parallel::Parameter>& params, int64_t bucketBytes,
                                    const std::set<std::string>& atStep,
                                    const std::function<int64_t(at::ScalarType)>& bytesPerElement);

class GradientHooks {
 public:
  GradientHooks(const std::vector<parallel::Parameter>& params, std::function<void(size_t)> onReady);
  ~GradientHooks();
  GradientHooks(const GradientHooks&) = delete;
  GradientHooks& operator=(const GradientHooks&) = delete;

 private:
  struct Installed {
    std::shared_ptr<torch::autograd::Node> accumulator;
    uintptr_t key = 0;
  };
  std::unique_ptr<std::function<void(size_t)>> onReady_;  // where the hooks find it
  std::vector<Installed> installed_;
};

}  // namespace bulkhead::optim
