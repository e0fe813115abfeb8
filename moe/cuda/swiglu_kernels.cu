#include "moe/cuda/swiglu_kernels.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#include "moe/cuda/elements.cuh"

namespace bulkhead::moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;  // more groups: each thread takes several

__device__ __forceinline__ float exponential(float x) { return expf(x); }
__device__ __forceinline__ double exponential(double x) { return exp(x); }

// Whether `row` is computed (see SwigluArgs::live).
__device__ __forceinline__ bool liveRow(const int32_t* live, int64_t row, int64_t groupRows) {
  return live == nullptr || row % groupRows < live[row / groupRows];
}

template <int kSize, typename T>
__device__ __forceinline__ void storeZeros(T* out) {
  typename Acc<T>::type zeros[kSize] = {};
  storeGroup<kSize>(out, zeros);
}

// Each thread takes groups of kSize elements of one row: the gate at column f,
// the up projection at F + f.
template <typename T, int kSize>
__global__ void forwardKernel(const T* gateUp, T* out, int64_t rows, int64_t width, const int32_t* live,
                              int64_t groupRows) {
  using A = typename Acc<T>::type;
  const int64_t perRow = width / kSize, groups = rows * perRow;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < groups;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / perRow, column = (i % perRow) * kSize;
    if (!liveRow(live, row, groupRows)) {
      storeZeros<kSize>(out + row * width + column);
      continue;
    }
    A g[kSize], u[kSize], h[kSize];
    loadGroup<kSize>(gateUp + row * 2 * width + column, g);
    loadGroup<kSize>(gateUp + row * 2 * width + width + column, u);
#pragma unroll
    for (int k = 0; k < kSize; ++k) h[k] = g[k] / (A(1) + exponential(-g[k])) * u[k];
    storeGroup<kSize>(out + row * width + column, h);
  }
}

template <typename T, int kSize>
__global__ void backwardKernel(const T* gateUp, const T* gradOut, T* gradGateUp, int64_t rows, int64_t width,
                               const int32_t* live, int64_t groupRows) {
  using A = typename Acc<T>::type;
  const int64_t perRow = width / kSize, groups = rows * perRow;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < groups;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / perRow, column = (i % perRow) * kSize;
    if (!liveRow(live, row, groupRows)) {
      storeZeros<kSize>(gradGateUp + row * 2 * width + column);
      storeZeros<kSize>(gradGateUp + row * 2 * width + width + column);
      continue;
    }
    A g[kSize], u[kSize], d[kSize], gradGate[kSize], gradUp[kSize];
    loadGroup<kSize>(gateUp + row * 2 * width + column, g);
    loadGroup<kSize>(gateUp + row * 2 * width + width + column, u);
    loadGroup<kSize>(gradOut + row * width + column, d);
#pragma unroll
    for (int k = 0; k < kSize; ++k) {
      const A sigmoid = A(1) / (A(1) + exponential(-g[k]));
      gradGate[k] = d[k] * u[k] * sigmoid * (A(1) + g[k] * (A(1) - sigmoid));
      gradUp[k] = d[k] * g[k] * sigmoid;
    }
    storeGroup<kSize>(gradGateUp + row * 2 * width + column, gradGate);
    storeGroup<kSize>(gradGateUp + row * 2 * width + width + column, gradUp);
  }
}

unsigned blocksFor(int64_t groups) {
  return static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (groups + kThreads - 1) / kThreads));
}

template <typename T>
void launchForward(const SwigluArgs& args, const void* gateUp, void* out) {
  const bool vectors = vectorRows<T>(args.width, {gateUp, out});
  const int64_t groups = args.rows * (vectors ? args.width / kVector<T> : args.width);
  if (groups == 0) return;
  auto kernel = vectors ? forwardKernel<T, kVector<T>> : forwardKernel<T, 1>;
  kernel<<<blocksFor(groups), kThreads, 0, static_cast<cudaStream_t>(args.stream)>>>(
      static_cast<const T*>(gateUp), static_cast<T*>(out), args.rows, args.width, args.live, args.rows / args.groups);
  checkLaunch("SwiGLU forward kernel launch");
}

template <typename T>
void launchBackward(const SwigluArgs& args, const void* gateUp, const void* gradOut, void* gradGateUp) {
  const bool vectors = vectorRows<T>(args.width, {gateUp, gradOut, gradGateUp});
  const int64_t groups = args.rows * (vectors ? args.width / kVector<T> : args.width);
  if (groups == 0) return;
  auto kernel = vectors ? backwardKernel<T, kVector<T>> : backwardKernel<T, 1>;
  kernel<<<blocksFor(groups), kThreads, 0, static_cast<cudaStream_t>(args.stream)>>>(
      static_cast<const T*>(gateUp), static_cast<const T*>(gradOut), static_cast<T*>(gradGateUp), args.rows, args.width,
      args.live, args.rows / args.groups);
  checkLaunch("SwiGLU backward kernel launch");
}

void checkGroups(const SwigluArgs& args) {
  if (args.groups < 1 || args.rows % args.groups != 0)
    throw std::runtime_error("SwiGLU kernels: the rows must be a whole number of groups, at least one");
}

}  // namespace

void swigluForward(const SwigluArgs& args, const void* gateUp, void* out) {
  checkGroups(args);
  switch (args.type) {
    case Dtype::Float32:
      return launchForward<float>(args, gateUp, out);
    case Dtype::Float64:
      return launchForward<double>(args, gateUp, out);
    case Dtype::BFloat16:
      return launchForward<__nv_bfloat16>(args, gateUp, out);
    case Dtype::Float16:
      return launchForward<__half>(args, gateUp, out);
  }
}

void swigluBackward(const SwigluArgs& args, const void* gateUp, const void* gradOut, void* gradGateUp) {
  checkGroups(args);
  switch (args.type) {
    case Dtype::Float32:
      return launchBackward<float>(args, gateUp, gradOut, gradGateUp);
    case Dtype::Float64:
      return launchBackward<double>(args, gateUp, gradOut, gradGateUp);
    case Dtype::BFloat16:
      return launchBackward<__nv_bfloat16>(args, gateUp, gradOut, gradGateUp);
    case Dtype::Float16:
      return launchBackward<__half>(args, gateUp, gradOut, gradGateUp);
  }
}

}  // namespace bulkhead::moe::cuda
