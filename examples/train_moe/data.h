#pragma once
// The training data: a text corpus this program generates itself (seeded
// sentences over a small vocabulary, so a small model learns it within a few
// hundred steps), read as bytes. Batches are a pure function of the step, so
// the data position is the step and a resumed run reads exactly what a
// straight run would, in any layout.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>

namespace bulkhead::examples {

// A batch of byte sequences: ids and next-byte targets; keys, each token's
// place in the whole run (its sequence's index over all steps' global batches
// times the sequence length, plus its position), key the routers' noise.
struct TokenBatch {
  at::Tensor ids, targets, keys;  // [rows, sequence] int64 each
};

std::string generateCorpus(uint64_t seed, size_t bytes);

class Batches {
 public:
  Batches(std::string text, int sequence, int globalBatch, uint64_t seed);

  // Sequences [rank * B/ranks, (rank+1) * B/ranks) of step `step`'s global
  // batch of B, each tensor [B/ranks, sequence] int64 on `device`; targets
  // are the ids shifted by one byte.
  TokenBatch batch(int64_t step, int rank, int ranks, c10::Device device) const;

  int64_t tokensPerStep() const { return int64_t{globalBatch_} * sequence_; }

 private:
  std::string text_;
  int sequence_, globalBatch_;
  uint64_t seed_;
};

}  // namespace bulkhead::examples
