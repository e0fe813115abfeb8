// GptDataset's cached indices: BASE-description.txt (what they were built from, then how: epochs and
// whether the last was shuffled apart), BASE-document_index.npy, BASE-sample_index.npy and
// BASE-shuffle_index.npy. Each is written to a .partial file and renamed, so a reader sees whole files; a
// cache that does not match or is inconsistent is rebuilt, never trusted.
#include <fmt/format.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>

#include "data/gpt_dataset.h"
#include "data/npy.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::data {
namespace {

void makeDirs(const std::string& dir) {
  for (size_t at = 0; at != std::string::npos;) {
    at = dir.find('/', at + 1);
    const std::string path = dir.substr(0, at);
    if (!path.empty() && ::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST)
      throw IoError(fmt::format("{}: cannot be created ({})", path, std::strerror(errno)));
  }
}

std::string readText(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void writeText(const std::string& path, const std::string& text) {
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    out << text;
    if (!out.flush()) throw IoError(fmt::format("{}: cannot be written", partial));
  }
  if (std::rename(partial.c_str(), path.c_str()) != 0)
    throw IoError(fmt::format("{}: cannot be renamed into place ({})", path, std::strerror(errno)));
}

// Why the cached arrays cannot be this dataset's indices, or empty.
std::string inconsistency(const std::vector<int32_t>& documents, const std::vector<int64_t>& samples,
                          const std::vector<int64_t>& order, int64_t begin, int64_t end,
                          std::span<const int32_t> lengths) {
  const int64_t width = end - begin;
  if (documents.empty() || static_cast<int64_t>(documents.size()) % width != 0)
    return "the document index is not a whole number of epochs";
  for (int32_t s : documents)
    if (s < begin || s >= end) return fmt::format("the document index holds sequence {}, outside the split", s);
  if (samples.size() < 4 || samples.size() % 2 != 0) return "the sample index has no sample";
  for (size_t b = 0; b < samples.size(); b += 2) {
    const int64_t position = samples[b], offset = samples[b + 1];
    if (position < 0 || position >= static_cast<int64_t>(documents.size()) || offset < 0 ||
        offset >= std::max<int64_t>(1, lengths[documents[position]]) || (b > 0 && position < samples[b - 2]))
      return fmt::format("sample boundary {} is out of place", b / 2);
  }
  const int64_t count = static_cast<int64_t>(samples.size() / 2) - 1;
  if (static_cast<int64_t>(order.size()) != count) return "the shuffle index does not cover the samples";
  std::vector<bool> seen(static_cast<size_t>(count));
  for (int64_t i : order) {
    if (i < 0 || i >= count || seen[i]) return "the shuffle index is not a permutation";
    seen[i] = true;
  }
  return {};
}

}  // namespace

bool GptDataset::loadCache(const std::string& base, const std::string& description) {
  const std::string saved = readText(base + "-description.txt");
  if (saved.empty()) return false;
  if (saved.compare(0, description.size(), description) != 0) {
    log::warn("data", "{}-description.txt describes other indices; they are rebuilt", base);
    return false;
  }
  try {
    std::vector<int64_t> documents = readNpy(base + "-document_index.npy").toInt64();
    sampleIndex_ = readNpy(base + "-sample_index.npy").toInt64();
    shuffleIndex_ = readNpy(base + "-shuffle_index.npy").toInt64();
    documentIndex_.assign(documents.begin(), documents.end());
    for (size_t i = 0; i < documents.size(); ++i)
      if (documents[i] != documentIndex_[i]) throw ConfigError("a document index entry does not fit int32");
  } catch (const Error& error) {
    log::warn("data", "the cached indices {}-*.npy cannot be read ({}); they are rebuilt", base, error.message());
    return false;
  }
  const std::string why = inconsistency(documentIndex_, sampleIndex_, shuffleIndex_, begin_, end_, dataset_->lengths());
  if (!why.empty()) {
    log::warn("data", "the cached indices {}-*.npy are inconsistent ({}); they are rebuilt", base, why);
    return false;
  }
  std::istringstream how(saved.substr(description.size()));
  std::string word;
  how >> word >> epochs_ >> word >> separateFinalEpoch_;
  fromCache_ = true;
  return true;
}

void GptDataset::saveCache(const std::string& base, const std::string& description) const {
  const size_t slash = base.rfind('/');
  if (slash != std::string::npos) makeDirs(base.substr(0, slash));
  writeNpy<int32_t>(base + "-document_index.npy", documentIndex_);
  writeNpy<int64_t>(base + "-sample_index.npy", sampleIndex_, {static_cast<int64_t>(sampleIndex_.size() / 2), 2});
  writeNpy<int64_t>(base + "-shuffle_index.npy", shuffleIndex_);
  // The description last: it is what makes the arrays beside it a cache.
  writeText(base + "-description.txt",
            description + fmt::format("epochs {} separate_final_epoch {}\n", epochs_, separateFinalEpoch_ ? 1 : 0));
}

}  // namespace bulkhead::data
