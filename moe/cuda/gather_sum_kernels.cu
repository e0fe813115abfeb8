#include "moe/cuda/gather_sum_kernels.h"

#include <cstdint>
#include <stdexcept>

#include "moe/cuda/elements.cuh"

namespace bulkhead::moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxColumns = 64;

// One block per output row: the row's table entries and weights go to shared
// memory, then threads stride over the row's groups.
template <typename T, typename W, int kSize>
__global__ void forwardKernel(const T* source, T* out, const int64_t* table, const W* weights, int64_t columns,
                              int64_t width) {
  using A = typename Acc<T>::type;
  __shared__ int64_t index[kMaxColumns];
  __shared__ A scale[kMaxColumns];
  const int64_t row = blockIdx.x;
  for (int64_t c = threadIdx.x; c < columns; c += blockDim.x) {
    index[c] = table[row * columns + c];
    scale[c] = weights ? static_cast<A>(weights[row * columns + c]) : A(1);
  }
  __syncthreads();
  for (int64_t e = threadIdx.x * kSize; e < width; e += blockDim.x * kSize) {
    A sum[kSize] = {};
    for (int64_t c = 0; c < columns; ++c) {
      if (index[c] < 0) continue;
      A x[kSize];
      loadGroup<kSize>(source + index[c] * width + e, x);
#pragma unroll
      for (int i = 0; i < kSize; ++i) sum[i] += scale[c] * x[i];
    }
    storeGroup<kSize>(out + row * width + e, sum);
  }
}

template <typename A>
__device__ A blockSum(A value, A* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  A total = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  __syncthreads();
  return total;
}

// Per output row and column: the scaled gradient to the source row, and the
// weight's gradient as a block-wide dot product.
template <typename T, typename W, int kSize>
__global__ void backwardKernel(const T* source, const T* gradOut, T* gradSource, W* gradWeights, const int64_t* table,
                               const W* weights, int64_t columns, int64_t width) {
  using A = typename Acc<T>::type;
  __shared__ A scratch[kThreads / 32];
  const int64_t row = blockIdx.x;
  for (int64_t c = 0; c < columns; ++c) {
    const int64_t index = table[row * columns + c];
    if (index < 0) {
      if (gradWeights && threadIdx.x == 0) gradWeights[row * columns + c] = W(0);
      continue;
    }
    const A scale = weights ? static_cast<A>(weights[row * columns + c]) : A(1);
    A dot = 0;
    for (int64_t e = threadIdx.x * kSize; e < width; e += blockDim.x * kSize) {
      A g[kSize];
      loadGroup<kSize>(gradOut + row * width + e, g);
      if (gradSource) {
        A scaled[kSize];
#pragma unroll
        for (int i = 0; i < kSize; ++i) scaled[i] = scale * g[i];
        storeGroup<kSize>(gradSource + index * width + e, scaled);
      }
      if (gradWeights) {
        A x[kSize];
        loadGroup<kSize>(source + index * width + e, x);
#pragma unroll
        for (int i = 0; i < kSize; ++i) dot += g[i] * x[i];
      }
    }
    if (gradWeights) {
      const A total = blockSum(dot, scratch);
      if (threadIdx.x == 0) gradWeights[row * columns + c] = static_cast<W>(total);
    }
  }
}

template <typename T, typename W>
void launchForward(const GatherSumArgs& args, const void* source, void* out) {
  if (args.outputs == 0) return;
  auto kernel = vectorRows<T>(args.width, {source, out}) ? forwardKernel<T, W, kVector<T>> : forwardKernel<T, W, 1>;
  kernel<<<args.outputs, kThreads, 0, static_cast<cudaStream_t>(args.stream)>>>(
      static_cast<const T*>(source), static_cast<T*>(out), args.table, static_cast<const W*>(args.weights),
      args.columns, args.width);
  checkLaunch("gather-sum forward kernel launch");
}

template <typename T, typename W>
void launchBackward(const GatherSumArgs& args, const void* source, const void* gradOut, void* gradSource,
                    void* gradWeights) {
  if (args.outputs == 0) return;
  auto kernel = vectorRows<T>(args.width, {source, gradOut, gradSource}) ? backwardKernel<T, W, kVector<T>>
                                                                         : backwardKernel<T, W, 1>;
  kernel<<<args.outputs, kThreads, 0, static_cast<cudaStream_t>(args.stream)>>>(
      static_cast<const T*>(source), static_cast<const T*>(gradOut), static_cast<T*>(gradSource),
      static_cast<W*>(gradWeights), args.table, static_cast<const W*>(args.weights), args.columns, args.width);
  checkLaunch("gather-sum backward kernel launch");
}

template <template <typename, typename> class Launch, typename... Args>
void dispatch(const GatherSumArgs& args, Args... rest) {
  if (args.columns > kMaxColumns) throw std::runtime_error("gather-sum: more than 64 columns per row");
  const bool wide = args.weightType == Dtype::Float64;
  switch (args.rowType) {
    case Dtype::Float32:
      return wide ? Launch<float, double>::run(args, rest...) : Launch<float, float>::run(args, rest...);
    case Dtype::Float64:
      return wide ? Launch<double, double>::run(args, rest...) : Launch<double, float>::run(args, rest...);
    case Dtype::BFloat16:
      return wide ? Launch<__nv_bfloat16, double>::run(args, rest...)
                  : Launch<__nv_bfloat16, float>::run(args, rest...);
    case Dtype::Float16:
      return wide ? Launch<__half, double>::run(args, rest...) : Launch<__half, float>::run(args, rest...);
  }
}

template <typename T, typename W>
struct Forward {
  static void run(const GatherSumArgs& args, const void* source, void* out) { launchForward<T, W>(args, source, out); }
};
template <typename T, typename W>
struct Backward {
  static void run(const GatherSumArgs& args, const void* source, const void* gradOut, void* gradSource,
                  void* gradWeights) {
    launchBackward<T, W>(args, source, gradOut, gradSource, gradWeights);
  }
};

}  // namespace

void gatherSumForward(const GatherSumArgs& args, const void* source, void* out) {
  dispatch<Forward>(args, source, out);
}

void gatherSumBackward(const GatherSumArgs& args, const void* source, const void* gradOut, void* gradSource,
                       void* gradWeights) {
  dispatch<Backward>(args, source, gradOut, gradSource, gradWeights);
}

}  // namespace bulkhead::moe::cuda
