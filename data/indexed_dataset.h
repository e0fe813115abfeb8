#pragma once
// Megatron-LM's indexed dataset: PREFIX.idx indexes the token ids stored back to back in PREFIX.bin, as
// Megatron's tools/preprocess_data.py writes them (and IndexedDatasetWriter below). Both files are
// memory-mapped (the index's arrays are copied out: the file does not align them); every field of the index is checked against the files' sizes before anything is read
// (docs/data.md#the-indexed-format), so a damaged or hostile file is a ConfigError naming the file and the
// field, and no read leaves the mappings.
//
// The .idx, all little-endian: the 9-byte magic "MMIDIDX\0\0", version <Q (1), the token dtype code <B,
// the sequence count S <Q, the document-index count D <Q, then int32 sequence lengths [S], int64 byte
// offsets of the sequences in .bin [S] and int64 document indices [D]: D is the number of documents plus
// one, starting at 0 and ending at S (document d is sequences [doc[d], doc[d + 1])).

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "data/mapped_file.h"
#include "runtime/fd.h"

namespace bulkhead::data {

// The dtype codes of Megatron's index (megatron/core/datasets/indexed_dataset.py, DType).
enum class TokenDtype : uint8_t { UInt8 = 1, Int8 = 2, Int16 = 3, Int32 = 4, Int64 = 5, UInt16 = 8 };

const char* dtypeName(TokenDtype dtype);
int dtypeBytes(TokenDtype dtype);
// The dtype Megatron's preprocess_data.py picks for a vocabulary: uint16 below 65,500 ids, else int32.
TokenDtype dtypeForVocabulary(int64_t vocabularySize);

class IndexedDataset {
 public:
  // Opens PREFIX.idx and PREFIX.bin and validates the index; ConfigError naming the file and field of
  // the first problem, IoError when a file cannot be read.
  static IndexedDataset open(const std::string& prefix);

  const std::string& prefix() const { return prefix_; }
  TokenDtype dtype() const { return dtype_; }
  int64_t sequences() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t documents() const { return static_cast<int64_t>(documentIndices_.size()) - 1; }
  int64_t tokens() const { return tokens_; }
  // Sequence `s`'s token count, and the index's document boundaries ([documents() + 1], 0 ... S).
  int64_t length(int64_t s) const { return lengths_[s]; }
  std::span<const int32_t> lengths() const { return lengths_; }
  std::span<const int64_t> documentIndices() const { return documentIndices_; }
  // The bytes of the two files (for the dataset's identity in a checkpoint).
  int64_t indexBytes() const { return index_.size(); }
  int64_t binBytes() const { return bin_.size(); }
  // A 64-bit FNV-1a digest of the .idx's bytes, as 16 hex digits (the dataset's identity in a checkpoint
  // and in the cached sample indices' names).
  std::string indexDigest() const;

  // Tokens [offset, offset + count) of sequence `s`, widened to int64; ConfigError when the range is
  // not inside the sequence.
  void read(int64_t s, int64_t offset, int64_t count, int64_t* out) const;
  std::vector<int64_t> read(int64_t s) const;

 private:
  IndexedDataset(std::string prefix, MappedFile index, MappedFile bin);
  void parse();
  void checkSequences();

  std::string prefix_;
  MappedFile index_, bin_;
  TokenDtype dtype_ = TokenDtype::UInt16;
  // Copied out of the mapping: in the file they are not aligned to their size.
  std::vector<int32_t> lengths_;
  std::vector<int64_t> pointers_, documentIndices_;
  int64_t tokens_ = 0;
};

// Writes a dataset in the same format, one sequence per document: the tokens as documents are added, the
// index at finish(), each into PREFIX.*.partial and renamed into place there (the .bin first), so a reader
// never sees half of one. A writer destroyed before finish() removes its partial files.
class IndexedDatasetWriter {
 public:
  // IoError when PREFIX.bin.partial cannot be created.
  IndexedDatasetWriter(std::string prefix, TokenDtype dtype);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // ConfigError when a token does not fit the dtype, or a document has more than 2^31 - 1 tokens.
  void addDocument(std::span<const int64_t> tokens);
  // Writes the index; IoError when a file cannot be written.
  void finish();

 private:
  std::string prefix_;
  TokenDtype dtype_;
  Fd bin_;
  std::vector<int32_t> lengths_;
  std::vector<int64_t> pointers_;
  int64_t bytes_ = 0;
  bool finished_ = false;
};

}  // namespace bulkhead::data
