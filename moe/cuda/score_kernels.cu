#include "moe/cuda/score_kernels.h"

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

#include "moe/cuda/elements.cuh"

namespace bulkhead::moe::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int64_t kMaxWarps = 1024;  // more tokens: each warp takes several
constexpr unsigned kAllLanes = 0xffffffffu;

struct Grid {
  unsigned blocks = 0;
  int64_t tokensPerWarp = 0;
};

Grid gridFor(int64_t tokens) {
  const int64_t warps = tokens < kMaxWarps ? tokens : kMaxWarps;
  Grid grid;
  grid.blocks = static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
  const int64_t launched = int64_t{grid.blocks} * kWarpsPerBlock;
  grid.tokensPerWarp = launched == 0 ? 0 : (tokens + launched - 1) / launched;
  return grid;
}

template <typename T>
__device__ T warpSum(T value) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(kAllLanes, value, offset);
  return value;
}

template <typename T>
__device__ T warpMax(T value) {
  for (int offset = 16; offset > 0; offset >>= 1) value = fmax(value, __shfl_xor_sync(kAllLanes, value, offset));
  return value;
}

// The selection noise of moe/router_noise.cc, the same bits in scalar form:
// a 32-bit mixer, the token's hash from its key and the seed, then two
// uniform draws per expert turned into a normal one (Box-Muller, in double).
__device__ uint32_t mix32(uint32_t x) {
  x = (x ^ (x >> 16)) * 0x45d9f3bu;
  x = (x ^ (x >> 16)) * 0x45d9f3bu;
  return x ^ (x >> 16);
}

__device__ uint32_t noiseTokenHash(int64_t key, uint64_t seed) {
  const auto bits = static_cast<uint64_t>(key);
  uint32_t h = mix32(static_cast<uint32_t>(bits) + static_cast<uint32_t>(seed));
  h = mix32(h ^ static_cast<uint32_t>(bits >> 32));
  return mix32(h ^ static_cast<uint32_t>(seed >> 32));
}

__device__ double noiseDraw(uint32_t tokenHash, int64_t expert, double std) {
  const uint32_t first = mix32(tokenHash + static_cast<uint32_t>(static_cast<uint64_t>(2 * expert + 1) * 0x9E3779B1u));
  const uint32_t second = mix32(first ^ 0x85EBCA6Bu);
  const double u1 = (static_cast<double>(first) + 0.5) / 4294967296.0;
  const double u2 = (static_cast<double>(second) + 0.5) / 4294967296.0;
  return std * sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);
}

// One token's logits and scores, expert i * 32 + lane in slot i of each lane.
template <typename T, int kPerLane>
struct TokenScores {
  T logit[kPerLane], score[kPerLane];
  T top = 0, expSum = 0, scoreSum = 0;

  __device__ TokenScores(const ScoreArgs& a, int64_t t, int lane) {
    const T* row = static_cast<const T*>(a.logits) + t * a.experts;
    T most = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t e = i * 32 + lane;
      logit[i] = e < a.experts ? row[e] : -INFINITY;
      most = fmax(most, logit[i]);
    }
    top = warpMax(most);
    T sum = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (i * 32 + lane < a.experts) sum += exp(logit[i] - top);
    expSum = warpSum(sum);
    T scores = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const bool here = i * 32 + lane < a.experts;
      score[i] = !here ? T(0) : a.sigmoid ? T(1) / (T(1) + exp(-logit[i])) : exp(logit[i] - top) / expSum;
      scores += score[i];
    }
    scoreSum = warpSum(scores);
  }
  __device__ T lse() const { return top + log(expSum); }
  __device__ T softmax(int i) const { return exp(logit[i] - top) / expSum; }
};

