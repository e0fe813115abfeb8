#include "optim/cuda/adamw_kernels.h"

#include <cmath>
#include <cstdint>

#include "runtime/cuda/elements.cuh"

namespace bulkhead::optim::cuda {
namespace {

using ::bulkhead::cuda::checkLaunch;
using ::bulkhead::cuda::load;
using ::bulkhead::cuda::store;

constexpr int kThreads = 512;
constexpr int64_t kBlockElements = int64_t{kThreads} * 16;  // each block takes a chunk of one piece

struct Chunks {
  int64_t firstBlock[kMaxPieces + 1] = {};  // piece p's chunks are blocks [firstBlock[p], firstBlock[p + 1])
};

struct Hyper {
  float lr, beta1, beta2, eps, decay;
};

template <typename G, typename P, typename M>
__global__ void __launch_bounds__(kThreads) adamwKernel(AdamWPiecePointers pieces, Chunks chunks, Hyper h,
                                                        const float* step, const float* unscale, const float* skip) {
  if (skip != nullptr && *skip != 0.f) return;
  int p = 0;
  while (p + 1 < pieces.pieces && chunks.firstBlock[p + 1] <= static_cast<int64_t>(blockIdx.x)) ++p;
  const int64_t begin = (static_cast<int64_t>(blockIdx.x) - chunks.firstBlock[p]) * kBlockElements;
  const int64_t end = min(begin + kBlockElements, pieces.numel[p]);
  const float t = *step, inverse = unscale != nullptr ? 1.f / *unscale : 1.f;
  const float stepSize = h.lr / (1.f - powf(h.beta1, t));
  const float correction2Sqrt = sqrtf(1.f - powf(h.beta2, t));
  float* master = pieces.master[p];
  const G* grad = static_cast<const G*>(pieces.grad[p]);
  M* m = static_cast<M*>(pieces.expAvg[p]);
  M* v = static_cast<M*>(pieces.expAvgSq[p]);
  P* param = static_cast<P*>(pieces.param[p]);
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const float g = load(grad + i) * inverse;
    float w = master[i] * (1.f - h.lr * h.decay);
    const float mOld = load(m + i);
    const float mi = mOld + (1.f - h.beta1) * (g - mOld);
    const float vi = h.beta2 * load(v + i) + (1.f - h.beta2) * g * g;
    w -= stepSize * mi / (sqrtf(vi) / correction2Sqrt + h.eps);
    master[i] = w;
    store(m + i, mi);
    store(v + i, vi);
    if (param != nullptr) store(param + i, w);
  }
}

template <typename G, typename P, typename M>
void launch(const AdamWArgs& a, const AdamWPiecePointers& pieces) {
  Chunks chunks;
  for (int p = 0; p < pieces.pieces; ++p)
    chunks.firstBlock[p + 1] = chunks.firstBlock[p] + (pieces.numel[p] + kBlockElements - 1) / kBlockElements;
  const int64_t blocks = chunks.firstBlock[pieces.pieces];
  if (blocks == 0) return;
  const Hyper h{static_cast<float>(a.lr), static_cast<float>(a.beta1), static_cast<float>(a.beta2),
                static_cast<float>(a.eps), static_cast<float>(a.decay)};
  adamwKernel<G, P, M><<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(a.stream)>>>(
      pieces, chunks, h, a.step, a.unscale, a.skip);
  checkLaunch("the AdamW kernel");
}

template <typename G, typename M>
void withParam(const AdamWArgs& a, const AdamWPiecePointers& pieces) {
  if (a.paramType == HalfType::BFloat16) return launch<G, __nv_bfloat16, M>(a, pieces);
  if (a.paramType == HalfType::Float16) return launch<G, __half, M>(a, pieces);
  launch<G, float, M>(a, pieces);  // no parameter written
}

template <typename G>
void withMoments(const AdamWArgs& a, const AdamWPiecePointers& pieces) {
  if (a.momentType == HalfType::BFloat16) return withParam<G, __nv_bfloat16>(a, pieces);
  withParam<G, float>(a, pieces);
}

}  // namespace

void adamw(const AdamWArgs& args, const AdamWPiecePointers& pieces) {
  if (args.gradType == HalfType::BFloat16) return withMoments<__nv_bfloat16>(args, pieces);
  if (args.gradType == HalfType::Float16) return withMoments<__half>(args, pieces);
  withMoments<float>(args, pieces);
}

}  // namespace bulkhead::optim::cuda
