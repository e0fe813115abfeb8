#include "checkpoint/reader.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>

#include "checkpoint/checksum.h"
#include "checkpoint/dtype.h"
#include "checkpoint/fs.h"
#include "checkpoint/hdf5.h"
#include "checkpoint/parallel_for.h"
#include "checkpoint/rank_file.h"
#include "runtime/errors.h"
#include "runtime/fd.h"

namespace bulkhead::checkpoint {

struct CheckpointReader::File {
  std::string path;
  std::optional<h5::File> hdf5;
  Fd fd;
  Fd directFd;                      // O_DIRECT, where the file system has it
  std::atomic<bool> direct{false};  // cleared when a direct read is refused
};

namespace {

enum class ReadOutcome { Ok, EndOfFile, Unsupported };

// Reads [offset, offset + span) into `into`, accepting the end of the file
// once `needed` bytes are in. Unsupported: the file system refused a direct
// read (EINVAL); other errors raise through `fail`.
template <typename Fail>
ReadOutcome readSpan(int fd, uint8_t* into, size_t span, uint64_t offset, size_t needed, Fail&& fail) {
  size_t done = 0;
  while (done < span) {
    ssize_t n = ::pread(fd, into + done, span - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EINVAL) return ReadOutcome::Unsupported;
    if (n < 0) fail(std::strerror(errno));
    if (n == 0) return done >= needed ? ReadOutcome::Ok : ReadOutcome::EndOfFile;
    done += static_cast<size_t>(n);
  }
  return ReadOutcome::Ok;
}

}  // namespace

struct CheckpointReader::Slice {
  std::optional<h5::Dataset> dataset;
  ChunkPlan plan;
  std::vector<uint32_t> sums;  // checksums of the chunks read so far
  std::vector<char> seen;
  int64_t seenCount = 0;
};

CheckpointReader::CheckpointReader(std::string folder, const Manifest& manifest, int rank, int threads)
    : folder_(std::move(folder)), manifest_(manifest), rank_(rank), threads_(std::max(1, threads)) {
  files_.resize(manifest.worldSize);
  slices_.resize(manifest.slices.size());
}

CheckpointReader::~CheckpointReader() = default;

void CheckpointReader::fail(const std::string& path, const std::string& key, const std::string& what) const {
  std::string subject = key.empty() ? path : fmt::format("key '{}' in {}", key, path);
  throw CheckpointError(fmt::format("checkpoint step {} ({}): {}: {}; the checkpoint is damaged or was changed after "
                                    "it was saved: run `bulkhead-ckpt verify {}`, restore the file from a copy, or "
                                    "load an older step",
                                    manifest_.step, folder_, subject, what, folder_),
                        {.rank = rank_, .expected = "an intact checkpoint, as its manifest describes it"});
}

void CheckpointReader::checkFile(int fileRank) {
  const FileRecord* record = nullptr;
  for (const auto& candidate : manifest_.files)
    if (candidate.rank == fileRank) record = &candidate;
  if (!record) fail(folder_, "", fmt::format("the manifest lists no file of rank {}", fileRank));
  std::string path = fs::join(folder_, record->name);
  auto size = fs::fileSize(path);
  if (!size) fail(path, "", "the rank file listed in the manifest is missing");
  if (*size != record->bytes)
    fail(path, "",
         fmt::format("the file has {} bytes but was saved with {} ({})", *size, record->bytes,
                     *size < record->bytes ? "truncated" : "grown"));
}

CheckpointReader::File& CheckpointReader::file(int fileRank) {
  auto& slot = files_.at(fileRank);
  if (slot) return *slot;
  checkFile(fileRank);
  auto opened = std::make_unique<File>();
  opened->path = fs::join(folder_, rankFileName(fileRank));
  for (const auto& record : manifest_.files)
    if (record.rank == fileRank) opened->path = fs::join(folder_, record.name);
  opened->hdf5.emplace(h5::File::open(opened->path, rank_));
  auto expect = [&](const char* name, const std::string& wanted) {
    auto value = opened->hdf5->stringAttribute(name);
    if (!value || *value != wanted)
      fail(opened->path, "",
           fmt::format("its '{}' attribute is '{}' but the manifest says '{}' (a file from another "
                       "checkpoint or job?)",
                       name, value.value_or("<missing>"), wanted));
  };
  expect("format", kFormat);
  expect("job", manifest_.job);
  expect("step", std::to_string(manifest_.step));
  expect("rank", std::to_string(fileRank));
  opened->fd = Fd(::open(opened->path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!opened->fd.valid()) fail(opened->path, "", fmt::format("cannot open it: {}", std::strerror(errno)));
  opened->directFd = Fd(::open(opened->path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT));
  opened->direct = opened->directFd.valid();
  slot = std::move(opened);
  return *slot;
}

CheckpointReader::Slice& CheckpointReader::slice(int index) {
  auto& slot = slices_.at(index);
  if (slot) return *slot;
  const SliceRecord& record = manifest_.slices[index];
  const TensorRecord& tensor = manifest_.tensors[record.tensor];
  File& owner = file(record.rank);
  auto opened = std::make_unique<Slice>();
  opened->dataset.emplace(owner.hdf5->openDataset(record.dataset, tensor.key));
  h5::Dataset& dataset = *opened->dataset;
  std::vector<int64_t> stored = record.shape.empty() ? std::vector<int64_t>{1} : record.shape;
  std::vector<int64_t> dims = dataset.dims();
  if (dims != stored)
    fail(owner.path, tensor.key,
         fmt::format("dataset '{}' has shape [{}] but the manifest records [{}]", record.dataset, fmt::join(dims, ", "),
                     fmt::join(stored, ", ")));
  int64_t elementSize = dtypeSize(tensor.dtype);
  if (dataset.fileElementSize() != elementSize)
    fail(owner.path, tensor.key,
         fmt::format("dataset '{}' stores {}-byte elements, but {} takes {}", record.dataset, dataset.fileElementSize(),
                     dtypeName(tensor.dtype), elementSize));
  std::vector<int64_t> chunk = dataset.chunkDims();
  if (!ChunkPlan::fromFile(dims, chunk, elementSize, opened->plan))
    fail(owner.path, tensor.key,
         fmt::format("dataset '{}' has chunks [{}] that Bulkhead does not write", record.dataset,
                     fmt::join(chunk, ", ")));
  if (opened->plan.count > 0 && !dataset.fletcher32Only())
    fail(owner.path, tensor.key, fmt::format("dataset '{}' is not stored with Fletcher-32 checksums", record.dataset));
  opened->sums.assign(opened->plan.count, 0);
  opened->seen.assign(opened->plan.count, 0);
  slot = std::move(opened);
  return *slot;
}

const ChunkPlan& CheckpointReader::plan(int index) { return slice(index).plan; }

int64_t CheckpointReader::largestChunk(const std::vector<Piece>& pieces) {
  int64_t largest = 0;
  for (const Piece& piece : pieces) largest = std::max(largest, slice(piece.slice).plan.chunkBytes() + 4);
  return largest;
}

void CheckpointReader::read(const std::vector<Piece>& pieces, const Deliver& deliver, const Acquire& acquire) {
  // Where each chunk lies (HDF5 metadata, one thread), then the reads.
  struct Job {
    const Piece* piece;
    Slice* slice;
    File* file;
    uint64_t address;
  };
  std::vector<Job> jobs;
  jobs.reserve(pieces.size());
  int64_t largest = 0;
  for (const Piece& piece : pieces) {
    Slice& opened = slice(piece.slice);
    const SliceRecord& record = manifest_.slices[piece.slice];
    File& owner = file(record.rank);
    const std::string& key = manifest_.tensors[record.tensor].key;
    auto location = opened.dataset->chunkLocation(opened.plan.offsets(piece.chunk));
    int64_t expected = opened.plan.chunkBytes() + 4;
    if (!location)
      fail(owner.path, key, fmt::format("chunk {} of dataset '{}' is missing", piece.chunk, record.dataset));
    if (location->filterMask != 0 || static_cast<int64_t>(location->bytes) != expected)
      fail(owner.path, key,
           fmt::format("chunk {} of dataset '{}' is stored with {} bytes (filter mask {}), {} "
                       "expected",
                       piece.chunk, record.dataset, location->bytes, location->filterMask, expected));
    jobs.push_back({&piece, &opened, &owner, location->address});
    largest = std::max(largest, expected);
  }
  std::atomic<int64_t> bytes{0};
  parallelForWorkers(static_cast<int64_t>(jobs.size()), threads_, [&](int worker, int64_t i) {
    thread_local std::vector<uint8_t> own;
    const Job& job = jobs[i];
    const SliceRecord& record = manifest_.slices[job.piece->slice];
    const std::string& key = manifest_.tensors[record.tensor].key;
    size_t size = static_cast<size_t>(job.slice->plan.chunkBytes() + 4);
    uint8_t* buffer = nullptr;
    if (acquire) {
      buffer = acquire(worker, size);
    } else {
      if (own.size() < size) own.resize(std::max<size_t>(size, static_cast<size_t>(largest)));
      buffer = own.data();
    }
    auto readFailed = [&](const char* why) {
      fail(job.file->path, key, fmt::format("reading chunk {} failed: {}", job.piece->chunk, why));
    };
    ReadOutcome outcome = ReadOutcome::Unsupported;
    if (acquire && job.file->direct) {
      // The aligned span around the chunk, into the (aligned) buffer: no copy through the page cache.
      uint64_t begin = job.address / kDirectAlignment * kDirectAlignment;
      uint64_t end = (job.address + size + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment;
      size_t lead = static_cast<size_t>(job.address - begin);
      outcome =
          readSpan(job.file->directFd.get(), buffer, static_cast<size_t>(end - begin), begin, lead + size, readFailed);
      if (outcome == ReadOutcome::Unsupported)
        job.file->direct = false;
      else
        buffer += lead;
    }
    if (outcome == ReadOutcome::Unsupported)
      outcome = readSpan(job.file->fd.get(), buffer, size, job.address, size, readFailed);
    if (outcome == ReadOutcome::EndOfFile)
      fail(job.file->path, key, fmt::format("chunk {} ends past the end of the file (truncated)", job.piece->chunk));
    uint32_t stored = loadLe32(buffer + size - 4);
    uint32_t actual = fletcher32(buffer, size - 4);
    if (stored != actual)
      fail(job.file->path, key,
           fmt::format("chunk {} of dataset '{}' (offsets [{}]) fails its Fletcher-32 checksum "
                       "({:08x} stored, {:08x} computed)",
                       job.piece->chunk, record.dataset, fmt::join(job.slice->plan.offsets(job.piece->chunk), ", "),
                       stored, actual));
    job.slice->sums[job.piece->chunk] = stored;
    deliver(worker, *job.piece, buffer);
    bytes += static_cast<int64_t>(size);
  });
  bytesRead_ += bytes.load();
  // A slice now read whole is checked against the digest its writer reported.
  for (const Job& job : jobs) {
    Slice& opened = *job.slice;
    if (opened.seen[job.piece->chunk]) continue;
    opened.seen[job.piece->chunk] = 1;
    if (++opened.seenCount != opened.plan.count) continue;
    Hash64 digest;
    for (uint32_t sum : opened.sums) digest.add(static_cast<uint64_t>(sum));
    const SliceRecord& record = manifest_.slices[job.piece->slice];
    if (digest.value() != record.digest)
      fail(job.file->path, manifest_.tensors[record.tensor].key,
           fmt::format("dataset '{}' has digest {} but was saved with {} (chunks replaced after the save?)",
                       record.dataset, hex64(digest.value()), hex64(record.digest)));
  }
}

}  // namespace bulkhead::checkpoint
