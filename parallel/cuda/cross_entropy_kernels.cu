#include "parallel/cuda/cross_entropy_kernels.h"

#include <cmath>
#include <cstdint>

#include "runtime/cuda/elements.cuh"

namespace bulkhead::parallel::cuda {
namespace {

using ::bulkhead::cuda::checkLaunch;
using ::bulkhead::cuda::kVector;
using ::bulkhead::cuda::loadGroup;
using ::bulkhead::cuda::storeGroup;
using ::bulkhead::cuda::vectorRows;

constexpr int kThreads = 512;  // one block a row: a vocabulary block is long (151,936 for Qwen3)
constexpr int kWarps = kThreads / 32;

// A running maximum m and sum of exp(x - m); a maximum of -inf means nothing counted yet.
struct Running {
  float max = -INFINITY;
  float sum = 0.f;
};

__device__ __forceinline__ Running combine(Running a, Running b) {
  if (b.max == -INFINITY) return a;
  if (a.max == -INFINITY) return b;
  const float m = fmaxf(a.max, b.max);
  return {m, a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m)};
}

// The row's (max, sum) over the whole block, in thread 0.
__device__ Running blockCombine(Running mine) {
  __shared__ float maxes[kWarps], sums[kWarps];
  for (int offset = 16; offset > 0; offset /= 2)
    mine =
        combine(mine, {__shfl_xor_sync(0xffffffffu, mine.max, offset), __shfl_xor_sync(0xffffffffu, mine.sum, offset)});
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    maxes[warp] = mine.max;
    sums[warp] = mine.sum;
  }
  __syncthreads();
  if (warp != 0) return mine;
  mine = lane < kWarps ? Running{maxes[lane], sums[lane]} : Running{};
  for (int offset = 16; offset > 0; offset /= 2)
    mine =
        combine(mine, {__shfl_xor_sync(0xffffffffu, mine.max, offset), __shfl_xor_sync(0xffffffffu, mine.sum, offset)});
  return mine;
}

template <typename T, int kSize>
__global__ void __launch_bounds__(kThreads)
    rowStatsKernel(const T* logits, int64_t width, const int64_t* column, float* rowMax, float* rowSum, float* target) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * width;
  Running mine;
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * kSize; c < width; c += int64_t{kThreads} * kSize) {
    float v[kSize];
    loadGroup<kSize>(x + c, v);
    Running group{v[0], 0.f};
#pragma unroll
    for (int k = 1; k < kSize; ++k) group.max = fmaxf(group.max, v[k]);
    if (group.max == -INFINITY) continue;
#pragma unroll
    for (int k = 0; k < kSize; ++k) group.sum += __expf(v[k] - group.max);
    mine = combine(mine, group);
  }
  mine = blockCombine(mine);
  if (threadIdx.x != 0) return;
  rowMax[row] = mine.max;
  rowSum[row] = mine.sum;
  const int64_t at = column[row];
  float t[1] = {0.f};
  if (at >= 0) loadGroup<1>(x + at, t);
  target[row] = t[0];
}

template <typename T, int kSize>
__global__ void __launch_bounds__(kThreads) gradientKernel(const T* logits, int64_t width, const int64_t* column,
                                                           const float* logSumExp, const float* scale, T* grad) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * width;
  T* out = grad + row * width;
  const float lse = logSumExp[row], g = scale[row];
  const int64_t at = column[row];
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * kSize; c < width; c += int64_t{kThreads} * kSize) {
    float v[kSize];
    loadGroup<kSize>(x + c, v);
#pragma unroll
    for (int k = 0; k < kSize; ++k) v[k] = (__expf(v[k] - lse) - (c + k == at ? 1.f : 0.f)) * g;
    storeGroup<kSize>(out + c, v);
  }
}

template <typename T>
void rowStats(const CrossEntropyArgs& a, const T* logits, float* rowMax, float* rowSum, float* target) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (vectorRows<T>(a.width, {logits}))
    rowStatsKernel<T, kVector<T>><<<a.rows, kThreads, 0, stream>>>(logits, a.width, a.column, rowMax, rowSum, target);
  else
    rowStatsKernel<T, 1><<<a.rows, kThreads, 0, stream>>>(logits, a.width, a.column, rowMax, rowSum, target);
  checkLaunch("the cross-entropy's row statistics kernel");
}

template <typename T>
void gradient(const CrossEntropyArgs& a, const T* logits, const float* logSumExp, const float* scale, T* grad) {
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (vectorRows<T>(a.width, {logits, grad}))
    gradientKernel<T, kVector<T>><<<a.rows, kThreads, 0, stream>>>(logits, a.width, a.column, logSumExp, scale, grad);
  else
    gradientKernel<T, 1><<<a.rows, kThreads, 0, stream>>>(logits, a.width, a.column, logSumExp, scale, grad);
  checkLaunch("the cross-entropy's gradient kernel");
}

}  // namespace

void crossEntropyRowStats(const CrossEntropyArgs& args, const void* logits, float* rowMax, float* rowSum,
                          float* target) {
  if (args.rows == 0) return;
  if (args.type == LogitsType::BFloat16)
    rowStats(args, static_cast<const __nv_bfloat16*>(logits), rowMax, rowSum, target);
  else
    rowStats(args, static_cast<const __half*>(logits), rowMax, rowSum, target);
}

void crossEntropyGradient(const CrossEntropyArgs& args, const void* logits, const float* logSumExp, const float* scale,
                          void* grad) {
  if (args.rows == 0) return;
  if (args.type == LogitsType::BFloat16)
    gradient(args, static_cast<const __nv_bfloat16*>(logits), logSumExp, scale, static_cast<__nv_bfloat16*>(grad));
  else
    gradient(args, static_cast<const __half*>(logits), logSumExp, scale, static_cast<__half*>(grad));
}

}  // namespace bulkhead::parallel::cuda
