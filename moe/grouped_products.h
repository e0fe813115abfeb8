#pragma once
// The experts' grouped products through Bulkhead's Hopper kernels
// (moe/cuda/grouped_gemm_kernels.h), with a backward of two grouped products:
// the rows' gradient over the weights (dgrad), the weights' over each group's
// rows (wgrad). What at::_grouped_mm(rows, weights.transpose(-2, -1), ends)
// computes, where hopperProductsApply.
//
// Contract: rows [N, K] bf16 on a Hopper GPU, weights [G, Out, K] bf16 on the
// same device, ends int32 [G] there (group g's rows end at ends[g]; the rows
// past ends[G - 1] get zeros and no gradient). K and Out multiples of 8 and
// at least 64, 1 to 1,024 groups, N below 2^31. BULKHEAD_GROUPED_PRODUCTS=aten
// turns the kernels off (at::_grouped_mm then serves these calls).

#include <ATen/core/Tensor.h>

namespace bulkhead::moe {

// Whether hopperGroupedLinear serves these tensors (false in builds without
// the sm_90a kernels, on the CPU, on other GPUs and other dtypes).
bool hopperProductsApply(const at::Tensor& rows, const at::Tensor& weights, const at::Tensor& ends);

// [N, Out]: each group's rows times its weight transposed; differentiable in
// rows and weights in reverse mode (a second backward raises; forward-mode
// tangents are not carried).
at::Tensor hopperGroupedLinear(const at::Tensor& rows, const at::Tensor& weights, const at::Tensor& ends);

// The three products of hopperGroupedLinear alone, without autograd (for
// benchmarks): with rows x, weights w and the output's gradient dy,
//   Forward(x, w) = y [N, Out], Dgrad(dy, w) = dx [N, K], Wgrad(dy, x) = dw [G, Out, K].
// Each operand contiguous; raises ConfigError where hopperProductsApply(x, w, ends) is false.
enum class HopperProduct { Forward, Dgrad, Wgrad };
at::Tensor hopperProduct(HopperProduct kind, const at::Tensor& a, const at::Tensor& b, const at::Tensor& ends);

}  // namespace bulkhead::moe
