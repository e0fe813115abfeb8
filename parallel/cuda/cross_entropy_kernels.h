#pragma once
// CUDA kernels behind vocabParallelCrossEntropy (parallel/vocab_parallel.h) for
// half-precision logits, on raw pointers so this header and its .cu need no
// libtorch. Launched on `stream`; they never synchronize. Logits are rows of
// `width` contiguous elements, read in place in their own dtype: no float32
// copy of [rows, width] is made.
//   rowStats: per row, the maximum m, the sum of exp(x - m) over the row, and
//             the target's logit x[column[r]] (0 where column[r] < 0: another
//             tp rank holds it), in float32, in one pass over the row.
//   gradient: grad[r, c] = (exp(x[r, c] - logSumExp[r]) - (c == column[r])) * scale[r],
//             in the logits' dtype, in one pass.

#include <cstdint>

namespace bulkhead::parallel::cuda {

enum class LogitsType { BFloat16, Float16 };

struct CrossEntropyArgs {
  LogitsType type = LogitsType::BFloat16;
  int64_t rows = 0;
  int64_t width = 0;                // this tp rank's vocabulary block
  const int64_t* column = nullptr;  // [rows] the target's column in the block, or -1
  void* stream = nullptr;           // cudaStream_t
};

// rowMax, rowSum, target: float32 [rows] on the device.
void crossEntropyRowStats(const CrossEntropyArgs& args, const void* logits, float* rowMax, float* rowSum,
                          float* target);
// logSumExp, scale: float32 [rows]; grad: [rows, width] in the logits' dtype.
void crossEntropyGradient(const CrossEntropyArgs& args, const void* logits, const float* logSumExp, const float* scale,
                          void* grad);

}  // namespace bulkhead::parallel::cuda
