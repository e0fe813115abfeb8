#pragma once
// The combine's reduction: out[p] = sum_c weights[p, c] * source[table[p, c]]
// over the columns whose table entry is >= 0, with autograd to source and
// weights. No atomics and a fixed order of additions (c ascending), so the
// result does not depend on thread timing.
//
// Contract: table is int64 [P, m] (m <= 64) and names every source row at most
// once; weights is [P, m] or undefined (every weight 1). On CUDA tensors (where
// the kernels are built, see moe/CMakeLists.txt) it runs as kernels of its own;
// elsewhere as ATen ops.

#include <ATen/core/Tensor.h>

namespace bulkhead::moe {

at::Tensor gatherSum(const at::Tensor& source, const at::Tensor& table, const at::Tensor& weights);

// The same, always as ATen ops (the reference the kernels are tested against).
at::Tensor gatherSumReference(const at::Tensor& source, const at::Tensor& table, const at::Tensor& weights);

// out[i] = source[index[i]] (source [S, W]), with autograd to source: the
// backward is gatherSum(gradOut, table), deterministic and free of atomics,
// where index_select's backward adds with atomics on CUDA.
//
// Contract: table is int64 [S, m] and lists, in row s, the output rows that
// read source row s (-1 for none): every output row appears exactly once in
// the table, in the row of the source row it reads (index[table[s, c]] == s).
at::Tensor gatherRows(const at::Tensor& source, const at::Tensor& index, const at::Tensor& table);

}  // namespace bulkhead::moe
