#include "checkpoint/rank_file.h"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <future>

#include "checkpoint/checksum.h"
#include "checkpoint/dtype.h"
#include "checkpoint/fs.h"
#include "checkpoint/hdf5.h"
#include "checkpoint/parallel_for.h"
#include "runtime/deadline.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::checkpoint {

namespace {

// BULKHEAD_CHECKPOINT_FAULT's actions halfway through writing a rank's file.
void haltHalfway(const fault::Fault& fault, const std::string& path) {
  if (fault.action == fault::Action::Exit) {
    log::error("checkpoint", "BULKHEAD_CHECKPOINT_FAULT: exiting halfway through writing {}", path);
    ::_exit(17);
  }
  if (fault.action == fault::Action::Stop || fault.action == fault::Action::Kill) {
    log::warn("checkpoint", "BULKHEAD_CHECKPOINT_FAULT: {} this process halfway through writing {}",
              fault.action == fault::Action::Stop ? "stopping" : "killing", path);
    ::raise(fault.action == fault::Action::Stop ? SIGSTOP : SIGKILL);  // a stopped one goes on once continued
  }
}

}  // namespace

std::string rankFileName(int rank) { return fmt::format("rank_{:05d}.h5", rank); }

int64_t writeRankFile(const std::string& path, const RankFileHeader& header, std::vector<StagedSlice>& slices,
                      int threads, const std::optional<fault::Fault>& fault) {
  // Checksums run a batch ahead of the writes, on `threads` threads; each
  // lands in the 4 bytes after its chunk, which is then written with it.
  struct ChunkRef {
    size_t slice;
    int64_t chunk;
  };
  constexpr int64_t kBatchBytes = int64_t{64} << 20;
  std::vector<ChunkRef> chunks;
  std::vector<size_t> batchEnds;  // where each batch of chunks ends in `chunks`
  int64_t batched = 0;
  for (size_t s = 0; s < slices.size(); ++s)
    for (int64_t c = 0; c < slices[s].plan.count; ++c) {
      chunks.push_back({s, c});
      if ((batched += slices[s].plan.chunkBytes()) >= kBatchBytes) {
        batchEnds.push_back(chunks.size());
        batched = 0;
      }
    }
  if (batchEnds.empty() || batchEnds.back() != chunks.size()) batchEnds.push_back(chunks.size());
  auto checksum = [&](size_t batch) {
    size_t begin = batch == 0 ? 0 : batchEnds[batch - 1];
    parallelFor(static_cast<int64_t>(batchEnds[batch] - begin), threads, [&](int64_t i) {
      const ChunkRef& ref = chunks[begin + i];
      const StagedSlice& slice = slices[ref.slice];
      uint8_t* chunk = slice.staged + ref.chunk * slice.plan.stagedBytes();
      storeLe32(chunk + slice.plan.chunkBytes(), fletcher32(chunk, slice.plan.chunkBytes()));
    });
  };
  size_t nextBatch = 0, checksummed = 0;  // chunks [0, checksummed) are ready to write
  std::future<void> ahead = std::async(std::launch::async, checksum, nextBatch);
  auto awaitChecksum = [&](size_t index) {
    while (index >= checksummed) {
      ahead.get();
      checksummed = batchEnds[nextBatch++];
      if (nextBatch < batchEnds.size()) ahead = std::async(std::launch::async, checksum, nextBatch);
    }
  };
  size_t written = 0;

  auto started = std::chrono::steady_clock::now();
  h5::File file = h5::File::create(path, header.rank);
  file.setAttribute("format", kFormat);
  file.setAttribute("job", header.job);
  file.setAttribute("step", std::to_string(header.step));
  file.setAttribute("rank", std::to_string(header.rank));
  file.setAttribute("world_size", std::to_string(header.worldSize));
  size_t half = slices.size() / 2;
  constexpr int64_t kWritebackBytes = int64_t{256} << 20;
  int64_t sinceWriteback = 0;
  for (size_t s = 0; s < slices.size(); ++s) {
    if (fault && s == half) haltHalfway(*fault, path);
    StagedSlice& slice = slices[s];
    h5::Dataset dataset = file.createDataset(slice.dataset, slice.key, slice.plan, slice.dtype);
    dataset.setAttribute("key", slice.key);
    dataset.setAttribute("dtype", dtypeName(slice.dtype));
    dataset.setAttribute("global_shape", slice.globalShape);
    dataset.setAttribute("offsets", slice.offsets);
    Hash64 digest;
    for (int64_t c = 0; c < slice.plan.count; ++c) {
      if (fault && fault->action == fault::Action::WriteError)
        fs::raise(fmt::format("writing chunk {} of key '{}' to {} (injected by BULKHEAD_CHECKPOINT_FAULT)", c,
                              slice.key, path),
                  ENOSPC, header.rank);
      awaitChecksum(written++);
      const uint8_t* chunk = slice.staged + c * slice.plan.stagedBytes();
      digest.add(static_cast<uint64_t>(loadLe32(chunk + slice.plan.chunkBytes())));
      dataset.writeChunk(slice.plan.offsets(c), chunk, static_cast<size_t>(slice.plan.chunkBytes() + 4));
      if ((sinceWriteback += slice.plan.chunkBytes()) >= kWritebackBytes) {
        file.startWriteback();
        sinceWriteback = 0;
      }
    }
    slice.digest = digest.value();
  }
  if (fault && slices.empty()) haltHalfway(*fault, path);
  if (ahead.valid()) ahead.get();
  file.close();
  double writing = secondsSince(started);
  fs::sync(path, header.rank);
  log::debug("checkpoint", "{}: {} chunks written in {:.3f} s, fsync {:.3f} s", path, chunks.size(), writing,
             secondsSince(started) - writing);
  auto size = fs::fileSize(path);
  if (!size) fs::raise(fmt::format("reading the size of {}", path), errno ? errno : ENOENT, header.rank);
  return *size;
}

}  // namespace bulkhead::checkpoint
