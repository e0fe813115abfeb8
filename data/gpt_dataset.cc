#include "data/gpt_dataset.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <limits>

#include "data/numpy_random.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::data {
namespace {

// Bumped whenever what the cached files hold changes.
constexpr int kCacheFormat = 1;

std::string fnvHex(const std::string& text) {
  uint64_t hash = 1469598103934665603ULL;
  for (unsigned char c : text) hash = (hash ^ c) * 1099511628211ULL;
  return fmt::format("{:016x}", hash);
}

// helpers.cpp's build_sample_idx with drop_last_partial_sequence and add_extra_token_to_sequence: each
// boundary is a (document-index position, offset) pair; sample s spans boundaries s and s + 1.
std::vector<int64_t> buildSampleIndex(std::span<const int32_t> lengths, const std::vector<int32_t>& documents,
                                      int sequence, int64_t epochs, int64_t tokensPerEpoch) {
  const int64_t samples = (epochs * tokensPerEpoch - 1) / sequence;
  std::vector<int64_t> index(static_cast<size_t>(2 * (samples + 1)));
  int64_t position = 0, offset = 0;
  index[0] = 0;
  index[1] = 0;
  const int64_t last = static_cast<int64_t>(documents.size()) - 1;
  for (int64_t s = 1; s <= samples; ++s) {
    int64_t remaining = sequence + 1;
    while (remaining != 0) {
      const int64_t length = lengths[documents[position]] - offset;
      remaining -= length;
      if (remaining <= 0) {
        offset += remaining + length - 1;
        remaining = 0;
      } else {
        if (position == last) {  // only the last sample can reach the end of the documents
          offset = lengths[documents[position]] - 1;
          break;
        }
        ++position;
        offset = 0;
      }
    }
    index[2 * s] = position;
    index[2 * s + 1] = offset;
  }
  return index;
}

// _build_document_index: the sequence ids once per epoch, shuffled as one array.
std::vector<int32_t> documentEpochs(int64_t begin, int64_t end, int64_t epochs, LegacyRandomState& random) {
  std::vector<int32_t> documents;
  documents.reserve(static_cast<size_t>((end - begin) * epochs));
  for (int64_t e = 0; e < epochs; ++e)
    for (int64_t s = begin; s < end; ++s) documents.push_back(static_cast<int32_t>(s));
  random.shuffle(std::span<int32_t>(documents));
  return documents;
}

// _build_shuffle_index: [0, first) shuffled, then [first, total) shuffled apart.
std::vector<int64_t> buildShuffleIndex(int64_t first, int64_t total, LegacyRandomState& random) {
  std::vector<int64_t> order(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) order[i] = i;
  random.shuffle(std::span<int64_t>(order.data(), static_cast<size_t>(first)));
  if (first < total) random.shuffle(std::span<int64_t>(order.data() + first, static_cast<size_t>(total - first)));
  return order;
}

}  // namespace

const char* splitName(Split split) {
  switch (split) {
    case Split::Train:
      return "train";
    case Split::Valid:
      return "valid";
    default:
      return "test";
  }
}

SplitMatrix parseSplit(const std::string& text) {
  std::vector<double> shares;
  auto bad = [&](const std::string& what) {
    return ConfigError(fmt::format("--split '{}': {}", text, what),
                       {.expected = "up to three non-negative weights of train, valid and test, e.g. 969,30,1"});
  };
  for (size_t i = 0; i < text.size();) {
    if ((text[i] < '0' || text[i] > '9') && text[i] != '.') {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < text.size() && ((text[end] >= '0' && text[end] <= '9') || text[end] == '.')) ++end;
    const std::string number = text.substr(i, end - i);
    char* stop = nullptr;
    const double value = std::strtod(number.c_str(), &stop);
    if (stop != number.c_str() + number.size()) throw bad(fmt::format("'{}' is not a number", number));
    shares.push_back(value);
    i = end;
  }
  if (shares.empty() || shares.size() > 3) throw bad(fmt::format("{} numbers", shares.size()));
  shares.resize(3, 0.0);
  if (numpySum(shares) <= 0) throw bad("the weights sum to 0");
  shares = numpyNormalize(shares);
  // convert_split_vector_to_split_matrix: cumulative bookends, a split of no width is None.
  SplitMatrix matrix;
  double begin = 0;
  for (int i = 0; i < 3; ++i) {
    const double end = begin + shares[i];
    if (end > begin) matrix[i] = std::make_pair(begin, end);
    begin = end;
  }
  return matrix;
}

std::pair<int64_t, int64_t> splitRange(std::pair<double, double> share, int64_t sequences) {
  // int(round(x)): Python rounds halves to even, as nearbyint does in the default rounding mode.
  return {static_cast<int64_t>(std::nearbyint(share.first * static_cast<double>(sequences))),
          static_cast<int64_t>(std::nearbyint(share.second * static_cast<double>(sequences)))};
}

