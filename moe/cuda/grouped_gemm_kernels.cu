#include "moe/cuda/grouped_gemm_kernels.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <optional>
#include <string>

#include "moe/cuda/hopper_ptx.cuh"
#include "runtime/cuda/elements.cuh"
#include "runtime/errors.h"

// The kernels' bodies exist in the sm_90a pass alone (wgmma, setmaxnreg);
// moe/CMakeLists.txt compiles this file for that target only.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BULKHEAD_GROUPED_GEMM_BODY 1
#endif

namespace bulkhead::moe::cuda {
namespace {

// A block's tile: 128 output rows (64 a consumer warpgroup) by 256 columns,
// reduced 64 at a time through kStages shared-memory stages.
constexpr int kTileM = 128, kTileN = 256, kTileK = 64, kStages = 3;
constexpr int kThreads = 384;  // a producer warpgroup, two consumer warpgroups
constexpr int kConsumerWarps = 8;
constexpr uint32_t kChunkBytes = 64 * 64 * 2;  // one 64 x 64 bf16 box, 128-byte swizzled
constexpr uint32_t kStageBytes = (kTileM + kTileN) * kTileK * 2;

struct alignas(1024) Stage {
  __nv_bfloat16 a[kTileM * kTileK];
  __nv_bfloat16 b[kTileN * kTileK];
};

// Each consumer warpgroup's 64 x 256 outputs, rounded, as four 64 x 64 boxes
// swizzled as the tensor copy engine stores them.
struct alignas(1024) Staging {
  __nv_bfloat16 out[64 * kTileN];
};

struct SharedStorage {
  Stage stages[kStages];
  Staging staging[2];
  uint64_t full[kStages];
  uint64_t empty[kStages];
  int32_t rowStart[kMaxProductGroups + 2];   // group g's first row; [groups + 1] = rows
  int32_t tileStart[kMaxProductGroups + 2];  // row-grouped: the row tiles before group g
};

struct Params {
  __nv_bfloat16* out = nullptr;
  const int32_t* ends = nullptr;
  int groups = 0;
  int64_t rows = 0, m = 0, n = 0, k = 0;
};

// One tile of the work: rows [row0, rowEnd) of the output (Wgrad: of group
// `group`'s [m, n] block, its reduction over rows [reduce0, reduce0 + reduceRows)),
// columns from col0, kSteps steps of kTileK.
struct Tile {
  int group = 0;
  int64_t row0 = 0, rowEnd = 0, col0 = 0;
  int64_t reduce0 = 0, reduceRows = 0;
  int kSteps = 0;
};

__host__ __device__ constexpr int64_t ceilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

#if BULKHEAD_GROUPED_GEMM_BODY

using namespace hopper;

// A shared-memory matrix descriptor for wgmma over a 128-byte swizzled tile:
// K-major rows of 64 elements (8-row groups 1,024 bytes apart), or MN-major
// 64 x 64 boxes (kChunkBytes apart along M or N, 8-row groups of K 1,024 apart).
__device__ __forceinline__ uint64_t descriptor(const void* p, bool mnMajor) {
  const uint64_t address = sharedAddress(p);
  const uint64_t leading = mnMajor ? kChunkBytes : 16, stride = 1024;
  return ((address & 0x3FFFF) >> 4) | ((leading >> 4) << 16) | ((stride >> 4) << 32) | (uint64_t{1} << 62);
}

// The byte offset of the kk-th 16-deep slice of a 64-deep stage.
__device__ __forceinline__ uint32_t sliceOffset(int kk, bool mnMajor) { return mnMajor ? kk * 16 * 128 : kk * 32; }

// kSlices 16-deep products of one stage into d.
template <bool kMnA, bool kMnB, int kSlices>
__device__ __forceinline__ void mmaSlices(float (&d)[128], uint64_t descA, uint64_t descB, bool accumulate) {
#pragma unroll
  for (int kk = 0; kk < kSlices; ++kk) {
    mma64x256<kMnA, kMnB>(d, descA + (sliceOffset(kk, kMnA) >> 4), descB + (sliceOffset(kk, kMnB) >> 4),
                          accumulate || kk > 0);
  }
}

// Shared memory's group starts (warp 0: a running maximum, so that each start
// is at least the one before), and for row-grouped products the row tiles
// before each group (the rows past the last end as group `groups`, of zeros).
__device__ void loadGroups(SharedStorage& s, const Params& p, bool rowGrouped) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  int carry = 0;
  for (int base = 0; base <= p.groups; base += 32) {
    const int g = base + lane;
    int start = g == 0 || g > p.groups ? 0 : static_cast<int>(smaller(p.ends[g - 1] < 0 ? 0 : p.ends[g - 1], p.rows));
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, start, offset);
      if (lane >= offset) start = max(start, up);
    }
    start = max(start, carry);
    if (g <= p.groups) s.rowStart[g] = start;
    carry = __shfl_sync(0xffffffffu, start, 31);
  }
  if (lane == 0) s.rowStart[p.groups + 1] = static_cast<int32_t>(p.rows);
  __syncwarp();
  if (!rowGrouped) return;
  carry = 0;
  for (int base = 0; base <= p.groups; base += 32) {
    const int g = base + lane;
    int tiles = g <= p.groups ? static_cast<int>(ceilDiv(s.rowStart[g + 1] - s.rowStart[g], kTileM)) : 0;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const int up = __shfl_up_sync(0xffffffffu, tiles, offset);
      if (lane >= offset) tiles += up;
    }
    if (g <= p.groups) s.tileStart[g + 1] = carry + tiles;
    carry += __shfl_sync(0xffffffffu, tiles, 31);
  }
  if (lane == 0) s.tileStart[0] = 0;
}

