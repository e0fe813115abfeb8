#include "examples/train_moe/training_data.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>

#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::examples {
namespace {

using Json = nlohmann::ordered_json;

// What differs between two identities, as "field: saved -> now" (the prefixes' paths may move freely).
std::vector<std::string> changes(const Json& saved, const Json& now) {
  std::vector<std::string> out;
  for (const auto& [key, value] : now.items()) {
    if (key == "datasets") continue;
    if (!saved.contains(key) || saved[key] != value)
      out.push_back(fmt::format("{}: {} -> {}", key, saved.contains(key) ? saved[key].dump() : "none", value.dump()));
  }
  const Json &a = saved.value("datasets", Json::array()), &b = now["datasets"];
  if (a.size() != b.size()) {
    out.push_back(fmt::format("datasets: {} -> {}", a.size(), b.size()));
  } else {
    for (size_t d = 0; d < a.size(); ++d)
      for (const char* field : {"idx_bytes", "bin_bytes", "idx_digest"})
        if (a[d].value(field, Json()) != b[d][field])
          out.push_back(fmt::format("dataset {} ({}) {}: {} -> {}", d, b[d]["prefix"].get<std::string>(), field,
                                    a[d].value(field, Json()).dump(), b[d][field].dump()));
  }
  return out;
}

}  // namespace

TrainingData::TrainingData(DataOptions options, DataShape shape, int rank)
    : options_(std::move(options)), shape_(shape), rank_(rank) {
  if (options_.eodMaskLoss && options_.eod < 0)
    throw ConfigError("--eod-mask-loss needs --eod ID, the end-of-document token", {.rank = rank_});
  if (!fromDataset()) {
    if (options_.evalInterval > 0)
      throw ConfigError("--eval-interval reads the valid split of --data-path", {.rank = rank_});
    return;
  }
  blend_ = data::DataBlend::parse(options_.dataPath);
  data::parseSplit(options_.split);  // a bad split before anything is read
  for (const auto& prefix : blend_.prefixes)
    datasets_.push_back(std::make_shared<const data::IndexedDataset>(data::IndexedDataset::open(prefix)));
}

std::string TrainingData::identity() const {
  Json datasets = Json::array();
  for (const auto& d : datasets_)
    datasets.push_back({{"prefix", d->prefix()},
                        {"idx_bytes", d->indexBytes()},
                        {"bin_bytes", d->binBytes()},
                        {"idx_digest", d->indexDigest()}});
  Json out{{"data_path", blend_.text()},
           {"split", options_.split},
           {"sequence_length", shape_.sequence},
           {"seed", shape_.seed},
           {"train_samples", shape_.steps * shape_.globalBatch},
           {"datasets", datasets}};
  return out.dump();
}

