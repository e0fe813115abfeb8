#pragma once
// The CUDA kernel behind fused::adamw (optim/fused_update.h) for float32
// masters, with float32 or bfloat16 moments, float32 or half-precision
// gradients read as they are and, where given, half-precision parameters
// written in the same pass; on
// raw pointers so this header and its .cu need no libtorch. One launch updates
// up to kMaxPieces pieces; it is queued on `stream` and never synchronizes.
// Per element, in float32 (AdamW as adamwUpdate has it, PyTorch's fused order):
//   g      = grad / unscale                       (unscale: 1 where null)
//   master = master * (1 - lr * decay)
//   m      = m + (1 - beta1) * (g - m)
//   v      = beta2 * v + (1 - beta2) * g * g
//   master = master - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
//   param  = master rounded to the parameter's dtype      (where param is set)
// (m and v read into float32 and rounded to their dtype once, when stored)
// and nothing is written where *skip is nonzero.

#include <cstdint>

namespace bulkhead::optim::cuda {

enum class HalfType { BFloat16, Float16, None };

constexpr int kMaxPieces = 24;

struct AdamWPiecePointers {
  float* master[kMaxPieces] = {};
  const void* grad[kMaxPieces] = {};  // float32, or gradType
  void* expAvg[kMaxPieces] = {};      // float32, or momentType
  void* expAvgSq[kMaxPieces] = {};    // float32, or momentType
  void* param[kMaxPieces] = {};       // paramType, or null: no parameter written
  int64_t numel[kMaxPieces] = {};
  int pieces = 0;
};

struct AdamWArgs {
  HalfType gradType = HalfType::None;    // None: float32 gradients
  HalfType paramType = HalfType::None;   // the dtype of every non-null param
  HalfType momentType = HalfType::None;  // None: float32 moments; BFloat16
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, decay = 0;
  const float* step = nullptr;     // the step count, this update counted
  const float* unscale = nullptr;  // or null
  const float* skip = nullptr;     // or null
  void* stream = nullptr;          // cudaStream_t
};

void adamw(const AdamWArgs& args, const AdamWPiecePointers& pieces);

}  // namespace bulkhead::optim::cuda
