#pragma once
// Where train_moe's batches come from (--data-path, or the generated corpus), where a resumed run goes on in
// them, and what a checkpoint records of them: the consumed samples and the data's identity (the blend, each
// dataset's sizes and .idx digest, the split, sequence length, seed and the samples the order was built
// for). A resume against other data refuses, naming what changed, unless --data-changed-ok.

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/blend.h"
#include "examples/train_moe/data.h"

namespace bulkhead::examples {

struct DataOptions {
  std::vector<std::string> dataPath;  // Megatron's --data-path words; empty: the generated corpus
  std::string split = "969,30,1";
  std::string cacheDir;  // the sample indices' cache; empty: none
  int64_t eod = -1;      // the end-of-document id (--eod-mask-loss needs it)
  bool eodMaskLoss = false;
  int64_t evalInterval = 0;  // steps between validations; 0: none
  int64_t evalIters = 10;    // global batches each validation reads
  bool dataChangedOk = false;
  std::string dataLog;  // a folder: each rank appends "step sample digest" for every row it trains on
};

struct DataShape {
  int sequence = 64;
  int globalBatch = 16;
  int64_t steps = 200;
  int64_t vocab = 256;
  uint64_t seed = 1;
  std::string vocabHint = "--vocab above every id of the dataset";  // what an id past the vocabulary calls for
};

class TrainingData {
 public:
  // ConfigError for a bad --data-path or --split, or --eod-mask-loss without --eod.
  TrainingData(DataOptions options, DataShape shape, int rank);

  bool fromDataset() const { return !options_.dataPath.empty(); }
  // Builds the sources for a run that starts at `step`; `saved` is the resumed checkpoint's user map
  // (nullptr: a fresh run). ConfigError when the saved data differs and --data-changed-ok is not given.
  void start(int64_t step, const std::map<std::string, std::string>* saved);

  const BatchSource& train() const { return *train_; }
  // The valid split's batches of evaluation `e` (1, 2, ...), or null without --eval-interval.
  const BatchSource* valid() const { return valid_.get(); }
  bool evaluatesAfter(int64_t step) const {
    return valid_ && options_.evalInterval > 0 && step % options_.evalInterval == 0;
  }
  int64_t evalIters() const { return options_.evalIters; }

  // The data state a checkpoint of `step` holds (the user map's "data"), or empty for the generated corpus.
  std::string state(int64_t step) const;
  // With --data-log: this rank's rows of `step` (micro-batch slot `slot` of `slots`).
  void log(int64_t step, int slot, int slots, const TokenBatch& batch) const;

 private:
  std::string identity() const;

  DataOptions options_;
  DataShape shape_;
  int rank_;
  data::DataBlend blend_;
  std::vector<std::shared_ptr<const data::IndexedDataset>> datasets_;
  std::unique_ptr<BatchSource> train_, valid_;
  int64_t startStep_ = 0, startSample_ = 0;
};

}  // namespace bulkhead::examples