// Tile t of a row-grouped product (Forward, Dgrad): row tiles in group order,
// each across the columns; false past the last.
__device__ bool rowTile(const SharedStorage& s, const Params& p, int64_t t, Tile& tile) {
  const int64_t columnTiles = ceilDiv(p.n, kTileN), rowTileIndex = t / columnTiles;
  if (rowTileIndex >= s.tileStart[p.groups + 1]) return false;
  int lo = 0, hi = p.groups;  // the last group whose tiles start at or before rowTileIndex
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (s.tileStart[mid] <= rowTileIndex)
      lo = mid;
    else
      hi = mid - 1;
  }
  tile.group = lo;
  tile.row0 = s.rowStart[lo] + (rowTileIndex - s.tileStart[lo]) * kTileM;
  tile.rowEnd = smaller(tile.row0 + kTileM, s.rowStart[lo + 1]);
  tile.col0 = (t % columnTiles) * kTileN;
  tile.kSteps = lo < p.groups ? static_cast<int>(ceilDiv(p.k, kTileK)) : 0;
  return true;
}

// Tile t of Wgrad: each group's [m, n] block in tiles, reduced over its rows.
__device__ bool weightTile(const SharedStorage& s, const Params& p, int64_t t, Tile& tile) {
  const int64_t columnTiles = ceilDiv(p.n, kTileN), perGroup = ceilDiv(p.m, kTileM) * columnTiles;
  if (t >= perGroup * p.groups) return false;
  tile.group = static_cast<int>(t / perGroup);
  const int64_t within = t % perGroup;
  tile.row0 = (within / columnTiles) * kTileM;
  tile.rowEnd = smaller(tile.row0 + kTileM, p.m);
  tile.col0 = (within % columnTiles) * kTileN;
  tile.reduce0 = s.rowStart[tile.group];
  tile.reduceRows = s.rowStart[tile.group + 1] - tile.reduce0;
  tile.kSteps = static_cast<int>(ceilDiv(tile.reduceRows, kTileK));
  return true;
}

template <GroupedProduct kProduct>
__device__ __forceinline__ bool nextTile(const SharedStorage& s, const Params& p, int64_t t, Tile& tile) {
  return kProduct == GroupedProduct::Wgrad ? weightTile(s, p, t, tile) : rowTile(s, p, t, tile);
}

