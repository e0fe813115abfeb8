#pragma once
// The training data, either of two sources of the same batches:
// - an indexed dataset (or a blend of them) read as Megatron-LM's GPTDataset
//   draws samples (data/blend.h): global batch b is samples [c + (b - s) B,
//   c + (b - s + 1) B) of one global order, where training resumed at step s
//   with c samples consumed (c = s B from the start), so every layout reads the
//   same global batches and a resume goes on at the next global sample;
// - a text corpus this program generates itself (seeded sentences over a small
//   vocabulary, so a small model learns it within a few hundred steps), read
//   as bytes, for runs without a dataset.
// Either way dp rank r of `ranks` takes rows [r B/ranks, (r+1) B/ranks) of the
// global batch.

#include <ATen/core/Tensor.h>

#include "data/gpt_dataset.h"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace bulkhead::examples {

// A batch of byte sequences: ids and next-byte targets; keys, each token's
// place in the whole run (its sequence's index over all steps' global batches
// times the sequence length, plus its position), key the routers' noise.
// lossMask: [rows, sequence] float32, 0 where a target does not count (after
// an EOD input with --eod-mask-loss); undefined when every target counts.
struct TokenBatch {
  at::Tensor ids, targets, keys;  // [rows, sequence] int64 each
  at::Tensor lossMask;
};

std::string generateCorpus(uint64_t seed, size_t bytes);

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Sequences [rank * B/ranks, (rank+1) * B/ranks) of step `step`'s global
  // batch of B, each tensor [B/ranks, sequence] on `device`; targets are the
  // ids shifted by one token.
  virtual TokenBatch batch(int64_t step, int rank, int ranks, c10::Device device) const = 0;
  virtual int64_t tokensPerStep() const = 0;
};

class Batches : public BatchSource {
 public:
  Batches(std::string text, int sequence, int globalBatch, uint64_t seed);
  TokenBatch batch(int64_t step, int rank, int ranks, c10::Device device) const override;
  int64_t tokensPerStep() const override { return int64_t{globalBatch_} * sequence_; }

 private:
  std::string text_;
  int sequence_, globalBatch_;
  uint64_t seed_;
};

struct DatasetBatchOptions {
  int globalBatch = 16;
  int64_t firstStep = 0;  // the step that reads sample firstSample first
  int64_t firstSample = 0;
  int64_t vocab = 256;         // every id must be below it
  int64_t eodMask = -1;        // >= 0: targets after this input id do not count (Megatron's --eod-mask-loss)
  std::string what = "train";  // the split, in errors
  std::string vocabHint = "--vocab above every id of the dataset";  // what an id past the vocabulary calls for
};

class DatasetBatches : public BatchSource {
 public:
  DatasetBatches(std::shared_ptr<const data::SampleSource> source, DatasetBatchOptions options);
  // ConfigError naming the sample for an id at or above the vocabulary, or a
  // step past the samples the source holds.
  TokenBatch batch(int64_t step, int rank, int ranks, c10::Device device) const override;
  int64_t tokensPerStep() const override { return int64_t{options_.globalBatch} * source_->sequence(); }
  // The global index of the first sample of `step`'s batch.
  int64_t firstSampleOf(int64_t step) const {
    return options_.firstSample + (step - options_.firstStep) * options_.globalBatch;
  }

 private:
  std::shared_ptr<const data::SampleSource> source_;
  DatasetBatchOptions options_;
};

}  // namespace bulkhead::examples
