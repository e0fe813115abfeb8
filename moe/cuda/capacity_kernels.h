#pragma once
// CUDA kernels behind moe::capacityPosition (moe/router.h) for float32 weights,
// on raw pointers so this header needs no libtorch. Launched on `stream`; they
// never synchronize, so a CUDA graph can capture them.
//
// Each slot's place among its expert's slots ranked by weight (descending, ties
// by slot order), in one of two ways:
// - up to kRankSlots slots and kRankExperts experts: one block per expert
//   gathers its slots into shared memory and each counts those ranked before it
//   (one launch; quadratic in an expert's slots, a few hundred here);
// - otherwise: one stable radix sort of 64-bit keys (expert above the weight's
//   bits, flipped so that larger weights come first) over only the bits that the
//   expert count leaves in use, and one pass that turns each sorted slot's
//   distance from its expert's first into its position.

#include <cstddef>
#include <cstdint>

namespace bulkhead::moe::cuda {

struct CapacityArgs {
  int64_t slots = 0;
  int64_t experts = 0;                // every index in [0, experts)
  const int64_t* indices = nullptr;   // [slots]
  const float* weights = nullptr;     // [slots]
  int64_t* position = nullptr;        // [slots], written
  void* scratch = nullptr;            // capacityScratchBytes(slots, experts) bytes of device memory
  void* stream = nullptr;             // cudaStream_t
};

// The most slots the kernels take (their sort's values are int32), and the most
// slots and experts they rank per expert (4,096 tokens of top-8 over 64 experts: a
// few hundred slots an expert), where the sort's passes would wait on their own latency.
constexpr int64_t kMaxCapacitySlots = int64_t{1} << 31;
constexpr int64_t kRankSlots = 32768;
constexpr int64_t kRankExperts = 1024;
size_t capacityScratchBytes(int64_t slots, int64_t experts);
void capacityPositions(const CapacityArgs& args);

}  // namespace bulkhead::moe::cuda
