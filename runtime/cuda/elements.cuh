#pragma once
// What Bulkhead's CUDA kernels (moe/cuda, parallel/cuda) share: element loads
// and stores in their accumulation type, 16-byte vector groups, and the one
// place where a kernel launch's CUDA error becomes an exception.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "runtime/errors.h"

namespace bulkhead::cuda {

// Raises what the last launch reported, naming the kernel: ConfigError on a
// GPU the kernels were not built for; otherwise the device's first unreported
// error, which an earlier fault (another kernel's, or NCCL's) may have left.
inline void checkLaunch(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return;
  if (status == cudaErrorNoKernelImageForDevice || status == cudaErrorInvalidDeviceFunction) {
    throw ConfigError(std::string(what) + " failed: " + cudaGetErrorString(status),
                      {.expected = "a GPU of the CUDA architectures the kernels were built for "
                                   "(rebuild with CMAKE_CUDA_ARCHITECTURES naming this GPU's)"});
  }
  throw Error(std::string(what) + " failed: " + cudaGetErrorString(status) +
                  " (the device's first unreported error: it may come from earlier work on this GPU)",
              {.expected = "no fault on the device; restart the job from its last checkpoint"});
}

// Half-precision elements accumulate in float, float64 in double.
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};

template <typename T>
__device__ __forceinline__ typename Acc<T>::type load(const T* p) {
  return static_cast<typename Acc<T>::type>(*p);
}
template <>
__device__ __forceinline__ float load(const __nv_bfloat16* p) {
  return __bfloat162float(*p);
}
template <>
__device__ __forceinline__ float load(const __half* p) {
  return __half2float(*p);
}

template <typename T, typename A>
__device__ __forceinline__ void store(T* p, A v) {
  *p = static_cast<T>(v);
}
template <>
__device__ __forceinline__ void store(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16(v);
}
template <>
__device__ __forceinline__ void store(__half* p, float v) {
  *p = __float2half(v);
}

// Threads move rows in groups of kSize elements: 16-byte vectors (kVector)
// where every row's bytes and base address are multiples of 16 (the layer's
// rows are whenever their widths are multiples of 8), single elements
// otherwise.
template <typename T>
constexpr int kVector = 16 / sizeof(T);

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

// True when rows of `width` elements at these addresses split into whole 16-byte vectors.
template <typename T>
bool vectorRows(int64_t width, std::initializer_list<const void*> rows) {
  if (width * static_cast<int64_t>(sizeof(T)) % 16 != 0) return false;
  for (const void* base : rows)
    if (base && reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  return true;
}

}  // namespace bulkhead::cuda
