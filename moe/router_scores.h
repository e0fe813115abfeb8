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
// that autograd kept for the gate's gradient. Its backward computes in float32
// as that form's does: grad @ gate and grad^T @ tokens, each rounded once to its
// input's dtype. tokens [T, H], gate [E, H]; nullopt where it does not apply
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

}  // namespace bulkhead::moe
