#pragma once
// Training samples exactly as Megatron-LM's GPTDataset draws them (megatron/core/datasets/gpt_dataset.py),
// so a run reads the samples, in the order, that Megatron would from the same data, split, sequence length
// and seed (docs/data.md#samples):
//
// - the split's sequences, once per epoch for as many epochs as the samples need, cast to int32 and
//   shuffled with numpy.random.RandomState(seed); the last epoch is shuffled apart from the others when it
//   supplies fewer than 80% of an epoch's samples;
// - samples of sequence + 1 tokens, each starting on the previous one's last token, across sequence and
//   epoch boundaries; the last partial sample is dropped;
// - a shuffle of the samples, by the same random state (the separate last epoch's apart).
//
// The three indices are cached as .npy files under a cache folder, named by a digest of everything they
// depend on (the .idx's bytes included), and rebuilt whenever a cached one is missing or inconsistent.

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "data/indexed_dataset.h"

namespace bulkhead::data {

enum class Split { Train = 0, Valid = 1, Test = 2 };
const char* splitName(Split split);

// Megatron's split string ("969,30,1": up to three non-negative weights, normalised) as each split's
// [begin, end) share of the sequences; an empty share is nullopt. ConfigError for text that is not up to
// three numbers with a positive sum.
using SplitMatrix = std::array<std::optional<std::pair<double, double>>, 3>;
SplitMatrix parseSplit(const std::string& text);
// Sequences [begin, end) of `sequences` that a share covers (Python's round of share x count).
std::pair<int64_t, int64_t> splitRange(std::pair<double, double> share, int64_t sequences);

// What the trainer and `bulkhead-data samples` read: samples of sequence() + 1 tokens.
class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int64_t size() const = 0;
  virtual int sequence() const = 0;
  // Sample `i`'s sequence() + 1 tokens into out; ConfigError naming the dataset for an i out of range.
  virtual void sample(int64_t i, int64_t* out) const = 0;
};

struct GptDatasetOptions {
  int sequence = 0;        // tokens a sample predicts (it holds one more)
  uint32_t seed = 1234;    // Megatron's --seed
  std::string cacheDir;    // where the indices are cached; empty: built each time, not cached
  bool writeCache = true;  // false: a cache is read when present, never written (every rank but one)
};

class GptDataset : public SampleSource {
 public:
  // Megatron's GPTDataset over sequences [begin, end) of `dataset`, for at least `numSamples` samples
  // (nullopt: one epoch). ConfigError when the range holds no token or a sample would be shorter than
  // two tokens.
  GptDataset(std::shared_ptr<const IndexedDataset> dataset, int64_t begin, int64_t end,
             std::optional<int64_t> numSamples, Split split, const GptDatasetOptions& options);

  int64_t size() const override { return static_cast<int64_t>(sampleIndex_.size() / 2) - 1; }
  int sequence() const override { return options_.sequence; }
  void sample(int64_t i, int64_t* out) const override;

  int64_t epochs() const { return epochs_; }
  bool separateFinalEpoch() const { return separateFinalEpoch_; }
  bool fromCache() const { return fromCache_; }
  const IndexedDataset& dataset() const { return *dataset_; }
  // The indices (for the tests and `bulkhead-data`): sequence ids per epoch, (document-index position,
  // offset) per sample boundary, and the order samples are read in.
  const std::vector<int32_t>& documentIndex() const { return documentIndex_; }
  const std::vector<int64_t>& sampleIndex() const { return sampleIndex_; }
  const std::vector<int64_t>& shuffleIndex() const { return shuffleIndex_; }

 private:
  void build(int64_t tokensPerEpoch, std::optional<int64_t> numSamples);
  std::string description(std::optional<int64_t> numSamples) const;
  bool loadCache(const std::string& base, const std::string& description);
  void saveCache(const std::string& base, const std::string& description) const;

  std::shared_ptr<const IndexedDataset> dataset_;
  int64_t begin_, end_;
  Split split_;
  GptDatasetOptions options_;
  int64_t epochs_ = 1;
  bool separateFinalEpoch_ = false, fromCache_ = false;
  std::vector<int32_t> documentIndex_;
  std::vector<int64_t> sampleIndex_;  // [samples + 1][2], flattened
  std::vector<int64_t> shuffleIndex_;
};

}  // namespace bulkhead::data
