#include "runtime/nccl/peer_reduce_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <string>

#include "runtime/errors.h"

namespace bulkhead::nccl::peer {
namespace {

constexpr int kThreads = 512;
constexpr int64_t kGroupsPerBlock = 2048;  // below this many groups a block, fewer blocks

__device__ __forceinline__ float toFloat(float v) { return v; }
__device__ __forceinline__ float toFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float toFloat(__half v) { return __half2float(v); }
template <typename T>
__device__ __forceinline__ T fromFloat(float v);
template <>
__device__ __forceinline__ float fromFloat<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 fromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <>
__device__ __forceinline__ __half fromFloat<__half>(float v) {
  return __float2half(v);
}

// kSize elements moved as one load or store: 16 bytes where the tensor allows.
template <typename T, int kSize>
struct alignas(sizeof(T) * kSize) Group {
  T v[kSize];
};

__device__ __forceinline__ uint64_t nanoseconds() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__device__ __forceinline__ uint64_t* flagOf(char* region, int phase, int block, int rank) {
  return reinterpret_cast<uint64_t*>(region) + (phase * kMaxBlocks + block) * kMaxRanks + rank;
}

// This block's barrier of `phase` for call `call`: its writes so far are made
// visible to every peer, it raises its flag in every peer's region, and it
// waits until every peer's block has raised its own in this rank's region.
// False when it gave up (a peer did not come within the bound, or the host
// aborted): the verdict then names the peer.
__device__ bool barrier(const Regions& regions, const LaunchArgs& a, int phase, uint64_t call) {
  __shared__ int gaveUp;
  if (threadIdx.x == 0) gaveUp = 0;
  __syncthreads();
  const int peer = threadIdx.x;
  if (peer < a.size) {
    __threadfence_system();
    *reinterpret_cast<volatile uint64_t*>(flagOf(regions.base[peer], phase, blockIdx.x, a.rank)) = call;
    const volatile uint64_t* mine = flagOf(regions.base[a.rank], phase, blockIdx.x, peer);
    const uint64_t since = nanoseconds();
    for (unsigned spins = 1; *mine < call; ++spins) {
      if (spins % 256 != 0) continue;
      const volatile Verdict* verdict = a.verdict;
      if (verdict->abort != 0 || nanoseconds() - since > a.giveUpNanoseconds) {
        // The first give-up names the peer; one after an abort, or after another, keeps it.
        if (verdict->gaveUp == 0 && verdict->abort == 0)
          a.verdict->gaveUp = (static_cast<unsigned long long>(call) << 8) | static_cast<unsigned>(peer);
        __threadfence_system();
        gaveUp = 1;
        break;
      }
    }
    __threadfence_system();
  }
  __syncthreads();
  return gaveUp == 0;
}

// The sum of group i over every rank's area at `offset`, in rank order on every rank: the same bits everywhere.
template <typename T, int kSize>
__device__ __forceinline__ Group<T, kSize> sumOf(const Regions& regions, int64_t offset, int size, int64_t i) {
  float acc[kSize] = {};
  for (int p = 0; p < size; ++p) {
    const Group<T, kSize> in = reinterpret_cast<const Group<T, kSize>*>(regions.base[p] + offset)[i];
#pragma unroll
    for (int k = 0; k < kSize; ++k) acc[k] += toFloat(in.v[k]);
  }
  Group<T, kSize> result;
#pragma unroll
  for (int k = 0; k < kSize; ++k) result.v[k] = fromFloat<T>(acc[k]);
  return result;
}

// Group i of the caller's tensor, whose address need not be a multiple of 16
// bytes (`aligned` says whether it is): the regions' layout is the same on
// every rank whatever the tensors' addresses.
template <typename T, int kSize>
__device__ __forceinline__ Group<T, kSize> loadTensor(const T* tensor, bool aligned, int64_t i) {
  if (aligned) return reinterpret_cast<const Group<T, kSize>*>(tensor)[i];
  Group<T, kSize> group;
#pragma unroll
  for (int k = 0; k < kSize; ++k) group.v[k] = tensor[i * kSize + k];
  return group;
}
template <typename T, int kSize>
__device__ __forceinline__ void storeTensor(T* tensor, bool aligned, int64_t i, const Group<T, kSize>& group) {
  if (aligned) {
    reinterpret_cast<Group<T, kSize>*>(tensor)[i] = group;
    return;
  }
#pragma unroll
  for (int k = 0; k < kSize; ++k) tensor[i * kSize + k] = group.v[k];
}

// One call. Block b sums groups [lo, hi) of the tensor: one-shot, it reads
// every peer's copy of them; two-shot, rank p sums share p of them into its
// result area and every rank then gathers the shares.
template <typename T, int kSize>
__global__ void __launch_bounds__(kThreads) allReduceKernel(Regions regions, LaunchArgs a, bool aligned) {
  using G = Group<T, kSize>;
  const uint64_t call = *reinterpret_cast<volatile uint64_t*>(a.sequence) + 1;
  const int64_t epoch = static_cast<int64_t>(call % kEpochs);
  const int64_t data = kFlagBytes + epoch * a.capacity, result = kFlagBytes + (kEpochs + epoch) * a.capacity;
  const int64_t groups = a.numel / kSize;
  const int64_t lo = groups * blockIdx.x / gridDim.x, hi = groups * (blockIdx.x + 1) / gridDim.x;
  T* tensor = static_cast<T*>(a.tensor);
  G* mine = reinterpret_cast<G*>(regions.base[a.rank] + data);
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) mine[i] = loadTensor<T, kSize>(tensor, aligned, i);
  if (barrier(regions, a, 0, call)) {
    if (!a.twoShot) {
      for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads)
        storeTensor(tensor, aligned, i, sumOf<T, kSize>(regions, data, a.size, i));
    } else {
      const int64_t width = hi - lo;
      const int64_t from = lo + width * a.rank / a.size, to = lo + width * (a.rank + 1) / a.size;
      G* share = reinterpret_cast<G*>(regions.base[a.rank] + result);
      for (int64_t i = from + threadIdx.x; i < to; i += kThreads) share[i] = sumOf<T, kSize>(regions, data, a.size, i);
      if (barrier(regions, a, 1, call))
        for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
          const int owner = static_cast<int>(((i - lo + 1) * a.size - 1) / (width > 0 ? width : 1));
          storeTensor(tensor, aligned, i, reinterpret_cast<const G*>(regions.base[owner] + result)[i]);
        }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the last block to end counts the call as done
    __threadfence();
    if (atomicAdd(a.blocksDone, 1u) == gridDim.x - 1) {
      *a.blocksDone = 0;
      *reinterpret_cast<volatile uint64_t*>(a.sequence) = call;
      __threadfence();
    }
  }
}

