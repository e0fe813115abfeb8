#pragma once
// How a slice is cut into HDF5 chunks. Every chunk is one contiguous run of
// the slice in row-major order: chunk dims are 1 before a `split` dimension, a
// run along it, and the full extent after it. So staging copies each chunk
// from the tensor with one memcpy (or one cudaMemcpyAsync), and a chunk is
// written and read whole with its checksum (H5Dwrite_chunk / H5Dread_chunk).
// Chunks along `split` are as even as possible (the last one pads at most a
// few rows), near a target size; a scalar is stored as shape [1].

#include <cstdint>
#include <functional>
#include <vector>

namespace bulkhead::checkpoint {

struct ChunkPlan {
  std::vector<int64_t> dims;   // the dataset's shape
  std::vector<int64_t> chunk;  // the chunk shape; empty when the slice has no elements
  int split = 0;
  int64_t elementSize = 1;
  int64_t inner = 1;     // elements of one step along `split`
  int64_t perSplit = 0;  // chunks along `split`
  int64_t count = 0;     // chunks in all; 0 for an empty slice (stored contiguous, without data)

  // A plan for `shape` (the slice's shape; [] for a scalar) near `targetBytes` per chunk.
  static ChunkPlan make(const std::vector<int64_t>& shape, int64_t elementSize, int64_t targetBytes);
  // The plan of a dataset read from a file; false when `chunk` is not of the
  // form above (a dataset Bulkhead did not write).
  static bool fromFile(const std::vector<int64_t>& dims, const std::vector<int64_t>& chunk, int64_t elementSize,
                       ChunkPlan& plan);

  int64_t chunkElements() const;
  int64_t chunkBytes() const { return chunkElements() * elementSize; }
  // Bytes a chunk takes in a staging buffer: the chunk, its 4-byte checksum,
  // padding to 64 bytes.
  int64_t stagedBytes() const { return (chunkBytes() + 4 + 63) / 64 * 64; }
  // Chunk i: its first element in row-major order, its valid elements (fewer
  // than chunkElements() for the last along `split`), its HDF5 offsets.
  int64_t firstElement(int64_t i) const;
  int64_t validElements(int64_t i) const;
  std::vector<int64_t> offsets(int64_t i) const;
  // Calls `visit(i)` for every chunk that overlaps the box [lo, hi), in order.
  void forEachOverlapping(const std::vector<int64_t>& lo, const std::vector<int64_t>& hi,
                          const std::function<void(int64_t)>& visit) const;
};

}  // namespace bulkhead::checkpoint