void TrainingData::start(int64_t step, const std::map<std::string, std::string>* saved) {
  const std::string* savedData = nullptr;
  if (saved)
    if (auto it = saved->find("data"); it != saved->end()) savedData = &it->second;
  if (!fromDataset()) {
    if (savedData && !options_.dataChangedOk)
      throw ConfigError(
          "the checkpoint was trained on --data-path " +
              Json::parse(*savedData)["identity"]["data_path"].get<std::string>() +
              ", this run on the generated corpus: give the same --data-path, or --data-changed-ok to go on",
          {.rank = rank_, .expected = "the checkpoint's data"});
    train_ = std::make_unique<Batches>(generateCorpus(shape_.seed, 1 << 20), shape_.sequence, shape_.globalBatch,
                                       shape_.seed);
    return;
  }
  int64_t consumed = step * shape_.globalBatch;
  if (savedData) {
    const Json state = Json::parse(*savedData);
    const std::vector<std::string> changed = changes(state["identity"], Json::parse(identity()));
    if (!changed.empty() && !options_.dataChangedOk)
      throw ConfigError(fmt::format("the checkpoint's data differs from this run's: {}; give the run's data as it "
                                    "was, or --data-changed-ok to go on from its {} consumed samples",
                                    fmt::join(changed, "; "), state["consumed_samples"].get<int64_t>()),
                        {.rank = rank_, .expected = "the data the checkpoint was trained on"});
    if (!changed.empty() && rank_ == 0)
      log::warn("data", "the data changed ({}); going on from {} consumed samples as --data-changed-ok says",
                fmt::join(changed, "; "), state["consumed_samples"].get<int64_t>());
    consumed = state["consumed_samples"];
  } else if (saved && rank_ == 0) {
    log::info("data", "the checkpoint records no data position: step {} reads sample {} on", step, consumed);
  }
  startStep_ = step;
  startSample_ = consumed;
  const data::GptDatasetOptions gpt{.sequence = shape_.sequence,
                                    .seed = static_cast<uint32_t>(shape_.seed),
                                    .cacheDir = options_.cacheDir,
                                    .writeCache = rank_ == 0};
  const int64_t needed =
      std::max(shape_.steps * shape_.globalBatch, consumed + (shape_.steps - step) * shape_.globalBatch);
  auto train = data::buildSplit(blend_, options_.split, data::Split::Train, needed, gpt);
  const int64_t eodMask = options_.eodMaskLoss ? options_.eod : -1;
  train_ = std::make_unique<DatasetBatches>(train, DatasetBatchOptions{.globalBatch = shape_.globalBatch,
                                                                       .firstStep = step,
                                                                       .firstSample = consumed,
                                                                       .vocab = shape_.vocab,
                                                                       .eodMask = eodMask,
                                                                       .what = "train",
                                                                       .vocabHint = shape_.vocabHint});
  if (rank_ == 0)
    log::info("data", "{}: {} train samples of {} tokens (split {}), step {} reads sample {} on", blend_.text(),
              train->size(), shape_.sequence + 1, options_.split, step, consumed);
  if (options_.evalInterval > 0) {
    const int64_t samples = data::splitSamples(data::Split::Valid, shape_.steps, shape_.globalBatch,
                                               options_.evalInterval, options_.evalIters);
    valid_ =
        std::make_unique<DatasetBatches>(data::buildSplit(blend_, options_.split, data::Split::Valid, samples, gpt),
                                         DatasetBatchOptions{.globalBatch = shape_.globalBatch,
                                                             .vocab = shape_.vocab,
                                                             .eodMask = eodMask,
                                                             .what = "valid",
                                                             .vocabHint = shape_.vocabHint});
  }
}

std::string TrainingData::state(int64_t step) const {
  if (!fromDataset()) return {};
  Json out{{"consumed_samples", startSample_ + (step - startStep_) * shape_.globalBatch},
           {"step", step},
           {"identity", Json::parse(identity())}};
  return out.dump();
}

void TrainingData::log(int64_t step, int slot, int slots, const TokenBatch& batch) const {
  if (options_.dataLog.empty()) return;
  const auto* source = dynamic_cast<const DatasetBatches*>(train_.get());
  const int64_t first =
      (source ? source->firstSampleOf(step) : step * shape_.globalBatch) + int64_t{slot} * (shape_.globalBatch / slots);
  const at::Tensor idsHost = batch.ids.cpu().contiguous(), targetsHost = batch.targets.cpu().contiguous();
  const auto ids = idsHost.accessor<int64_t, 2>();
  const auto targets = targetsHost.accessor<int64_t, 2>();
  std::ofstream out(fmt::format("{}/rank{}.txt", options_.dataLog, rank_), std::ios::app);
  for (int64_t row = 0; row < ids.size(0); ++row) {
    uint64_t hash = 1469598103934665603ULL;
    auto mix = [&](int64_t v) { hash = (hash ^ static_cast<uint64_t>(v)) * 1099511628211ULL; };
    for (int64_t i = 0; i < ids.size(1); ++i) mix(ids[row][i]);
    mix(targets[row][ids.size(1) - 1]);
    out << fmt::format("{} {} {:016x}\n", step, first + row, hash);
  }
}

}  // namespace bulkhead::examples
