#pragma once
// Expert products over groups of equal size (the padded rows of static
// shapes), with each weight gradient accumulated in place.
//
// batchedLinear(rows, weight): rows [G * C, K], C rows per group; weight a
// leaf whose contiguous values read as [G, N, K] (a stack of G matrices of N
// x K, its middle dimensions flattened: w13's [G, 2, F, H] reads as [G, 2F,
// H]). Returns [G * C, N]: each group's rows times its matrix transposed, one
// strided batched GEMM.
//
// Backward (first order only; a double backward raises ConfigError):
// - rows get g x W, one batched GEMM.
// - The weight's gradient goes straight into weight.grad(): the product
//   g^T x rows is added to the gradient it holds (beta = 1, inside the GEMM)
//   or, where it holds none, becomes it. Autograd's own path would write the
//   product to a new tensor and add it to the gradient in a second pass over
//   every expert weight, which is what a step that accumulates gradients
//   (several micro-batches, or a benchmark that never clears them) pays for.
//   Only where the backward would accumulate into the weight anyway
//   (backward(), not grad() for other inputs); grad(..., {weight}) gets the
//   product as usual.
// - A gradient that is not contiguous, or has another dtype, is added to the
//   usual way; the values are the same.
// - Written in place, the weight's gradient does not pass through its
//   AccumulateGrad: hooks registered on the weight do not see it (the
//   AccumulateGrad node still runs, with no gradient, after the write, so
//   post hooks on that node do: optim/grad_buckets.h), and the
//   write takes no lock, so two threads running backwards over graphs that
//   share the weight at once (on the CPU) must not meet here. On a GPU the
//   engine runs every node of a device on one thread.
// Rounding: with a gradient held, the sum is rounded once (the GEMM adds in
// float32) instead of twice; in float64 the two agree to the last bits.

#include <ATen/core/Tensor.h>

namespace bulkhead::moe {

at::Tensor batchedLinear(const at::Tensor& rows, const at::Tensor& weight);

}  // namespace bulkhead::moe
