#pragma once
// CUDA kernels behind moe::capacityPosition (moe/router.h) for float32 weights,
// on raw pointers so this header needs no libtorch. Launched on `stream`; they
// never synchronize, so a CUDA graph can capture them.
//
// Each slot's place among its expert's slots ranked by weight (descending, ties
// by slot order): one stable radix sort of 64-bit keys (expert above the
// weight's bits, flipped so that larger weights come first) over only the bits
// that the expert count leaves in use, and one pass that turns each sorted
// slot's distance from its expert's first into its position. An index outside
// [0, experts) leaves positions unspecified (not an error).

#include <cstddef>
#include <cstdint>

namespace bulkhead::moe::cuda {

struct CapacityArgs {
  int64_t slots = 0;
  int64_t experts = 0;               // every index in [0, experts)
  const int64_t* indices = nullptr;  // [slots]
  const float* weights = nullptr;    // [slots]
  int64_t* position = nullptr;       // [slots], written
  void* scratch = nullptr;           // capacityScratchBytes(slots, experts) bytes of device memory
  void* stream = nullptr;            // cudaStream_t
};

// The most slots the kernels take (their sort's values are int32).
constexpr int64_t kMaxCapacitySlots = (int64_t{1} << 31) - 1;
size_t capacityScratchBytes(int64_t slots, int64_t experts);
void capacityPositions(const CapacityArgs& args);

}  // namespace bulkhead::moe::cuda