template <typename T, int kPerLane>
__global__ void scoreForwardKernel(ScoreArgs a, const float* bias, ScoreOutputs out, int64_t tokensPerWarp) {
  extern __shared__ unsigned int blockCounts[];
  for (int64_t e = threadIdx.x; e < a.experts; e += blockDim.x) blockCounts[e] = 0;
  __syncthreads();
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t first = warp * tokensPerWarp,
                last = first + tokensPerWarp < a.tokens ? first + tokensPerWarp : a.tokens;
  T probSum[kPerLane] = {};
  T lseSquared = 0;
  for (int64_t t = first; t < last; ++t) {
    const TokenScores<T, kPerLane> token(a, t, lane);
    const T lse = token.lse();
    lseSquared += lse * lse;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) probSum[i] += a.sigmoid ? token.score[i] / token.scoreSum : token.score[i];

    // What the top-k ranks: score + bias + noise, NaN counted as +inf.
    T selection[kPerLane];
    const uint32_t tokenHash = a.noiseKeys != nullptr ? noiseTokenHash(a.noiseKeys[t], a.noiseSeed) : 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t e = i * 32 + lane;
      if (e >= a.experts) continue;
      T value = token.score[i] + (bias != nullptr ? static_cast<T>(bias[e]) : T(0));
      if (a.noiseKeys != nullptr) value += static_cast<T>(noiseDraw(tokenHash, e, a.noiseStd));
      selection[i] = isnan(value) ? T(INFINITY) : value;
    }
    unsigned taken = 0;  // bit i: expert i * 32 + lane is selected
    int64_t myExpert = 0;
    T myWeight = 0, selectedSum = 0;
    for (int j = 0; j < a.topK; ++j) {
      T best = 0;
      int64_t bestExpert = -1;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int64_t e = i * 32 + lane;
        if (e >= a.experts || ((taken >> i) & 1u)) continue;
        if (bestExpert < 0 || selection[i] > best) best = selection[i], bestExpert = e;  // ties keep the lower e
      }
      for (int offset = 16; offset > 0; offset >>= 1) {
        const T value = __shfl_xor_sync(kAllLanes, best, offset);
        const int64_t expert = __shfl_xor_sync(kAllLanes, bestExpert, offset);
        if (expert >= 0 && (bestExpert < 0 || value > best || (value == best && expert < bestExpert)))
          best = value, bestExpert = expert;
      }
      T picked = 0;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (i * 32 + lane == bestExpert) picked = token.score[i], taken |= 1u << i;
      picked = __shfl_sync(kAllLanes, picked, static_cast<int>(bestExpert % 32));
      if (lane == j) myExpert = bestExpert, myWeight = picked;
      selectedSum += picked;
      if (lane == 0) atomicAdd(blockCounts + bestExpert, 1u);
    }
    if (lane < a.topK) {
      out.indices[t * a.topK + lane] = myExpert;
      static_cast<T*>(out.weights)[t * a.topK + lane] = a.normalize ? myWeight / selectedSum : myWeight;
      if (out.keep != nullptr) out.keep[t * a.topK + lane] = true;
    }
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i)
    if (i * 32 + lane < a.experts) static_cast<T*>(out.probPartial)[warp * a.experts + i * 32 + lane] = probSum[i];
  if (lane == 0) static_cast<T*>(out.lsePartial)[warp] = lseSquared;
  __syncthreads();
  for (int64_t e = threadIdx.x; e < a.experts; e += blockDim.x)
    if (blockCounts[e] != 0) atomicAdd(reinterpret_cast<unsigned long long*>(out.counts + e), blockCounts[e]);
}

// The column sums of the forward's partial rows, one block per column, each
// in a fixed order: block e < experts sums probPartial[:, e], the last block
// lsePartial.
constexpr int kSumThreads = 256;

template <typename T>
__global__ void sumPartialsKernel(const T* probPartial, const T* lsePartial, int64_t rows, int64_t experts, T* probSum,
                                  T* lseSquaredSum) {
  __shared__ T partial[kSumThreads];
  const int64_t column = blockIdx.x;
  T sum = 0;
  for (int64_t r = threadIdx.x; r < rows; r += kSumThreads)
    sum += column < experts ? probPartial[r * experts + column] : lsePartial[r];
  partial[threadIdx.x] = sum;
  __syncthreads();
  for (int half = kSumThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) *(column < experts ? probSum + column : lseSquaredSum) = partial[0];
}

template <typename T, int kPerLane>
__global__ void scoreBackwardKernel(ScoreArgs a, ScoreGrads g, T* gradLogits, int64_t tokensPerWarp) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int64_t first = warp * tokensPerWarp,
                last = first + tokensPerWarp < a.tokens ? first + tokensPerWarp : a.tokens;
  const T* logits = static_cast<const T*>(a.logits);
  for (int64_t t = first; t < last; ++t) {
    const TokenScores<T, kPerLane> token(a, t, lane);
    T gradScore[kPerLane] = {};
    if (g.weights != nullptr) {
      // The selected scores, recomputed the way the forward computed them.
      const int64_t expert = lane < a.topK ? g.indices[t * a.topK + lane] : 0;
      const T gradWeight = lane < a.topK ? static_cast<const T*>(g.weights)[t * a.topK + lane] : T(0);
      T selected = 0;
      if (lane < a.topK) {
        const T l = logits[t * a.experts + expert];
        selected = a.sigmoid ? T(1) / (T(1) + exp(-l)) : exp(l - token.top) / token.expSum;
      }
      T grad = gradWeight;
      if (a.normalize) {
        const T sum = warpSum(selected);
        grad = (gradWeight - warpSum(gradWeight * selected / sum)) / sum;
      }
      for (int j = 0; j < a.topK; ++j) {
        const int64_t e = __shfl_sync(kAllLanes, expert, j);
        const T value = __shfl_sync(kAllLanes, grad, j);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i)
          if (i * 32 + lane == e) gradScore[i] += value;
      }
    }
    if (g.probSum != nullptr) {
      const T* gradProb = static_cast<const T*>(g.probSum);
      T dot = 0;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (i * 32 + lane < a.experts) dot += gradProb[i * 32 + lane] * token.score[i];
      dot = a.sigmoid ? warpSum(dot) / token.scoreSum : T(0);
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (i * 32 + lane >= a.experts) continue;
        const T grad = gradProb[i * 32 + lane];
        gradScore[i] += a.sigmoid ? (grad - dot) / token.scoreSum : grad;  // through p / sum(p) for sigmoid
      }
    }
    T dot = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) dot += gradScore[i] * token.score[i];
    dot = a.sigmoid ? T(0) : warpSum(dot);
    const T gradLseSquared = g.lseSquaredSum != nullptr ? *static_cast<const T*>(g.lseSquaredSum) : T(0);
    const T lse = token.lse();
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int64_t e = i * 32 + lane;
      if (e >= a.experts) continue;
      const T p = token.score[i];
      T grad = a.sigmoid ? gradScore[i] * p * (T(1) - p) : p * (gradScore[i] - dot);
      if (g.lseSquaredSum != nullptr) grad += gradLseSquared * T(2) * lse * token.softmax(i);
      gradLogits[t * a.experts + e] = grad;
    }
  }
}

