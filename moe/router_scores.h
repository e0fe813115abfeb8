#pragma once
// The router's scores, selection and loss sums in one CUDA kernel forward
// (plus one that sums its partial rows) and one backward
// (moe/cuda/score_kernels.h), where the ATen form in router.cc launches about
// twenty operations each way.
//
// The ATen form's contract (moe/router.h): the selection is the top-k of
// scores + bias; the weights are the selected unbiased scores, renormalised if
// asked; probSum and lseSquaredSum are what meanProb and the z-loss are made
// of. Here exact ties go to the lower expert id (at::topk leaves their order
// open). A double backward raises (ConfigError).

#include <ATen/core/Tensor.h>

#include <optional>

#include "moe/router.h"

namespace bulkhead::moe {

struct FusedScores {
  at::Tensor indices;          // [T, k] int64, descending by score + bias
  at::Tensor weights;          // [T, k] in the logits' dtype (autograd)
  at::Tensor keep;             // [T, k] all true, for dropless routing (capacityFactor 0); else undefined
  at::Tensor tokensPerExpert;  // [E] int64: slots selected per expert
  at::Tensor probSum;          // [E]: per-token normalised scores summed over tokens (autograd)
  at::Tensor lseSquaredSum;    // []: logsumexp(logits)^2 summed over tokens (autograd)
};

// The gate's logits in float32 straight from bf16 or fp16 tokens and gate, by
// one GEMM that accumulates and writes float32 (at::mm with out_dtype, libtorch
// 2.8 and later, CUDA). The same products as converting both to float32 first,
// without the two copies, the float32 GEMM, and the float32 copy of the tokens
// that autograd kept for the gate's gradient. Its backward sums in float32 as
// that form's does, grad @ gate and grad^T @ tokens, each rounded once to its
// input's dtype: fp16 multiplies float32 copies; bf16 splits the float32 grad
// into two bf16 halves (16 of its 24 significant bits) and multiplies them
// with the bf16 tokens and gate on tensor cores. tokens [T, H], gate [E, H]; nullopt where it does not apply
// (the kernels not built, libtorch without it, CPU tensors or two devices, no
// tokens, shapes that do not multiply, other or mixed dtypes). A double
// backward raises (ConfigError).
std::optional<at::Tensor> mixedPrecisionLogits(const at::Tensor& tokens, const at::Tensor& gate);

// logits [T, E] float32 or float64; bias [E] (float32) or undefined;
// noiseKeys [T] int64 or undefined: where defined, the selection adds the
// noise moe/router_noise.h draws for these keys with options.selectionNoise
// and options.noiseSeed, computed inside the kernel (no [T, E] tensor). nullopt
// where the kernels do not apply (not built, CPU tensors, no tokens, more
// than 1024 experts, top-k above 32, another dtype): the caller takes the
// ATen form then.
std::optional<FusedScores> fusedScores(const at::Tensor& logits, const RouterOptions& options, const at::Tensor& bias,
                                       const at::Tensor& noiseKeys = {});

// moe::capacityPosition's ranks by the kernels of moe/cuda/capacity_kernels.h:
// float32 weights, int64 indices in [0, numExperts) on one GPU, fewer than 2^31
// slots; the same positions as the ATen form, with no sync (an index outside
// that range leaves positions unspecified where the ATen form raises). nullopt
// elsewhere (not built, CPU tensors, other dtypes): the caller takes the ATen
// form then.
std::optional<at::Tensor> capacityPositionKernels(const at::Tensor& indices, const at::Tensor& weights, int numExperts);

}  // namespace bulkhead::moe
