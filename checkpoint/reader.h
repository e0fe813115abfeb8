#pragma once
// Reads slices of one committed checkpoint (a step folder and its manifest).
// Each rank file is opened once and checked against the manifest (its size,
// and the job, step and rank it names), each dataset against its slice (shape,
// element size, Fletcher-32 chunks). Chunks are located through HDF5 and read
// with pread on several threads; every chunk is verified against its
// Fletcher-32 checksum, and a slice read whole against its digest.
// Errors: CheckpointError naming the file, the key, the reading rank and what
// to do.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/chunking.h"
#include "checkpoint/manifest.h"

namespace bulkhead::checkpoint {

class CheckpointReader {
 public:
  CheckpointReader(std::string folder, const Manifest& manifest, int rank, int threads);
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;
  ~CheckpointReader();

  // One chunk of one slice (an index into manifest.slices).
  struct Piece {
    int slice;
    int64_t chunk;
  };

  // The chunk plan of a slice as stored (opens its file and dataset).
  const ChunkPlan& plan(int slice);
  // Reads and verifies `pieces`, calling deliver(worker, piece, bytes) on
  // worker threads (worker: the thread's index, 0 .. threads-1); `bytes` holds
  // the whole chunk (valid elements first). acquire(worker, bytes), when set,
  // gives the buffer a thread reads its next chunk into: kDirectAlignment-
  // aligned, of at least bytes + kDirectSlack, so that the chunk can be read
  // with O_DIRECT (bypassing the page cache) where the file system allows;
  // else the reader uses buffers of its own and the page cache.
  static constexpr size_t kDirectAlignment = 4096;
  static constexpr size_t kDirectSlack = 2 * kDirectAlignment;
  using Deliver = std::function<void(int worker, const Piece&, const uint8_t* bytes)>;
  using Acquire = std::function<uint8_t*(int worker, size_t bytes)>;
  void read(const std::vector<Piece>& pieces, const Deliver& deliver, const Acquire& acquire = nullptr);
  // The largest stored chunk (with its checksum) among `pieces`.
  int64_t largestChunk(const std::vector<Piece>& pieces);
  // Checks that the file of `fileRank` exists with the size the manifest records.
  void checkFile(int fileRank);
  // checkFile, then opens it and checks its attributes against the manifest.
  void openFile(int fileRank) { file(fileRank); }
  int64_t bytesRead() const { return bytesRead_; }

 private:
  struct File;
  struct Slice;
  File& file(int fileRank);
  Slice& slice(int index);
  [[noreturn]] void fail(const std::string& path, const std::string& key, const std::string& what) const;

  std::string folder_;
  const Manifest& manifest_;
  int rank_;
  int threads_;
  std::vector<std::unique_ptr<File>> files_;    // by file rank
  std::vector<std::unique_ptr<Slice>> slices_;  // by slice index
  int64_t bytesRead_ = 0;
};

}  // namespace bulkhead::checkpoint