// One stage's loads (see the header for each product's operands).
template <GroupedProduct kProduct>
__device__ __forceinline__ void loadStage(Stage& st, uint64_t* bar, const CUtensorMap* mapA, const CUtensorMap* mapB,
                                          const Tile& tile, int step) {
  const int64_t k0 = static_cast<int64_t>(step) * kTileK;
  barrierExpectBytes(bar, kStageBytes);
  if constexpr (kProduct == GroupedProduct::Wgrad) {
    for (int c = 0; c < kTileM / 64; ++c) load2d(st.a + c * 64 * 64, mapA, tile.row0 + 64 * c, tile.reduce0 + k0, bar);
    for (int c = 0; c < kTileN / 64; ++c) load2d(st.b + c * 64 * 64, mapB, tile.col0 + 64 * c, tile.reduce0 + k0, bar);
  } else {
    load2d(st.a, mapA, k0, tile.row0, bar);
    if constexpr (kProduct == GroupedProduct::Forward) {
      load3d(st.b, mapB, k0, tile.col0, tile.group, bar);
    } else {
      for (int c = 0; c < kTileN / 64; ++c) load3d(st.b + c * 64 * 64, mapB, tile.col0 + 64 * c, k0, tile.group, bar);
    }
  }
}

template <GroupedProduct kProduct>
__device__ void produce(SharedStorage& s, const Params& p, const CUtensorMap* mapA, const CUtensorMap* mapB) {
  int stage = 0;
  uint32_t phase = 0;
  Tile tile;
  for (int64_t t = blockIdx.x; nextTile<kProduct>(s, p, t, tile); t += gridDim.x) {
    for (int step = 0; step < tile.kSteps; ++step) {
      barrierWait(&s.empty[stage], phase ^ 1);
      loadStage<kProduct>(s.stages[stage], &s.full[stage], mapA, mapB, tile, step);
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
  }
}

// Wgrad's last step of a group whose rows end inside it: the rows past the
// group's (the next group's, loaded with it) up to the next multiple of 16 (the
// last 16-deep slice the products read) are zeroed in both operands, by both
// consumer warpgroups, before the products read them.
__device__ void zeroTail(Stage& st, int validRows) {
  const int rowsLeft = (validRows + 15) / 16 * 16 - validRows, perChunk = rowsLeft * 8;  // 16-byte units
  const int chunks = (kTileM + kTileN) / 64, consumer = threadIdx.x - 128;
  for (int i = consumer; i < chunks * perChunk; i += 256) {
    const int chunk = i / perChunk, unit = i % perChunk;
    __nv_bfloat16* base = chunk < kTileM / 64 ? st.a + chunk * 64 * 64 : st.b + (chunk - kTileM / 64) * 64 * 64;
    reinterpret_cast<uint4*>(base + validRows * 64)[unit] = make_uint4(0, 0, 0, 0);
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("bar.sync 1, 256;" ::: "memory");
}

__device__ __forceinline__ void warpgroupSync(int group) {
  asm volatile("bar.sync %0, 128;" ::"r"(2 + group) : "memory");
}

// This warpgroup's 64 x 256 accumulators, rounded to bf16, to the output: into
// its staging boxes, then stored by the copy engine (asynchronously: the next
// tile's products run meanwhile) where the box's rows are all the tile's, or
// copied row by row where they end inside it. Rows at or past rowEnd and
// columns at or past n are not written.
__device__ void storeTile(const float (&d)[128], Staging& staging, const CUtensorMap* mapOut, __nv_bfloat16* out,
                          const Params& p, const Tile& tile, int group, bool weights) {
  const int thread = threadIdx.x % 128, lane = threadIdx.x % 32, warp = thread / 32;
  if (thread == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
  warpgroupSync(group);
  auto* bytes = reinterpret_cast<uint8_t*>(staging.out);
#pragma unroll
  for (int j = 0; j < 32; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp * 16 + lane / 4 + 8 * h;
      const __nv_bfloat162 pair = __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
      *reinterpret_cast<__nv_bfloat162*>(bytes + (j / 8) * kChunkBytes + swizzled(row, j % 8) + (lane % 4) * 4) = pair;
    }
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  warpgroupSync(group);
  const int64_t row0 = tile.row0 + group * 64;
  if (weights || row0 + 64 <= tile.rowEnd) {
    if (thread == 0) {
      for (int c = 0; c < kTileN / 64 && tile.col0 + 64 * c < p.n; ++c) {
        storeBox(mapOut, bytes + c * kChunkBytes, tile.col0 + 64 * c, row0, tile.group, weights);
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
    return;
  }
  const int rows = static_cast<int>(tile.rowEnd - row0);
  for (int i = thread; i < rows * (kTileN / 8); i += 128) {
    const int row = i / (kTileN / 8), unit = i % (kTileN / 8);
    const int64_t col = tile.col0 + unit * 8;
    if (col >= p.n) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(bytes + (unit / 8) * kChunkBytes + swizzled(row, unit % 8));
    *reinterpret_cast<uint4*>(out + (row0 + row) * p.n + col) = v;
  }
}

// One stage's products into d: all four 16-deep slices, or in Wgrad's last
// step of a group whose rows end inside it, the slices that hold its rows
// (the rest of the last one zeroed). The partial path runs once a tile, so the
// warpgroup.arrive ptxas adds to its switch (C7519) stays out of the loop.
template <GroupedProduct kProduct>
__device__ __forceinline__ void stageProducts(float (&d)[128], Stage& st, int group, const Tile& tile, int step) {
  constexpr bool kMnA = kProduct == GroupedProduct::Wgrad, kMnB = kProduct != GroupedProduct::Forward;
  const uint64_t descA = descriptor(st.a + group * 64 * 64, kMnA), descB = descriptor(st.b, kMnB);
  const int rem =
      kProduct == GroupedProduct::Wgrad && step == tile.kSteps - 1 ? static_cast<int>(tile.reduceRows % kTileK) : 0;
  if (rem == 0) {
    mmaFence();
    mmaSlices<kMnA, kMnB, kTileK / 16>(d, descA, descB, step > 0);
    mmaCommit();
    return;
  }
  zeroTail(st, rem);
  mmaFence();
  switch ((rem + 15) / 16) {
    case 1:
      mmaSlices<kMnA, kMnB, 1>(d, descA, descB, step > 0);
      break;
    case 2:
      mmaSlices<kMnA, kMnB, 2>(d, descA, descB, step > 0);
      break;
    case 3:
      mmaSlices<kMnA, kMnB, 3>(d, descA, descB, step > 0);
      break;
    default:
      mmaSlices<kMnA, kMnB, 4>(d, descA, descB, step > 0);
      break;
  }
  mmaCommit();
}

template <GroupedProduct kProduct>
__device__ void consume(SharedStorage& s, const Params& p, const CUtensorMap* mapOut) {
  const int group = threadIdx.x / 128 - 1, lane = threadIdx.x % 32;
  int stage = 0;
  uint32_t phase = 0;
  float d[128];
  Tile tile;
  for (int64_t t = blockIdx.x; nextTile<kProduct>(s, p, t, tile); t += gridDim.x) {
    int previous = -1;
    // A row-grouped tile whose rows end in its first half: the second
    // warpgroup's rows are all past the end, so it only frees each stage and
    // stores nothing.
    const bool idle = kProduct != GroupedProduct::Wgrad && tile.row0 + group * 64 >= tile.rowEnd;
    for (int step = 0; step < tile.kSteps; ++step) {
      Stage& st = s.stages[stage];
      barrierWait(&s.full[stage], phase);
      if (idle) {
        if (lane == 0) barrierArrive(&s.empty[stage]);
        if (++stage == kStages) stage = 0, phase ^= 1;
        continue;
      }
      stageProducts<kProduct>(d, st, group, tile, step);
      mmaWait<1>();
      if (previous >= 0 && lane == 0) barrierArrive(&s.empty[previous]);
      previous = stage;
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    mmaWait<0>();
    if (previous >= 0 && lane == 0) barrierArrive(&s.empty[previous]);
    if (tile.kSteps == 0) {
#pragma unroll
      for (int i = 0; i < 128; ++i) d[i] = 0.f;
    }
    if (!idle) storeTile(d, s.staging[group], mapOut, p.out, p, tile, group, kProduct == GroupedProduct::Wgrad);
  }
  if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

#endif  // BULKHEAD_GROUPED_GEMM_BODY

template <GroupedProduct kProduct>
__global__ void __launch_bounds__(kThreads, 1)
    groupedGemmKernel(Params p, const __grid_constant__ CUtensorMap mapA, const __grid_constant__ CUtensorMap mapB,
                      const __grid_constant__ CUtensorMap mapOut) {
#if BULKHEAD_GROUPED_GEMM_BODY
  extern __shared__ uint8_t raw[];
  auto& s = *reinterpret_cast<SharedStorage*>(raw + ((1024 - sharedAddress(raw) % 1024) % 1024));
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) barrierInit(&s.full[i], 1), barrierInit(&s.empty[i], kConsumerWarps);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  loadGroups(s, p, kProduct != GroupedProduct::Wgrad);
  __syncthreads();
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) produce<kProduct>(s, p, &mapA, &mapB);
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    consume<kProduct>(s, p, &mapOut);
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // a device pass without sm_90a's instructions: never launched (see groupedGemmApplies)
#else
  (void)p, (void)mapA, (void)mapB, (void)mapOut;
#endif
}

}  // namespace

namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encoder() {
  static EncodeTiled encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      fn = nullptr;
    }
    return reinterpret_cast<EncodeTiled>(fn);
  }();
  return encode;
}

// A bf16 tensor map over `dims` (innermost first; dims[0] contiguous) in
// 128-byte swizzled boxes of `box`, reading zeros out of bounds.
CUtensorMap tensorMap(const void* base, int rank, const uint64_t* dims, const uint32_t* box) {
  CUtensorMap map{};
  cuuint64_t sizes[3], strides[2];
  cuuint32_t boxes[3], unit[3] = {1, 1, 1};
  uint64_t stride = 2;
  for (int i = 0; i < rank; ++i) {
    sizes[i] = dims[i], boxes[i] = box[i];
    if (i > 0) strides[i - 1] = stride;
    stride *= dims[i];
  }
  const CUresult status = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base), sizes,
                                    strides, boxes, unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (status != CUDA_SUCCESS) {
    throw Error("grouped product: cuTensorMapEncodeTiled failed with CUresult " + std::to_string(status),
                {.expected = "a contiguous bf16 tensor with 16-byte aligned rows"});
  }
  return map;
}

struct DeviceFacts {
  bool hopper = false;
  int multiprocessors = 0;
};

// The current device's facts, read once per device (a process may hold GPUs of several kinds).
DeviceFacts deviceFacts() {
  constexpr int kDevices = 64;
  static std::mutex mutex;
  static std::array<std::optional<DeviceFacts>, kDevices> known;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0) return {};
  const std::lock_guard<std::mutex> lock(mutex);
  if (device < kDevices && known[device]) return *known[device];
  int major = 0, minor = 0, count = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return {};
  }
  const DeviceFacts facts{.hopper = major == 9 && minor == 0, .multiprocessors = count};
  if (device < kDevices) known[device] = facts;
  return facts;
}

