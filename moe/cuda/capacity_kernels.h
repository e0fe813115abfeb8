#pragma once
// CUDA kernels behind moe::capacityPosition (moe/router.h) for float32 weights,
// on raw pointers so this header needs no libtorch. Launched on `stream`; they
// never synchronize, so a CUDA graph can capture them.
//
// Each slot's place among its expert's slots ranked by weight (descending, ties
// by slot order), in one of two ways:
// - small batches (up to kRankSlots slots and kRankExperts experts, at most
//   kRankMeanSlots slots an expert on average, and an expert's bound of slots
//   within one block's shared memory): one block per expert gathers its slots
//   into shared memory and each counts those ranked before it (one launch; a
//   block's work grows with the square of its expert's slots);
// - otherwise: one stable radix sort of 64-bit keys (expert above the weight's
//   bits, flipped so that larger weights come first) over only the bits that the
//   expert count leaves in use, and one pass that turns each sorted slot's
//   distance from its expert's first into its position.
// An index outside [0, experts) leaves positions unspecified (not an error).

#include <cstddef>
#include <cstdint>

namespace bulkhead::moe::cuda {

struct CapacityArgs {
  int64_t slots = 0;
  int64_t experts = 0;               // every index in [0, experts)
  const int64_t* indices = nullptr;  // [slots]
  const float* weights = nullptr;    // [slots]
  int64_t* position = nullptr;       // [slots], written
  // At most this many slots at one expert (0: slots), such as the tokens where
  // each token's slots name different experts (top-k). Broken, the ranks stay
  // right and take longer.
  int64_t expertBound = 0;
  void* scratch = nullptr;  // capacityScratchBytes(args) bytes of device memory
  void* stream = nullptr;   // cudaStream_t
};

// The slots the kernels take (fewer than 2^31: their sort's values are int32),
// and the batches they rank per expert: up to 4,096 tokens of top-8, a few
// hundred slots an expert, where the sort's passes would wait on their own latency.
constexpr int64_t kMaxCapacitySlots = (int64_t{1} << 31) - 1;
constexpr int64_t kRankSlots = 32768;
constexpr int64_t kRankExperts = 1024;
constexpr int64_t kRankMeanSlots = 1024;
size_t capacityScratchBytes(const CapacityArgs& args);
void capacityPositions(const CapacityArgs& args);

}  // namespace bulkhead::moe::cuda
