#pragma once
// Tensor-parallel linear layers (Megatron-LM's column and row parallel
// linears). The global weight is [out, in] (y = x W^T + b), named
// "<name>.weight" and "<name>.bias" whatever the layout, so checkpoints and
// the optimizer state reshard between tp sizes.
//
// - ColumnParallelLinear: tp rank r holds output rows [r*out/tp, (r+1)*out/tp)
//   of W and b. Input: the full activation (replicated over tp). Output: this
//   rank's block of the output features, or all of them with gatherOutput.
// - RowParallelLinear: tp rank r holds input columns [r*in/tp, (r+1)*in/tp) of
//   W; b is whole on every tp rank (tpReplicated). Input: this rank's block of
//   the input features (inputIsParallel, e.g. a column-parallel output) or the
//   full activation. Output: the full result, summed over tp.
// tp must divide the split dimension (ConfigError otherwise). Parameters live
// on the tp group's device; initial weights are a seeded slice of the global
// weight (parallel/shard_init.h), biases start at zero.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "parallel/parameter.h"
#include "parallel/tensor_parallel.h"

namespace bulkhead::parallel {

struct ColumnParallelOptions {
  bool bias = true;
  bool gatherOutput = false;  // all-gather the output features (else each rank keeps its block)
  double initStd = 0.02;
  uint64_t seed = 0;
  at::ScalarType dtype = at::kFloat;
};

struct RowParallelOptions {
  bool bias = true;
  bool inputIsParallel = true;  // the input holds this rank's block of features; false: split it here
  double initStd = 0.02;
  uint64_t seed = 0;
  at::ScalarType dtype = at::kFloat;
};

class ColumnParallelLinear {
 public:
  ColumnParallelLinear(std::string name, int64_t inFeatures, int64_t outFeatures, TpGroup group,
                       ColumnParallelOptions options = {});
  // [..., in] -> [..., out/tp] ([..., out] with gatherOutput).
  at::Tensor forward(const at::Tensor& input) const;
  // weight, then bias (if any).
  std::vector<Parameter> parameters() const;
  const at::Tensor& weight() const { return weight_; }
  const at::Tensor& bias() const { return bias_; }  // undefined without bias
  // This rank's block of the output features.
  int64_t outBegin() const { return outBegin_; }

 private:
  std::string name_;
  TpGroup group_;
  ColumnParallelOptions options_;
  int64_t in_, out_, outBegin_;
  at::Tensor weight_, bias_;
};

class RowParallelLinear {
 public:
  RowParallelLinear(std::string name, int64_t inFeatures, int64_t outFeatures, TpGroup group,
                    RowParallelOptions options = {});
  // [..., in/tp] (inputIsParallel) or [..., in] -> [..., out].
  at::Tensor forward(const at::Tensor& input) const;
  std::vector<Parameter> parameters() const;
  const at::Tensor& weight() const { return weight_; }
  const at::Tensor& bias() const { return bias_; }
  int64_t inBegin() const { return inBegin_; }

 private:
  std::string name_;
  TpGroup group_;
  RowParallelOptions options_;
  int64_t in_, out_, inBegin_;
  at::Tensor weight_, bias_;
};

}  // namespace bulkhead::parallel