GptDataset::GptDataset(std::shared_ptr<const IndexedDataset> dataset, int64_t begin, int64_t end,
                       std::optional<int64_t> numSamples, Split split, const GptDatasetOptions& options)
    : dataset_(std::move(dataset)), begin_(begin), end_(end), split_(split), options_(options) {
  const std::string what =
      fmt::format("{} ({} split, sequences {} to {})", dataset_->prefix(), splitName(split), begin, end);
  if (options.sequence < 2)
    throw ConfigError(fmt::format("{}: a sequence length of {}", what, options.sequence),
                      {.expected = "--seq of at least 2"});
  if (begin < 0 || end > dataset_->sequences() || begin >= end)
    throw ConfigError(fmt::format("{}: the split holds no sequence of the dataset's {}; give the split more weight "
                                  "(--split) or use a larger dataset",
                                  what, dataset_->sequences()),
                      {.expected = "a split of at least one sequence"});
  int64_t tokensPerEpoch = 0;
  for (int64_t s = begin; s < end; ++s) tokensPerEpoch += dataset_->length(s);
  if (tokensPerEpoch < 2)
    throw ConfigError(fmt::format("{}: {} tokens, too few for one sample", what, tokensPerEpoch),
                      {.expected = "a split of at least two tokens"});
  if (numSamples && *numSamples < 0) throw ConfigError(fmt::format("{}: {} samples asked for", what, *numSamples));

  const std::string text = description(numSamples);
  const std::string base = options.cacheDir.empty()
                               ? std::string()
                               : fmt::format("{}/{}-GPTDataset-{}", options.cacheDir, fnvHex(text), splitName(split));
  if (!base.empty() && loadCache(base, text)) return;
  build(tokensPerEpoch, numSamples);
  if (!base.empty() && options.writeCache) {
    try {
      saveCache(base, text);
    } catch (const Error& error) {  // the indices are rebuilt next time; nothing is lost
      log::warn("data", "the sample indices were not cached: {}", error.message());
    }
  }
}

void GptDataset::build(int64_t tokensPerEpoch, std::optional<int64_t> numSamples) {
  const int sequence = options_.sequence;
  epochs_ = 1;
  if (numSamples) {  // _get_num_epochs: sequence tokens a sample, and the last sample's extra one
    const int64_t needed = *numSamples * sequence + 1;
    for (int64_t tokens = tokensPerEpoch; tokens < needed; tokens += tokensPerEpoch) ++epochs_;
  }
  int64_t samplesSansFinal = 0;
  separateFinalEpoch_ = false;
  if (epochs_ > 1) {
    samplesSansFinal = ((epochs_ - 1) * tokensPerEpoch - 1) / sequence;
    const int64_t fromFinal = *numSamples - samplesSansFinal;
    const int64_t perEpoch = (tokensPerEpoch - 1) / sequence;
    separateFinalEpoch_ = fromFinal < static_cast<int64_t>(0.80 * static_cast<double>(perEpoch));
  }
  LegacyRandomState random(options_.seed);
  if (separateFinalEpoch_) {
    documentIndex_ = documentEpochs(begin_, end_, epochs_ - 1, random);
    std::vector<int32_t> final = documentEpochs(begin_, end_, 1, random);
    documentIndex_.insert(documentIndex_.end(), final.begin(), final.end());
  } else {
    documentIndex_ = documentEpochs(begin_, end_, epochs_, random);
  }
  sampleIndex_ = buildSampleIndex(dataset_->lengths(), documentIndex_, sequence, epochs_, tokensPerEpoch);
  const int64_t total = size();
  shuffleIndex_ = buildShuffleIndex(separateFinalEpoch_ ? samplesSansFinal : total, total, random);
}

void GptDataset::sample(int64_t i, int64_t* out) const {
  if (i < 0 || i >= size())
    throw ConfigError(fmt::format("{} ({} split): sample {} of {}", dataset_->prefix(), splitName(split_), i, size()),
                      {.expected = "a sample the dataset holds"});
  const int64_t at = shuffleIndex_[i];
  const int64_t firstPosition = sampleIndex_[2 * at], firstOffset = sampleIndex_[2 * at + 1];
  const int64_t lastPosition = sampleIndex_[2 * at + 2], lastOffset = sampleIndex_[2 * at + 3];
  int64_t written = 0;
  for (int64_t position = firstPosition; position <= lastPosition; ++position) {
    const int64_t s = documentIndex_[position];
    const int64_t offset = position == firstPosition ? firstOffset : 0;
    const int64_t stop = position == lastPosition ? lastOffset + 1 : dataset_->length(s);
    const int64_t count = std::min<int64_t>(stop - offset, options_.sequence + 1 - written);
    if (count <= 0) continue;
    dataset_->read(s, offset, count, out + written);
    written += count;
  }
  if (written != options_.sequence + 1)
    throw ConfigError(fmt::format("{} ({} split): sample {} holds {} tokens, not {}: its sample index is damaged; "
                                  "delete the cached indices (--data-cache-path) to rebuild them",
                                  dataset_->prefix(), splitName(split_), i, written, options_.sequence + 1),
                      {.expected = "samples of sequence + 1 tokens"});
}

std::string GptDataset::description(std::optional<int64_t> numSamples) const {
  return fmt::format(
      "{{\"class\": \"GPTDataset\", \"format\": {}, \"prefix\": \"{}\", \"index_bytes\": {}, \"index_digest\": "
      "\"{}\", \"split\": \"{}\", \"sequences\": [{}, {}], \"num_samples\": {}, \"sequence_length\": {}, "
      "\"random_seed\": {}}}\n",
      kCacheFormat, dataset_->prefix(), dataset_->indexBytes(), dataset_->indexDigest(), splitName(split_), begin_,
      end_, numSamples ? std::to_string(*numSamples) : "null", options_.sequence, options_.seed);
}

}  // namespace bulkhead::data
