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

// How the table names the source rows. Some: each at most once, so the
// backward starts from a zeroed gradient. Every: each exactly once (as the
// combine's tables do), so the backward writes every gradient row itself and
// skips zeroing them; a table that misses a row then leaves that row's
// gradient undefined. Prefix: the source rows are G equal groups (G =
// namedRows' size), and the table names the first namedRows[g] rows of group
// g once each and no other (namedRows int32 [G] on the source's device, known
// only there: a packed buffer's kept rows, G = 1; a padded buffer's kept rows
// per expert, G = E), so the backward writes those and zeroes only the rest.
enum class SourceRows { Some, Every, Prefix };

at::Tensor gatherSum(const at::Tensor& source, const at::Tensor& table, const at::Tensor& weights,
                     SourceRows named = SourceRows::Some, const at::Tensor& namedRows = {});

// The same, always as ATen ops (the reference the kernels are tested against).
at::Tensor gatherSumReference(const at::Tensor& source, const at::Tensor& table, const at::Tensor& weights);

// out [rows, W] with out[table[s, c]] = source[s] (source [S, W]), with
// autograd to source: the backward is gatherSum(gradOut, table),
// deterministic and free of atomics, where index_select's backward adds with
// atomics on CUDA.
//
// Contract: table is int64 [S, m] and lists, in row s, the output rows that
// read source row s (-1 for none): every output row in [0, rows) appears
// exactly once in the table. On CUDA, where the kernels are built, it runs as
// one kernel driven by the table, which reads each source row once; elsewhere
// as an index_select by the index the table inverts to.
at::Tensor gatherRows(const at::Tensor& source, const at::Tensor& table, int64_t rows);

// gatherRows for a table that may miss output rows (fixed-size buffers with
// padding): the rows it misses are zeros and get no gradient; the backward is
// the same gatherSum. On CUDA, where the kernels are built: a zeroed buffer and
// gatherRows' kernel; elsewhere an index_select and a masked fill.
// namedRows (optional, int32 [G] on the device): the rows are G equal groups
// and the table names exactly the first namedRows[g] rows of group g, so only
// the rows after those are zeroed (G = 1: rows [0, namedRows)).
at::Tensor gatherRowsOrZero(const at::Tensor& source, const at::Tensor& table, int64_t rows,
                            const at::Tensor& namedRows = {});

// The stable grouping behind groupByKey (moe/dispatch_routes.h), as kernels of our
// own (moe/cuda/group_kernels.h) for an int64 CUDA `key` whose values in
// [0, groups) name a group (any other value: in no group), `count` of them in
// a group: order [count] lists the entries group by group, in entry order
// within a group; table (key's shape) gives each entry's place in it, -1 for
// none; where `ends` is given, it gets the entries of groups 0..g for each g
// (int32 [groups], at::_grouped_mm's group ends). Returns false (filling
// nothing) where the kernels are not built, the key is not on a GPU or there
// are too many groups: the caller sorts instead.
bool groupByKeyKernels(const at::Tensor& key, int64_t groups, int64_t count, at::Tensor& order, at::Tensor& table,
                       at::Tensor* ends = nullptr);

// The most groups groupByKeyKernels takes (0 where its kernels are not built).
int64_t groupByKeyKernelsMaxGroups();

}  // namespace bulkhead::moe
