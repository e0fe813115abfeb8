#pragma once
// The dense pieces of a Qwen3-MoE or Mixtral decoder layer over a tp group, computed in the order and
// precision Hugging Face transformers computes them, so that a float64 model gives transformers' float64
// logits (docs/models.md#numerics):
// - RMSNorm in float32 whatever the model's dtype, then cast back and scaled by the weight;
// - RoPE tables (non-interleaved, rotate-half) from float32 inverse frequencies and float32 cos/sin;
// - attention scores in the model's dtype, their causal softmax in float32;
// (or, with float32Internals false, those three in float64 for a float64 model: internalType());
// - SwiGLU dense MLPs, down(silu(gate(x)) * up(x)).
//
// Layout: q heads are split over tp; kv heads too when tp divides them. Where tp exceeds the kv heads,
// every tp rank holds the whole k and v projections (tp-replicated) and uses the kv head its q heads
// share; their gradients are summed over tp, so the replicas stay equal.

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "models/config.h"
#include "parallel/linear.h"
#include "parallel/parameter.h"
#include "parallel/tensor_parallel.h"

namespace bulkhead::models {

// Where the RMSNorms, RoPE tables and softmaxes are computed: in float32 whatever the model's dtype, as
// transformers computes them (the default), or, with float32Internals false, in the model's dtype where it is
// wider (a float64 model computes in float64 throughout).
at::ScalarType internalType(at::ScalarType model, bool float32Internals);

// Hugging Face's RMSNorm: x / rms(x) in `compute`, cast to x's dtype, times weight.
at::Tensor rmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps, at::ScalarType compute = at::kFloat);

// A norm weight every tp rank holds (ones at first).
struct NormWeight {
  std::string name;
  at::Tensor weight;
  parallel::Parameter parameter(const parallel::TpGroup& tp) const;
};
NormWeight normWeight(std::string name, int64_t size, const at::TensorOptions& options);

// cos and sin [sequence, head_dim] in `dtype`, cached for the last sequence length, dtype and device.
class Rope {
 public:
  Rope(int64_t headDim, double theta, bool float32Internals = true)
      : headDim_(headDim), theta_(theta), float32_(float32Internals) {}
  void apply(at::Tensor& q, at::Tensor& k) const;  // [batch, heads, sequence, head_dim], in place of q and k
 private:
  void refresh(int64_t sequence, const at::TensorOptions& options) const;
  int64_t headDim_;
  double theta_;
  bool float32_;
  mutable at::Tensor cos_, sin_;
};

struct LayerInit {
  double initStd = 0.02;
  uint64_t seed = 1;
  at::ScalarType dtype = at::kFloat;
  bool float32Internals = true;  // internalType()
};

// k or v: a column-parallel projection of the kv heads, or the whole projection on every tp rank.
class KvProjection {
 public:
  KvProjection(const std::string& name, const DecoderConfig& config, const parallel::TpGroup& tp,
               const LayerInit& init);
  at::Tensor forward(const at::Tensor& x) const;  // [..., hidden] -> [..., local kv heads x head_dim]
  std::vector<parallel::Parameter> parameters() const;
  int localHeads() const { return localHeads_; }

 private:
  parallel::TpGroup tp_;
  std::optional<parallel::ColumnParallelLinear> split_;
  std::string name_;
  at::Tensor weight_, bias_;  // replicated: the whole projection
  int64_t rowBegin_ = 0, rows_ = 0;
  int localHeads_ = 0;
};

class Attention {
 public:
  Attention(const std::string& prefix, const DecoderConfig& config, const parallel::TpGroup& tp, const LayerInit& init);
  at::Tensor forward(const at::Tensor& x, const Rope& rope) const;  // [batch, sequence, hidden]
  std::vector<parallel::Parameter> parameters() const;

 private:
  parallel::TpGroup tp_;
  int64_t headDim_;
  double eps_;
  bool float32Internals_;
  int localHeads_;
  parallel::ColumnParallelLinear q_;
  KvProjection k_, v_;
  parallel::RowParallelLinear o_;
  std::optional<NormWeight> qNorm_, kNorm_;  // their gradients are summed over tp (each rank norms its own heads)
};

class DenseMlp {
 public:
  DenseMlp(const std::string& prefix, int64_t hidden, int64_t intermediate, const parallel::TpGroup& tp,
           const LayerInit& init);
  at::Tensor forward(const at::Tensor& x) const;
  std::vector<parallel::Parameter> parameters() const;

 private:
  parallel::ColumnParallelLinear gate_, up_;
  parallel::RowParallelLinear down_;
};

}  // namespace bulkhead::models
