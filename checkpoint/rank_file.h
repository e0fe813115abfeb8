#pragma once
// One rank's file of a checkpoint: `rank_00003.h5` in the step folder.
// Root attributes: format, job (the saving job's nonce), step, rank,
// world_size. One dataset per slice (chunked, Fletcher-32 per chunk) with
// attributes key, dtype, global_shape, offsets, so h5py and h5dump users see
// what each slice is without the manifest.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/chunking.h"
#include "checkpoint/fault.h"

namespace bulkhead::checkpoint {

constexpr const char* kFormat = "bulkhead-checkpoint 1";

std::string rankFileName(int rank);  // rank_00003.h5

// A slice staged in host memory, ready to be written.
struct StagedSlice {
  std::string key;
  c10::ScalarType dtype = c10::ScalarType::Float;
  std::vector<int64_t> globalShape, offsets, shape;
  std::string dataset;  // its name in the file, unique there
  ChunkPlan plan;
  // plan.count chunks, chunk i at staged + i * plan.stagedBytes(), each
  // followed by 4 bytes for its checksum; a short last chunk zero-padded.
  uint8_t* staged = nullptr;
  uint64_t digest = 0;  // set by writeRankFile
};

struct RankFileHeader {
  std::string job;
  int64_t step = 0;
  int rank = 0;
  int worldSize = 0;
};

// Checksums every chunk (on `threads` threads, into the staged memory), writes
// the file and fsyncs it; sets each slice's digest and returns the file's
// size. IoError on any failure (the caller abandons the folder). `fault` is
// the test hook of fault.h.
int64_t writeRankFile(const std::string& path, const RankFileHeader& header, std::vector<StagedSlice>& slices,
                      int threads, const std::optional<fault::Fault>& fault);

}  // namespace bulkhead::checkpoint