// Calls launch(std::integral_constant<int, P>{}) with P the fewest experts per
// lane, a power of two, that covers `experts`.
template <typename Launch>
void withPerLane(int64_t experts, Launch&& launch) {
  if (experts <= 32)
    launch(std::integral_constant<int, 1>{});
  else if (experts <= 64)
    launch(std::integral_constant<int, 2>{});
  else if (experts <= 128)
    launch(std::integral_constant<int, 4>{});
  else if (experts <= 256)
    launch(std::integral_constant<int, 8>{});
  else if (experts <= 512)
    launch(std::integral_constant<int, 16>{});
  else
    launch(std::integral_constant<int, 32>{});
}

void checkShape(const ScoreArgs& a) {
  if (a.experts < 1 || a.experts > kMaxScoreExperts || a.topK < 1 || a.topK > kMaxScoreTopK || a.topK > a.experts)
    throw std::runtime_error("score kernels: 1 <= top-k <= 32, top-k <= experts <= 1024");
}

}  // namespace

int64_t scorePartialRows(int64_t tokens) { return int64_t{gridFor(tokens).blocks} * kWarpsPerBlock; }

void scoreForward(const ScoreArgs& args, const float* bias, const ScoreOutputs& out) {
  checkShape(args);
  const Grid grid = gridFor(args.tokens);
  if (grid.blocks == 0) return;
  auto stream = static_cast<cudaStream_t>(args.stream);
  const size_t sharedBytes = args.experts * sizeof(unsigned int);
  withPerLane(args.experts, [&](auto perLane) {
    constexpr int kPerLane = decltype(perLane)::value;
    if (args.doubles)
      scoreForwardKernel<double, kPerLane>
          <<<grid.blocks, kWarpsPerBlock * 32, sharedBytes, stream>>>(args, bias, out, grid.tokensPerWarp);
    else
      scoreForwardKernel<float, kPerLane>
          <<<grid.blocks, kWarpsPerBlock * 32, sharedBytes, stream>>>(args, bias, out, grid.tokensPerWarp);
  });
  checkLaunch("router score kernel launch");
  const int64_t rows = int64_t{grid.blocks} * kWarpsPerBlock;
  const auto columns = static_cast<unsigned>(args.experts + 1);
  if (args.doubles)
    sumPartialsKernel<double><<<columns, kSumThreads, 0, stream>>>(
        static_cast<const double*>(out.probPartial), static_cast<const double*>(out.lsePartial), rows, args.experts,
        static_cast<double*>(out.probSum), static_cast<double*>(out.lseSquaredSum));
  else
    sumPartialsKernel<float><<<columns, kSumThreads, 0, stream>>>(
        static_cast<const float*>(out.probPartial), static_cast<const float*>(out.lsePartial), rows, args.experts,
        static_cast<float*>(out.probSum), static_cast<float*>(out.lseSquaredSum));
  checkLaunch("router score sum kernel launch");
}

void scoreBackward(const ScoreArgs& args, const ScoreGrads& grads, void* gradLogits) {
  checkShape(args);
  const Grid grid = gridFor(args.tokens);
  if (grid.blocks == 0) return;
  auto stream = static_cast<cudaStream_t>(args.stream);
  withPerLane(args.experts, [&](auto perLane) {
    constexpr int kPerLane = decltype(perLane)::value;
    if (args.doubles)
      scoreBackwardKernel<double, kPerLane><<<grid.blocks, kWarpsPerBlock * 32, 0, stream>>>(
          args, grads, static_cast<double*>(gradLogits), grid.tokensPerWarp);
    else
      scoreBackwardKernel<float, kPerLane><<<grid.blocks, kWarpsPerBlock * 32, 0, stream>>>(
          args, grads, static_cast<float*>(gradLogits), grid.tokensPerWarp);
  });
  checkLaunch("router score backward kernel launch");
}

}  // namespace bulkhead::moe::cuda
