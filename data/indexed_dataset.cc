#include "data/indexed_dataset.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include "runtime/errors.h"
#include "runtime/fd.h"

static_assert(std::endian::native == std::endian::little, "the indexed format is little-endian");

namespace bulkhead::data {
namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr int64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype code, S, D

const char* kWhatToDo =
    "rewrite it with Megatron's tools/preprocess_data.py or `bulkhead-data convert`, or restore it from a copy";

template <typename T>
T load(const uint8_t* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

template <typename T>
std::vector<T> loadArray(const uint8_t* at, int64_t count) {
  std::vector<T> values(static_cast<size_t>(count));
  if (count > 0) std::memcpy(values.data(), at, static_cast<size_t>(count) * sizeof(T));
  return values;
}

bool knownDtype(uint8_t code) { return code == 1 || code == 2 || code == 3 || code == 4 || code == 5 || code == 8; }

ConfigError fieldError(const std::string& file, const std::string& field, const std::string& what) {
  return ConfigError(fmt::format("{}: field {}: {}; {}", file, field, what, kWhatToDo),
                     {.expected = "an indexed dataset whose every field is consistent with its files"});
}

// Document indices: 0, then each document's end, never decreasing, ending at the sequence count.
void checkDocuments(const std::string& idx, const std::vector<int64_t>& documents, int64_t sequences) {
  const int64_t D = static_cast<int64_t>(documents.size());
  if (D < 2)
    throw fieldError(idx, "document_indices", fmt::format("{} entries: it needs 0, then each document's end", D));
  if (documents.front() != 0)
    throw fieldError(idx, "document_indices", fmt::format("it starts at {}, not 0", documents.front()));
  for (int64_t d = 1; d < D; ++d)
    if (documents[d] < documents[d - 1] || documents[d] > sequences)
      throw fieldError(idx, "document_indices",
                       fmt::format("entry {} is {} after {}: entries must not decrease and stay within the {} "
                                   "sequences",
                                   d, documents[d], documents[d - 1], sequences));
  if (documents.back() != sequences)
    throw fieldError(idx, "document_indices",
                     fmt::format("the last entry is {}, not the sequence count {}", documents.back(), sequences));
}

}  // namespace

const char* dtypeName(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::UInt8:
      return "uint8";
    case TokenDtype::Int8:
      return "int8";
    case TokenDtype::Int16:
      return "int16";
    case TokenDtype::Int32:
      return "int32";
    case TokenDtype::Int64:
      return "int64";
    case TokenDtype::UInt16:
      return "uint16";
  }
  return "?";
}

int dtypeBytes(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::UInt8:
    case TokenDtype::Int8:
      return 1;
    case TokenDtype::Int16:
    case TokenDtype::UInt16:
      return 2;
    case TokenDtype::Int32:
      return 4;
    case TokenDtype::Int64:
      return 8;
  }
  return 1;
}

TokenDtype dtypeForVocabulary(int64_t vocabularySize) {
  return vocabularySize < 65500 ? TokenDtype::UInt16 : TokenDtype::Int32;
}

IndexedDataset::IndexedDataset(std::string prefix, MappedFile index, MappedFile bin)
    : prefix_(std::move(prefix)), index_(std::move(index)), bin_(std::move(bin)) {}

IndexedDataset IndexedDataset::open(const std::string& prefix) {
  for (const char* suffix : {".idx", ".bin"})
    if (::access((prefix + suffix).c_str(), F_OK) != 0)
      throw ConfigError(fmt::format("{}{} does not exist: give the prefix of an indexed dataset (PREFIX.idx and "
                                    "PREFIX.bin, as Megatron's tools/preprocess_data.py or `bulkhead-data convert` "
                                    "write them)",
                                    prefix, suffix),
                        {.expected = "PREFIX.idx and PREFIX.bin"});
  IndexedDataset dataset(prefix, MappedFile(prefix + ".idx"), MappedFile(prefix + ".bin"));
  dataset.parse();
  return dataset;
}

