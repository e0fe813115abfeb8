#pragma once
// Bulkhead's whole use of the HDF5 C library, behind a small C++ surface:
// RAII for every identifier, and the one place where HDF5 return codes become
// errors (check() in hdf5.cc), carrying HDF5's own error stack.
//
// - Every call holds one process-wide lock: the library may be built without
//   thread safety, and the async writer calls it from a background thread.
// - Files use the HDF5 1.10 format (metadata with checksums: superblock,
//   object headers, chunk indexes), readable by h5py and h5dump.
// - Datasets with data are chunked (chunking.h) with the Fletcher-32 filter;
//   chunks are written and read whole, checksum included (H5Dwrite_chunk,
//   H5Dread_chunk), so checksums are computed on many threads outside the
//   lock while any HDF5 reader still verifies them through the filter.
// - Errors: a failure while writing is an IoError (disk full, permissions); a
//   failure while reading is a CheckpointError (a damaged or foreign file).
//   Both name the file, the key and the rank, and say what to do.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/chunking.h"

namespace bulkhead::checkpoint::h5 {

// What a call was working on, for messages.
struct Where {
  std::string file;
  std::string key;  // empty for file-level calls
  int rank = -1;
};

enum class Mode { Write, Read };

class Id;  // an hid_t and the function that closes it (hdf5.cc)

class Dataset {
 public:
  Dataset(std::unique_ptr<Id> id, Where where, Mode mode);
  Dataset(Dataset&&) noexcept;
  ~Dataset();

  void setAttribute(const std::string& name, const std::string& value);
  void setAttribute(const std::string& name, const std::vector<int64_t>& values);

  // Writes one whole chunk: `bytes` holds the chunk and its 4-byte checksum.
  void writeChunk(const std::vector<int64_t>& offsets, const void* data, size_t bytes);
  // Reads one whole chunk as stored (data and checksum) into `buffer`, and
  // returns the stored size. CheckpointError when the chunk is missing, was
  // stored with filters skipped, or does not fit `capacity`.
  size_t readChunk(const std::vector<int64_t>& offsets, void* buffer, size_t capacity);

  // Where a chunk lies in the file, for reading it directly (pread) on many
  // threads: its address and stored size; nullopt when it was never written.
  struct Location {
    uint64_t address = 0;
    uint64_t bytes = 0;
    unsigned filterMask = 0;
  };
  std::optional<Location> chunkLocation(const std::vector<int64_t>& offsets);

  // The dataset's shape and chunk shape (empty when not chunked), whether its
  // only filter is Fletcher-32, and its element size in the file.
  std::vector<int64_t> dims();
  std::vector<int64_t> chunkDims();
  bool fletcher32Only();
  int64_t fileElementSize();
  std::optional<std::string> stringAttribute(const std::string& name);
  std::optional<std::vector<int64_t>> integersAttribute(const std::string& name);

 private:
  std::unique_ptr<Id> id_;
  Where where_;
  Mode mode_;
};

class File {
 public:
  // Creates (truncating) a file for writing; IoError when it cannot.
  static File create(const std::string& path, int rank);
  // Opens a file read-only; CheckpointError when it cannot (missing, not
  // HDF5, damaged metadata).
  static File open(const std::string& path, int rank);
  File(File&&) noexcept;
  ~File();

  void setAttribute(const std::string& name, const std::string& value);
  std::optional<std::string> stringAttribute(const std::string& name);

  // A dataset for `plan` (chunked with Fletcher-32; contiguous and empty when
  // the plan has no chunks) storing `dtype`. `name` must be unique in the file.
  Dataset createDataset(const std::string& name, const std::string& key, const ChunkPlan& plan, c10::ScalarType dtype);
  Dataset openDataset(const std::string& name, const std::string& key);

  // Asks the kernel to start writing the file's dirty pages to disk now
  // (sync_file_range, not waiting), so the final fsync has little left to do
  // and the disk works while the rest of the file is written. Best effort.
  void startWriteback();
  // Flushes and closes, raising what the close reports (the destructor only logs).
  void close();
  const std::string& path() const { return where_.file; }

 private:
  File(std::unique_ptr<Id> id, Where where, Mode mode);
  std::unique_ptr<Id> id_;
  Where where_;
  Mode mode_;
};

// A dataset name for a key: '/' and '%' escaped (%2F, %25), so every key is
// one name at the file's root; a second slice of one key on one rank gets
// "@<offsets>" appended by the writer.
std::string datasetName(const std::string& key);

}  // namespace bulkhead::checkpoint::h5
