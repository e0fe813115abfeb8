#include "checkpoint/box.h"

#include <algorithm>
#include <cstring>

namespace bulkhead::checkpoint {

void Box::merge() {
  for (size_t d = length.size(); d-- > 1;) {
    if (sourceStrides[d - 1] == sourceStrides[d] * length[d] && targetStrides[d - 1] == targetStrides[d] * length[d]) {
      length[d - 1] *= length[d];
      sourceStrides[d - 1] = sourceStrides[d];
      targetStrides[d - 1] = targetStrides[d];
      length.erase(length.begin() + d);
      sourceStrides.erase(sourceStrides.begin() + d);
      targetStrides.erase(targetStrides.begin() + d);
    }
  }
}

bool Box::singleRun() const {
  for (size_t d = 0; d + 1 < length.size(); ++d)
    if (length[d] != 1) return false;
  return sourceStrides.back() == 1 && targetStrides.back() == 1;
}

int64_t Box::elements() const {
  int64_t n = 1;
  for (int64_t l : length) n *= l;
  return n;
}

void copyBox(const uint8_t* source, uint8_t* target, const Box& box, int64_t elementSize) {
  source += box.source * elementSize;
  target += box.target * elementSize;
  size_t inner = box.length.size() - 1;
  bool runs = box.sourceStrides[inner] == 1 && box.targetStrides[inner] == 1;
  std::vector<int64_t> at(box.length.size(), 0);
  for (;;) {
    int64_t s = 0, t = 0;
    for (size_t d = 0; d < inner; ++d) {
      s += at[d] * box.sourceStrides[d];
      t += at[d] * box.targetStrides[d];
    }
    if (runs) {
      std::memcpy(target + t * elementSize, source + s * elementSize, box.length[inner] * elementSize);
    } else {
      for (int64_t i = 0; i < box.length[inner]; ++i)
        std::memcpy(target + (t + i * box.targetStrides[inner]) * elementSize,
                    source + (s + i * box.sourceStrides[inner]) * elementSize, elementSize);
    }
    size_t d = inner;
    while (d > 0 && ++at[d - 1] == box.length[d - 1]) at[--d] = 0;
    if (d == 0) return;
  }
}

std::vector<int64_t> contiguousStrides(const std::vector<int64_t>& dims) {
  std::vector<int64_t> strides(dims.size(), 1);
  for (size_t d = dims.size(); d-- > 1;) strides[d - 1] = strides[d] * dims[d];
  return strides;
}

Box boxOf(const ChunkPlan& plan, int64_t chunk, const SliceRecord& slice, const Region& region) {
  std::vector<int64_t> chunkLo = plan.offsets(chunk);
  std::vector<int64_t> chunkDims = plan.chunk;
  chunkDims[plan.split] = std::min(chunkDims[plan.split], plan.dims[plan.split] - chunkLo[plan.split]);
  std::vector<int64_t> sliceOffsets = slice.offsets.empty() ? std::vector<int64_t>{0} : slice.offsets;
  size_t dims = chunkDims.size();
  Box box;
  box.length.resize(dims);
  box.sourceStrides = contiguousStrides(chunkDims);
  box.targetStrides = region.strides;
  for (size_t d = 0; d < dims; ++d) {
    int64_t lo = std::max(chunkLo[d] + sliceOffsets[d], region.offsets[d]);
    int64_t hi = std::min(chunkLo[d] + chunkDims[d] + sliceOffsets[d], region.offsets[d] + region.shape[d]);
    box.length[d] = hi - lo;
    box.source += (lo - sliceOffsets[d] - chunkLo[d]) * box.sourceStrides[d];
    box.target += (lo - region.offsets[d]) * box.targetStrides[d];
  }
  box.merge();
  return box;
}

}  // namespace bulkhead::checkpoint
