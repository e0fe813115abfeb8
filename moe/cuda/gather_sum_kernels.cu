#include "moe/cuda/gather_sum_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace bulkhead::moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxColumns = 64;

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type load(const T* p) { return static_cast<typename Acc<T>::type>(*p); }
template <> __device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
template <> __device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }

template <typename T, typename A> __device__ __forceinline__ void store(T* p, A v) { *p = static_cast<T>(v); }
template <> __device__ __forceinline__ void store(__nv_bfloat16* p, float v) { *p = __float2bfloat16(v); }
template <> __device__ __forceinline__ void store(__half* p, float v) { *p = __float2half(v); }

// Threads move rows in groups of kSize elements: 16-byte vectors (kVector)
// where every row's bytes and base address are multiples of 16 (the layer's
// rows are whenever the hidden size is a multiple of 8), single elements
// otherwise.
template <typename T> constexpr int kVector = 16 / sizeof(T);

template <int kSize, typename T, typename A>
__device__ __forceinline__ void loadGroup(const T* p, A (&values)[kSize]) {
  if constexpr (kSize == 1) {
    values[0] = load(p);
  } else {
    static_assert(kSize * sizeof(T) == 16, "a group is one 16-byte vector");
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* items = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < kSize; ++i) values[i] = load(items + i);
  }
}

template <int kSize, typename T, typename A>
__device__ __forceinline__ void storeGroup(T* p, const A (&values)[kSize]) {
  if constexpr (kSize == 1) {
    store(p, values[0]);
  } else {
    uint4 raw;
    T* items = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < kSize; ++i) store(items + i, values[i]);
    *reinterpret_cast<uint4*>(p) = raw;
  }
}

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

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// True when rows of `width` elements at these addresses split into whole 16-byte vectors.
template <typename T>
bool vectorRows(int64_t width, std::initializer_list<const void*> rows) {
  if (width * static_cast<int64_t>(sizeof(T)) % 16 != 0) return false;
  for (const void* base : rows)
    if (base && reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  return true;
}

template <typename T, typename W>
void launchForward(const GatherSumArgs& args, const void* source, void* out) {
  if (args.outputs == 0) return;
  auto kernel = vectorRows<T>(args.width, {source, out}) ? forwardKernel<T, W, kVector<T>> : forwardKernel<T, W, 1>;
  kernel<<<args.outputs, kThreads, 0, static_cast<cudaStream_t>(args.stream)>>>(
      static_cast<const T*>(source), static_cast<T*>(out), args.table, static_cast<const W*>(args.weights),
      args.columns, args.width);
  check(cudaGetLastError(), "gather-sum forward kernel launch");
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
  check(cudaGetLastError(), "gather-sum backward kernel launch");
}

template <template <typename, typename> class Launch, typename... Args>
void dispatch(const GatherSumArgs& args, Args... rest) {
  if (args.columns > kMaxColumns) throw std::runtime_error("gather-sum: more than 64 columns per row");
  const bool wide = args.weightType == Dtype::Float64;
  switch (args.rowType) {
    case Dtype::Float32: return wide ? Launch<float, double>::run(args, rest...) : Launch<float, float>::run(args, rest...);
    case Dtype::Float64: return wide ? Launch<double, double>::run(args, rest...) : Launch<double, float>::run(args, rest...);
    case Dtype::BFloat16:
      return wide ? Launch<__nv_bfloat16, double>::run(args, rest...) : Launch<__nv_bfloat16, float>::run(args, rest...);
    case Dtype::Float16: return wide ? Launch<__half, double>::run(args, rest...) : Launch<__half, float>::run(args, rest...);
  }
}

template <typename T, typename W> struct Forward {
  static void run(const GatherSumArgs& args, const void* source, void* out) { launchForward<T, W>(args, source, out); }
};
template <typename T, typename W> struct Backward {
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