// The layout (16-byte groups, or single elements) and the grid follow from the
// element count alone, so every rank of a call agrees on them.
template <typename T>
void launchTyped(const Regions& regions, const LaunchArgs& a) {
  constexpr int kVector = 16 / sizeof(T);
  const bool vector = a.numel % kVector == 0;
  const bool aligned = reinterpret_cast<uintptr_t>(a.tensor) % 16 == 0;
  const int64_t groups = vector ? a.numel / kVector : a.numel;
  const int64_t wanted = (groups + kGroupsPerBlock - 1) / kGroupsPerBlock;
  const int blocks = static_cast<int>(wanted < 1 ? 1 : wanted > kMaxBlocks ? kMaxBlocks : wanted);
  auto stream = static_cast<cudaStream_t>(a.stream);
  if (vector)
    allReduceKernel<T, kVector><<<blocks, kThreads, 0, stream>>>(regions, a, aligned);
  else
    allReduceKernel<T, 1><<<blocks, kThreads, 0, stream>>>(regions, a, true);
}

}  // namespace

bool kernelRunsHere() {
  cudaFuncAttributes attributes;
  const bool runs = cudaFuncGetAttributes(&attributes, allReduceKernel<float, 4>) == cudaSuccess;
  cudaGetLastError();
  return runs;
}

void launchPeerAllReduce(const Regions& regions, const LaunchArgs& args) {
  switch (args.dtype) {
    case Dtype::Float32:
      launchTyped<float>(regions, args);
      break;
    case Dtype::BFloat16:
      launchTyped<__nv_bfloat16>(regions, args);
      break;
    case Dtype::Float16:
      launchTyped<__half>(regions, args);
      break;
  }
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return;
  const std::string what = std::string("the peer all-reduce kernel's launch failed: ") + cudaGetErrorString(status);
  if (status == cudaErrorNoKernelImageForDevice || status == cudaErrorInvalidDeviceFunction)
    throw ConfigError(what, {.rank = args.rank,
                             .expected = "a GPU of the CUDA architectures the kernels were built for (rebuild with "
                                         "CMAKE_CUDA_ARCHITECTURES naming this GPU's)"});
  throw Error(what,
              {.rank = args.rank, .expected = "no fault on the device; restart the job from its last checkpoint"});
}

}  // namespace bulkhead::nccl::peer
