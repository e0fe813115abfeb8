#pragma once
// AdamW with decoupled weight decay (Loshchilov & Hutter; torch.optim.AdamW's
// update), on Bulkhead parameters, and the one update function both this
// optimizer and the distributed optimizer (optim/distributed_optimizer.h) run,
// so their updates agree bit for bit on equal inputs.
//
// Master weights and moments: float32 for bf16/fp16 parameters (the parameter
// is the master rounded after each step); for float32/float64 parameters the
// parameter itself is the master and the moments share its dtype. With
// AdamWOptions::momentType bfloat16, the moments of float32 masters are kept
// in bfloat16: the update computes in float32 and rounds them once a step.
//
// State exported for checkpoints (state()), under global keys, so a state
// saved in one layout loads into another (either optimizer):
//   optim.<param name>.master      float32 master (bf16/fp16 parameters only)
//   optim.<param name>.exp_avg     first moment
//   optim.<param name>.exp_avg_sq  second moment
//   optim.step                     int64 [1], updates taken (on the CPU)
// each with the parameter's global shape and offsets.

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "parallel/parameter.h"

namespace bulkhead::optim {

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weightDecay = 0.01;
  // The dtype of the moments of float32 masters (bf16, fp16 and float32
  // parameters): float32, or bfloat16 (8 bytes less state a parameter, and
  // 8 bytes less read and written each step; DeepSeek-V3 trains so, and
  // Megatron-LM's --exp-avg-dtype/--exp-avg-sq-dtype bf16). Float64 masters
  // keep float64 moments.
  at::ScalarType momentType = at::kFloat;
  // Which parameters decay (weightDecay); empty: those of two or more global
  // dimensions (matrices, embeddings, expert weights), not norm gains and
  // biases, as Megatron-LM and most LLM recipes have it.
  std::function<bool(const parallel::Parameter&)> decays;
};

// float32 for bf16 and fp16, else the dtype itself.
at::ScalarType masterType(at::ScalarType paramType);

// The dtype of the moments of a `master`-typed master under `options`
// (ConfigError for a momentType other than float32 and bfloat16).
at::ScalarType momentTypeFor(at::ScalarType master, const AdamWOptions& options);

// The weight decay `options` gives `param`.
double weightDecayFor(const parallel::Parameter& param, const AdamWOptions& options);

// One AdamW update, in place and element-wise (any shapes that match):
//   master   *= 1 - lr * weightDecay
//   expAvg    = beta1 * expAvg + (1 - beta1) * grad
//   expAvgSq  = beta2 * expAvgSq + (1 - beta2) * grad^2
//   master   -= lr / (1 - beta1^step) * expAvg / (sqrt(expAvgSq / (1 - beta2^step)) + eps)
// `step` >= 1 counts this update; `grad` is converted to master's dtype, and
// so are moments of another dtype (bfloat16), rounded back after the update.
void adamwUpdate(at::Tensor master, const at::Tensor& grad, at::Tensor expAvg, at::Tensor expAvgSq, int64_t step,
                 double lr, double weightDecay, const AdamWOptions& options);

// The plain optimizer: each rank updates the whole of every parameter it
// holds, with the gradient it has (call parallel::syncGradients first when
// training data-parallel; optim::clipGradNorm clips). A parameter without a
// gradient is updated with a zero gradient (its moments and weight decay still
// advance), as the distributed optimizer does.
class AdamW {
 public:
  // `worldRank`: only world rank 0 exports optim.step as replica 0.
  // Parameters: contiguous, on one device, each with its ShardInfo, names
  // unique (ConfigError otherwise).
  AdamW(std::vector<parallel::Parameter> params, AdamWOptions options = {}, int worldRank = 0);
  // The state lives in tensors; a copy would share it.
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;
  AdamW(AdamW&&) = default;
  AdamW& operator=(AdamW&&) = default;

  void step(double lr);
  // Releases every gradient (as PyTorch's zero_grad(set_to_none=True)): the
  // next backward then writes each one fresh, with no zero fill before it and
  // no add into it.
  void zeroGrad();
  int64_t stepCount() const { return step_; }
  const std::vector<parallel::Parameter>& parameters() const { return params_; }
  // The master weights of parameter i (the parameter itself for fp32/fp64).
  const at::Tensor& master(size_t i) const { return masters_[i]; }
  const at::Tensor& expAvg(size_t i) const { return expAvg_[i]; }
  const at::Tensor& expAvgSq(size_t i) const { return expAvgSq_[i]; }

  // Views of the live state (see above), replicaId that of each parameter.
  // Save: read them (copy them first if the save outlives the next step).
  // Load: use them as targets, filled in place, then call afterLoad().
  std::vector<parallel::ShardedTensor> state();
  // Takes in the loaded step count.
  void afterLoad();

 private:
  std::vector<parallel::Parameter> params_;
  AdamWOptions options_;
  int worldRank_;
  std::vector<double> decay_;
  std::vector<at::Tensor> masters_, expAvg_, expAvgSq_;
  int64_t step_ = 0;
  at::Tensor stepTensor_;
};

}  // namespace bulkhead::optim
