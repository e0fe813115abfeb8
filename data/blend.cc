#include "data/blend.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdlib>
#include <limits>

#include "data/numpy_random.h"
#include "runtime/errors.h"

namespace bulkhead::data {
namespace {

constexpr double kSurplus = 0.005;  // Megatron's mid_level_dataset_surplus

std::optional<double> number(const std::string& word) {
  char* end = nullptr;
  const double value = std::strtod(word.c_str(), &end);
  if (word.empty() || end != word.c_str() + word.size()) return std::nullopt;
  return value;
}

// helpers.cpp's build_blending_indices.
void blendingIndices(const std::vector<double>& weights, int64_t size, std::vector<int16_t>& datasets,
                     std::vector<int64_t>& samples) {
  std::vector<int64_t> taken(weights.size());
  datasets.resize(static_cast<size_t>(size));
  samples.resize(static_cast<size_t>(size));
  for (int64_t i = 0; i < size; ++i) {
    const double at = std::max(static_cast<double>(i), 1.0);
    size_t best = 0;
    double bestError = weights[0] * at - static_cast<double>(taken[0]);
    for (size_t d = 1; d < weights.size(); ++d) {
      const double error = weights[d] * at - static_cast<double>(taken[d]);
      if (error > bestError) {
        bestError = error;
        best = d;
      }
    }
    datasets[i] = static_cast<int16_t>(best);
    samples[i] = taken[best]++;
  }
}

}  // namespace

DataBlend DataBlend::parse(const std::vector<std::string>& words) {
  auto bad = [&](const std::string& what) {
    return ConfigError(
        fmt::format("--data-path {}: {}", fmt::join(words, " "), what),
        {.expected = "--data-path PREFIX [PREFIX ...] or --data-path WEIGHT PREFIX [WEIGHT PREFIX ...]"});
  };
  if (words.empty()) throw bad("no dataset");
  DataBlend blend;
  bool weighted = words.size() % 2 == 0;
  if (weighted)
    for (size_t i = 0; i < words.size(); i += 2) weighted = weighted && number(words[i]).has_value();
  if (!weighted) {
    blend.prefixes = words;
  } else {
    for (size_t i = 0; i < words.size(); i += 2) {
      const double weight = *number(words[i]);
      if (!(weight > 0) || !std::isfinite(weight)) throw bad(fmt::format("weight {} is not positive", words[i]));
      blend.weights.push_back(weight);
      blend.prefixes.push_back(words[i + 1]);
    }
  }
  for (auto& prefix : blend.prefixes) {
    if (prefix.size() > 4 && (prefix.ends_with(".bin") || prefix.ends_with(".idx")))
      prefix.resize(prefix.size() - 4);  // a file of the pair names its prefix
  }
  if (blend.prefixes.size() >= static_cast<size_t>(std::numeric_limits<int16_t>::max()))
    throw bad(fmt::format("{} datasets; a blend holds at most 32,766", blend.prefixes.size()));
  return blend;
}

std::string DataBlend::text() const {
  if (weights.empty()) return fmt::format("{}", fmt::join(prefixes, " "));
  std::vector<std::string> words;
  for (size_t i = 0; i < prefixes.size(); ++i) {
    words.push_back(fmt::format("{}", weights[i]));
    words.push_back(prefixes[i]);
  }
  return fmt::format("{}", fmt::join(words, " "));
}

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const SampleSource>> datasets,
                               const std::vector<double>& weights, int64_t size, const std::vector<std::string>& names)
    : datasets_(std::move(datasets)) {
  blendingIndices(numpyNormalize(weights), size, datasetIndex_, datasetSampleIndex_);
  std::vector<int64_t> taken(datasets_.size());
  for (int16_t d : datasetIndex_) ++taken[d];
  for (size_t d = 0; d < datasets_.size(); ++d)
    if (taken[d] > datasets_[d]->size())
      throw ConfigError(
          fmt::format("the blend takes {} samples from {}, which holds {}", taken[d], names[d], datasets_[d]->size()),
          {.expected = "a blend within each dataset's samples"});
}

void BlendedDataset::sample(int64_t i, int64_t* out) const {
  if (i < 0 || i >= size())
    throw ConfigError(fmt::format("blend: sample {} of {}", i, size()), {.expected = "a sample the blend holds"});
  datasets_[datasetIndex_[i]]->sample(datasetSampleIndex_[i], out);
}

int64_t splitSamples(Split which, int64_t steps, int64_t globalBatch, int64_t evalInterval, int64_t evalIters) {
  switch (which) {
    case Split::Train:
      return steps * globalBatch;
    case Split::Valid:
      return (steps / std::max<int64_t>(1, evalInterval) + 1) * evalIters * globalBatch;
    default:
      return evalIters * globalBatch;
  }
}

std::shared_ptr<const SampleSource> buildSplit(const DataBlend& blend, const std::string& split, Split which,
                                               int64_t numSamples, const GptDatasetOptions& options) {
  const SplitMatrix matrix = parseSplit(split);
  const auto& share = matrix[static_cast<int>(which)];
  if (!share)
    throw ConfigError(fmt::format("--split {} leaves the {} split empty", split, splitName(which)),
                      {.expected = fmt::format("--split giving the {} split a positive weight", splitName(which))});
  auto midLevel = [&](size_t d, std::optional<int64_t> samples) {
    auto dataset = std::make_shared<const IndexedDataset>(IndexedDataset::open(blend.prefixes[d]));
    const auto [begin, end] = splitRange(*share, dataset->sequences());
    return std::make_shared<const GptDataset>(dataset, begin, end, samples, which, options);
  };
  if (blend.prefixes.size() == 1 && blend.weights.empty()) return midLevel(0, numSamples);

  std::vector<std::shared_ptr<const SampleSource>> datasets;
  std::vector<double> weights;
  int64_t size = 0;
  if (!blend.weights.empty()) {
    weights = numpyNormalize(blend.weights);
    for (size_t d = 0; d < weights.size(); ++d) {
      const double target = std::ceil(static_cast<double>(numSamples) * weights[d]);
      size += static_cast<int64_t>(target);
      datasets.push_back(midLevel(d, static_cast<int64_t>(std::ceil(target * (1 + kSurplus)))));
    }
  } else {  // each dataset's one epoch, in proportion to its size
    for (size_t d = 0; d < blend.prefixes.size(); ++d) {
      datasets.push_back(midLevel(d, std::nullopt));
      weights.push_back(static_cast<double>(datasets.back()->size()));
      size += datasets.back()->size();
    }
    size = std::min(size, numSamples);
  }
  return std::make_shared<const BlendedDataset>(std::move(datasets), weights, size, blend.prefixes);
}

}  // namespace bulkhead::data