void IndexedDataset::parse() {
  const std::string& idx = index_.path();
  const int64_t size = index_.size();
  if (size < kHeaderBytes)
    throw fieldError(idx, "header",
                     fmt::format("the file is {} bytes, shorter than the {}-byte header", size, kHeaderBytes));
  const uint8_t* at = index_.data();
  if (std::memcmp(at, kMagic, sizeof(kMagic)) != 0)
    throw fieldError(idx, "magic", "the file does not start with MMIDIDX\\x00\\x00: it is no Megatron indexed dataset");
  const uint64_t version = load<uint64_t>(at + 9);
  if (version != 1) throw fieldError(idx, "version", fmt::format("version {}; only version 1 is read", version));
  const uint8_t code = at[17];
  if (!knownDtype(code))
    throw fieldError(idx, "dtype", fmt::format("code {} is no token dtype (1-5 and 8 are; 6 and 7 are floats)", code));
  dtype_ = static_cast<TokenDtype>(code);
  const uint64_t count = load<uint64_t>(at + 18), docs = load<uint64_t>(at + 26);
  // Each count is bounded by the file's size before any product of them is formed.
  const uint64_t room = static_cast<uint64_t>(size - kHeaderBytes);
  if (count > room / 12 || docs > room / 8 || count * 12 + docs * 8 > room)
    throw fieldError(
        idx, "sequence_count/document_count",
        fmt::format("{} sequences and {} document indices need more than the file's {} bytes", count, docs, size));
  const int64_t S = static_cast<int64_t>(count), D = static_cast<int64_t>(docs);
  const int64_t needed = kHeaderBytes + S * 12 + D * 8;
  if (size != needed && size != needed + S)  // + S: a multimodal index's per-sequence modes (not read)
    throw fieldError(
        idx, "sequence_count/document_count",
        fmt::format("the file is {} bytes, but {} sequences and {} document indices make {}", size, S, D, needed));
  if (S == 0) throw fieldError(idx, "sequence_count", "the dataset holds no sequence");
  lengths_ = loadArray<int32_t>(at + kHeaderBytes, S);
  pointers_ = loadArray<int64_t>(at + kHeaderBytes + S * 4, S);
  documentIndices_ = loadArray<int64_t>(at + kHeaderBytes + S * 12, D);
  checkDocuments(idx, documentIndices_, S);
  checkSequences();
}

// Lengths not negative; pointers multiples of the token size, increasing without overlap, every sequence
// inside the .bin.
void IndexedDataset::checkSequences() {
  const std::string& idx = index_.path();
  const int64_t item = dtypeBytes(dtype_), binSize = bin_.size();
  int64_t end = 0;  // where the previous sequence's bytes end
  for (int64_t s = 0; s < sequences(); ++s) {
    const int64_t length = lengths_[s], pointer = pointers_[s];
    if (length < 0) throw fieldError(idx, "sequence_lengths", fmt::format("sequence {} has length {}", s, length));
    if (pointer < end || pointer % item != 0)
      throw fieldError(idx, "sequence_pointers",
                       fmt::format("sequence {} starts at byte {}: pointers must be multiples of {} ({}) that do not "
                                   "overlap the previous sequence, which ends at byte {}",
                                   s, pointer, item, dtypeName(dtype_), end));
    if (pointer > binSize || length * item > binSize - pointer)
      throw fieldError(bin_.path(), "sequence_pointers/sequence_lengths",
                       fmt::format("sequence {} ({} tokens from byte {}) ends past the file's {} bytes: the .bin is "
                                   "truncated or belongs to another index",
                                   s, length, pointer, binSize));
    end = pointer + length * item;
    tokens_ += length;
  }
}

void IndexedDataset::read(int64_t s, int64_t offset, int64_t count, int64_t* out) const {
  if (s < 0 || s >= sequences() || offset < 0 || count < 0 || offset > lengths_[s] || count > lengths_[s] - offset)
    throw ConfigError(fmt::format("{}: tokens [{}, {}) of sequence {} are not in the dataset ({} sequences{})", prefix_,
                                  offset, offset + count, s, sequences(),
                                  s >= 0 && s < sequences() ? fmt::format(", that one of {} tokens", lengths_[s]) : ""),
                      {.expected = "a token range inside one sequence"});
  const int64_t item = dtypeBytes(dtype_);
  const uint8_t* at = bin_.data() + pointers_[s] + offset * item;
  switch (dtype_) {
    case TokenDtype::UInt8:
      for (int64_t i = 0; i < count; ++i) out[i] = at[i];
      break;
    case TokenDtype::Int8:
      for (int64_t i = 0; i < count; ++i) out[i] = static_cast<int8_t>(at[i]);
      break;
    case TokenDtype::Int16:
      for (int64_t i = 0; i < count; ++i) out[i] = load<int16_t>(at + 2 * i);
      break;
    case TokenDtype::UInt16:
      for (int64_t i = 0; i < count; ++i) out[i] = load<uint16_t>(at + 2 * i);
      break;
    case TokenDtype::Int32:
      for (int64_t i = 0; i < count; ++i) out[i] = load<int32_t>(at + 4 * i);
      break;
    case TokenDtype::Int64:
      for (int64_t i = 0; i < count; ++i) out[i] = load<int64_t>(at + 8 * i);
      break;
  }
}

std::vector<int64_t> IndexedDataset::read(int64_t s) const {
  std::vector<int64_t> tokens(s >= 0 && s < sequences() ? static_cast<size_t>(lengths_[s]) : 0);
  read(s, 0, static_cast<int64_t>(tokens.size()), tokens.data());
  return tokens;
}

std::string IndexedDataset::indexDigest() const {
  // Word at a time: an .idx of millions of documents is tens of MB.
  uint64_t hash = 1469598103934665603ULL;
  const uint8_t* bytes = index_.data();
  const int64_t size = index_.size();
  int64_t i = 0;
  for (; i + 8 <= size; i += 8) hash = (hash ^ load<uint64_t>(bytes + i)) * 1099511628211ULL;
  for (; i < size; ++i) hash = (hash ^ bytes[i]) * 1099511628211ULL;
  hash = (hash ^ static_cast<uint64_t>(size)) * 1099511628211ULL;
  return fmt::format("{:016x}", hash);
}

}  // namespace bulkhead::data
