#pragma once
// CUDA kernels behind moe/gather_sum.h, on raw pointers so this header and its
// .cu need no libtorch. Launched on `stream`; they never synchronize.
//
// For every output row p (of `rows` outputs) and column c < m:
//   idx = table[p * m + c]  (-1: nothing)
//   forward:  out[p] = sum_c w[p, c] * source[idx]          (w = 1 without weights)
//   backward: gradSource[idx] = w[p, c] * gradOut[p]
//             gradWeights[p, c] = <gradOut[p], source[idx]>
// Every source row appears at most once in the table (so backward needs no
// atomics and stores each row's gradient); rows the table never names keep
// what the caller's buffer held: zeros, or nothing where the table names
// every row (SourceRows::Every).

#include <cstdint>

#include "moe/cuda/dtype.h"

namespace bulkhead::moe::cuda {

struct GatherSumArgs {
  Dtype rowType;        // dtype of source, out, gradOut, gradSource
  Dtype weightType;     // dtype of weights and gradWeights (Float32 or Float64)
  int64_t outputs = 0;  // rows of out
  int64_t columns = 0;  // m
  int64_t width = 0;    // elements per row
  const int64_t* table = nullptr;
  const void* weights = nullptr;  // null: every weight is 1
  void* stream = nullptr;         // cudaStream_t
};

void gatherSumForward(const GatherSumArgs& args, const void* source, void* out);
void gatherSumBackward(const GatherSumArgs& args, const void* source, const void* gradOut, void* gradSource,
                       void* gradWeights);

}  // namespace bulkhead::moe::cuda