template <GroupedProduct kProduct>
void launch(const GroupedGemmArgs& args, const CUtensorMap& mapA, const CUtensorMap& mapB, void* out,
            int multiprocessors) {
  const uint64_t n = static_cast<uint64_t>(args.n),
                 outRows = static_cast<uint64_t>(kProduct == GroupedProduct::Wgrad ? args.m : args.rows);
  const uint64_t dimsOut[] = {n, outRows, static_cast<uint64_t>(args.groups)};
  const uint32_t boxOut[] = {64, 64, 1};
  const CUtensorMap mapOut = tensorMap(out, kProduct == GroupedProduct::Wgrad ? 3 : 2, dimsOut, boxOut);
  constexpr size_t shared = sizeof(SharedStorage) + 1024;
  if (cudaFuncSetAttribute(groupedGemmKernel<kProduct>, cudaFuncAttributeMaxDynamicSharedMemorySize, shared) !=
      cudaSuccess) {
    bulkhead::cuda::checkLaunch("setting the grouped product kernel's shared memory");
  }
  int64_t tiles = ceilDiv(args.n, kTileN);
  tiles *= kProduct == GroupedProduct::Wgrad ? ceilDiv(args.m, kTileM) * args.groups
                                             : ceilDiv(args.rows, kTileM) + args.groups + 1;
  const int blocks = static_cast<int>(std::min<int64_t>(multiprocessors, tiles));
  const Params p{.out = static_cast<__nv_bfloat16*>(out),
                 .ends = args.ends,
                 .groups = args.groups,
                 .rows = args.rows,
                 .m = args.m,
                 .n = args.n,
                 .k = args.k};
  groupedGemmKernel<kProduct>
      <<<blocks, kThreads, shared, static_cast<cudaStream_t>(args.stream)>>>(p, mapA, mapB, mapOut);
  bulkhead::cuda::checkLaunch("the grouped product kernel");
}

}  // namespace

