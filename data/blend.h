#pragma once
// Megatron-LM's blends and splits (megatron/core/datasets/blended_megatron_dataset_builder.py and
// blended_dataset.py): `--data-path A` or `--data-path 0.3 A 0.7 B`, a split string, and a split's sample
// count make the same samples, in the same order, as Megatron's BlendedMegatronDatasetBuilder:
//
// - one prefix and no weight: that dataset's GPTDataset of the split;
// - weights: each dataset's GPTDataset of ceil(ceil(N w) x 1.005) samples (Megatron's 0.5% surplus), and
//   a blend of sum(ceil(N w)) samples that takes sample i from the dataset furthest behind its share,
//   argmax(w i - taken so far), the first on a tie;
// - several prefixes without weights: each dataset's one epoch, blended by their sizes.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/gpt_dataset.h"

namespace bulkhead::data {

struct DataBlend {
  std::vector<std::string> prefixes;
  std::vector<double> weights;  // one a prefix, or empty: none given

  // Megatron's --data-path words: prefixes, or weight prefix pairs. ConfigError for an odd mixture, a
  // weight that is not positive, or no prefix.
  static DataBlend parse(const std::vector<std::string>& words);
  std::string text() const;
};

class BlendedDataset : public SampleSource {
 public:
  // `size` samples drawn from `datasets` in proportion to `weights` (normalised here, as Megatron's
  // BlendedDataset does). ConfigError naming the dataset when the blend asks one for more samples than it
  // holds.
  BlendedDataset(std::vector<std::shared_ptr<const SampleSource>> datasets, const std::vector<double>& weights,
                 int64_t size, const std::vector<std::string>& names);

  int64_t size() const override { return static_cast<int64_t>(datasetIndex_.size()); }
  int sequence() const override { return datasets_.front()->sequence(); }
  void sample(int64_t i, int64_t* out) const override;
  // Which dataset sample i comes from, and its sample there.
  int dataset(int64_t i) const { return datasetIndex_[i]; }
  int64_t datasetSample(int64_t i) const { return datasetSampleIndex_[i]; }

 private:
  std::vector<std::shared_ptr<const SampleSource>> datasets_;
  std::vector<int16_t> datasetIndex_;
  std::vector<int64_t> datasetSampleIndex_;
};

// The samples Megatron's pretraining asks of each split (training.py, get_train_valid_test_num_samples):
// steps x batch to train; (steps / evalInterval + 1) x evalIters x batch to validate; evalIters x batch
// to test.
int64_t splitSamples(Split which, int64_t steps, int64_t globalBatch, int64_t evalInterval, int64_t evalIters);

// The samples of split `which` (the train split for training, valid for evaluation), at least
// `numSamples` of them. ConfigError when the split string leaves that split empty, and for a dataset
// that cannot be read or is too small (each naming the file).
std::shared_ptr<const SampleSource> buildSplit(const DataBlend& blend, const std::string& split, Split which,
                                               int64_t numSamples, const GptDatasetOptions& options);

}  // namespace bulkhead::data
