// IndexedDatasetWriter (data/indexed_dataset.h): the layout Megatron's _IndexWriter writes, one sequence
// per document.

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>

#include "data/indexed_dataset.h"
#include "runtime/errors.h"
#include "runtime/fd.h"

namespace bulkhead::data {
namespace {

void range(TokenDtype dtype, int64_t& lo, int64_t& hi) {
  switch (dtype) {
    case TokenDtype::UInt8:
      lo = 0, hi = 255;
      return;
    case TokenDtype::Int8:
      lo = -128, hi = 127;
      return;
    case TokenDtype::Int16:
      lo = -32768, hi = 32767;
      return;
    case TokenDtype::UInt16:
      lo = 0, hi = 65535;
      return;
    case TokenDtype::Int32:
      lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max();
      return;
    case TokenDtype::Int64:
      lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
      return;
  }
}

IoError writeError(const std::string& path, int error) {
  return IoError(
      fmt::format("writing {} failed: {}; check the folder's free space and permissions", path, std::strerror(error)),
      {.expected = "a writable dataset folder with room"});
}

template <typename T>
void append(std::string& out, const T& value) {
  out.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

}  // namespace

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, TokenDtype dtype)
    : prefix_(std::move(prefix)), dtype_(dtype) {
  std::string path = prefix_ + ".bin.partial";
  bin_ = Fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!bin_.valid()) throw writeError(path, errno);
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (finished_) return;
  bin_.reset();
  ::unlink((prefix_ + ".bin.partial").c_str());
  ::unlink((prefix_ + ".idx.partial").c_str());
}

void IndexedDatasetWriter::addDocument(std::span<const int64_t> tokens) {
  if (finished_) throw ConfigError(fmt::format("{}: a document added after finish()", prefix_));
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    throw ConfigError(
        fmt::format("{}: a document of {} tokens; the index holds at most 2^31 - 1 a sequence", prefix_, tokens.size()),
        {.expected = "documents of fewer than 2^31 tokens"});
  int64_t lo = 0, hi = 0;
  range(dtype_, lo, hi);
  const int item = dtypeBytes(dtype_);
  std::string bytes(tokens.size() * item, '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < lo || tokens[i] > hi)
      throw ConfigError(
          fmt::format("{}: token {} of document {} is {}, outside {} ({} to {}): write the dataset with a "
                      "wider dtype",
                      prefix_, i, lengths_.size(), tokens[i], dtypeName(dtype_), lo, hi),
          {.expected = fmt::format("token ids that fit {}", dtypeName(dtype_))});
    std::memcpy(bytes.data() + i * item, &tokens[i], item);  // little-endian: the low bytes
  }
  if (int error = bin_.writeAll(bytes.data(), bytes.size())) throw writeError(prefix_ + ".bin.partial", error);
  pointers_.push_back(bytes_);
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  bytes_ += static_cast<int64_t>(bytes.size());
}

void IndexedDatasetWriter::finish() {
  if (finished_) return;
  const std::string binPartial = prefix_ + ".bin.partial";
  if (::fsync(bin_.get()) != 0) throw writeError(binPartial, errno);
  if (int error = bin_.close()) throw writeError(binPartial, error);
  std::string index("MMIDIDX\0\0", 9);
  append<uint64_t>(index, 1);
  index.push_back(static_cast<char>(dtype_));
  append<uint64_t>(index, lengths_.size());
  append<uint64_t>(index, lengths_.size() + 1);
  for (int32_t length : lengths_) append(index, length);
  for (int64_t pointer : pointers_) append(index, pointer);
  for (size_t d = 0; d <= lengths_.size(); ++d) append<int64_t>(index, static_cast<int64_t>(d));
  std::string path = prefix_ + ".idx", partial = path + ".partial";
  Fd file(::open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!file.valid()) throw writeError(partial, errno);
  if (int error = file.writeAll(index.data(), index.size())) throw writeError(partial, error);
  if (::fsync(file.get()) != 0) throw writeError(partial, errno);
  if (int error = file.close()) throw writeError(partial, error);
  // The .bin first: an .idx in place always describes the .bin beside it.
  if (::rename(binPartial.c_str(), (prefix_ + ".bin").c_str()) != 0) throw writeError(prefix_ + ".bin", errno);
  if (::rename(partial.c_str(), path.c_str()) != 0) throw writeError(path, errno);
  finished_ = true;
}

}  // namespace bulkhead::data