bool groupedGemmApplies(const GroupedGemmArgs& args) {
  const DeviceFacts facts = deviceFacts();
  const bool wgrad = args.product == GroupedProduct::Wgrad;
  auto fits = [](int64_t d) { return d >= 64 && d % 8 == 0 && d < (int64_t{1} << 31); };
  return facts.hopper && encoder() != nullptr && args.groups >= 1 && args.groups <= kMaxProductGroups &&
         args.rows >= 1 && args.rows < (int64_t{1} << 31) && fits(args.n) && (wgrad ? fits(args.m) : fits(args.k));
}

void groupedGemm(const GroupedGemmArgs& args, const void* a, const void* b, void* out) {
  if (!groupedGemmApplies(args)) {
    throw ConfigError("grouped product: these shapes or this device are not served by the Hopper kernels",
                      {.expected = "a Hopper GPU, bf16, dimensions multiples of 8 and at least 64, 1 to " +
                                   std::to_string(kMaxProductGroups) + " groups (check groupedGemmApplies first)"});
  }
  const DeviceFacts facts = deviceFacts();
  const auto rows = static_cast<uint64_t>(args.rows), n = static_cast<uint64_t>(args.n),
             k = static_cast<uint64_t>(args.k), m = static_cast<uint64_t>(args.m),
             g = static_cast<uint64_t>(args.groups);
  switch (args.product) {
    case GroupedProduct::Forward: {
      const uint64_t dimsA[] = {k, rows}, dimsB[] = {k, n, g};
      const uint32_t boxA[] = {64, kTileM}, boxB[] = {64, kTileN, 1};
      launch<GroupedProduct::Forward>(args, tensorMap(a, 2, dimsA, boxA), tensorMap(b, 3, dimsB, boxB), out,
                                      facts.multiprocessors);
      break;
    }
    case GroupedProduct::Dgrad: {
      const uint64_t dimsA[] = {k, rows}, dimsB[] = {n, k, g};
      const uint32_t boxA[] = {64, kTileM}, boxB[] = {64, 64, 1};
      launch<GroupedProduct::Dgrad>(args, tensorMap(a, 2, dimsA, boxA), tensorMap(b, 3, dimsB, boxB), out,
                                    facts.multiprocessors);
      break;
    }
    case GroupedProduct::Wgrad: {
      const uint64_t dimsA[] = {m, rows}, dimsB[] = {n, rows};
      const uint32_t box[] = {64, 64};
      launch<GroupedProduct::Wgrad>(args, tensorMap(a, 2, dimsA, box), tensorMap(b, 2, dimsB, box), out,
                                    facts.multiprocessors);
      break;
    }
  }
}

}  // namespace bulkhead::moe::cuda
