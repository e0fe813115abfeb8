#include "optim/grad_buckets.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <tuple>

namespace bulkhead::optim {
namespace {

struct ReadyHook : torch::autograd::FunctionPostHook {
  ReadyHook(std::function<void(size_t)>* onReady, size_t index) : onReady(onReady), index(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    (*onReady)(index);
    return outputs;
  }
  std::function<void(size_t)>* onReady;
  size_t index;
};

}  // namespace

std::vector<BucketPlan> planBuckets(const std::vector<parallel::Parameter>& params, int64_t bucketBytes,
                                    const std::set<std::string>& atStep,
                                    const std::function<int64_t(at::ScalarType)>& bytesPerElement) {
  struct Open {
    BucketPlan plan;
    int64_t bytes = 0;
  };
  using Key = std::tuple<int, int, bool>;
  std::map<Key, Open> open;
  std::vector<BucketPlan> closed, last;
  auto close = [&](Open& bucket) {
    if (bucket.plan.members.empty()) return;
    (bucket.plan.atStep ? last : closed).push_back(std::move(bucket.plan));
    bucket = Open{};
  };
  for (size_t k = params.size(); k-- > 0;) {
    const parallel::Parameter& p = params[k];
    const bool held = atStep.count(p.name) > 0;
    Open& bucket = open[Key{static_cast<int>(p.group), static_cast<int>(p.tensor.scalar_type()), held}];
    if (bucket.plan.members.empty()) bucket.plan = {p.group, p.tensor.scalar_type(), held, {}};
    bucket.plan.members.push_back(k);
    bucket.bytes += p.tensor.numel() * bytesPerElement(p.tensor.scalar_type());
    if (bucket.bytes >= bucketBytes) close(bucket);
  }
  // The buckets still open, in the order their last parameter was reached.
  std::vector<Open*> rest;
  for (auto& [key, bucket] : open)
    if (!bucket.plan.members.empty()) rest.push_back(&bucket);
  std::sort(rest.begin(), rest.end(),
            [](const Open* a, const Open* b) { return a->plan.members.back() > b->plan.members.back(); });
  for (Open* bucket : rest) close(*bucket);
  for (BucketPlan& plan : last) closed.push_back(std::move(plan));
  return closed;
}

GradientHooks::GradientHooks(const std::vector<parallel::Parameter>& params, std::function<void(size_t)> onReady)
    : onReady_(std::make_unique<std::function<void(size_t)>>(std::move(onReady))) {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& tensor = params[i].tensor;
    if (!tensor.requires_grad() || !tensor.is_leaf()) continue;
    std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(tensor);
    if (!accumulator) continue;
    const uintptr_t key = accumulator->add_post_hook(std::make_unique<ReadyHook>(onReady_.get(), i));
    installed_.push_back({std::move(accumulator), key});
  }
}

GradientHooks::~GradientHooks() {
  for (Installed& hook : installed_) hook.accumulator->del_post_hook(hook.key);
}

}  // namespace bulkhead::optim
