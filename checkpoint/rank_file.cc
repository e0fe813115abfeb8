#include "checkpoint/rank_file.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "checkpoint/checksum.h"
#include "checkpoint/dtype.h"
#include "checkpoint/fs.h"
#include "checkpoint/hdf5.h"
#include "checkpoint/parallel_for.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::checkpoint {

std::string rankFileName(int rank) { return fmt::format("rank_{:05d}.h5", rank); }

int64_t writeRankFile(const std::string& path, const RankFileHeader& header, std::vector<StagedSlice>& slices,
                      int threads, const std::optional<fault::Fault>& fault) {
  // Checksums first, on many threads: each lands in the 4 bytes after its chunk.
  struct ChunkRef {
    size_t slice;
    int64_t chunk;
  };
  std::vector<ChunkRef> chunks;
  for (size_t s = 0; s < slices.size(); ++s)
    for (int64_t c = 0; c < slices[s].plan.count; ++c) chunks.push_back({s, c});
  parallelFor(static_cast<int64_t>(chunks.size()), threads, [&](int64_t i) {
    const StagedSlice& slice = slices[chunks[i].slice];
    uint8_t* chunk = slice.staged + chunks[i].chunk * slice.plan.stagedBytes();
    storeLe32(chunk + slice.plan.chunkBytes(), fletcher32(chunk, slice.plan.chunkBytes()));
  });

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
    if (fault && fault->action == fault::Action::Exit && s == half) {
      log::error("checkpoint", "BULKHEAD_CHECKPOINT_FAULT: exiting halfway through writing {}", path);
      ::_exit(17);
    }
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
  if (fault && fault->action == fault::Action::Exit && slices.empty()) ::_exit(17);
  file.close();
  fs::sync(path, header.rank);
  auto size = fs::fileSize(path);
  if (!size) fs::raise(fmt::format("reading the size of {}", path), errno ? errno : ENOENT, header.rank);
  return *size;
}

}  // namespace bulkhead::checkpoint
