// Megatron-LM's sample order: the samples GPTDataset and BlendedDataset drew from datasets Megatron's own
// IndexedDatasetBuilder wrote (tests/data/fixtures, made by make_megatron_fixtures.py with Megatron's code),
// token for token, for the train and valid splits; and, on datasets of random documents, what the order
// must be whatever the seed: each sample continues the previous one across documents and epochs, every
// epoch holds each sequence once, the cache gives the same samples and a damaged cache is rebuilt, and the
// blend keeps each dataset at its share.

#include <dirent.h>

#include <fmt/format.h>
#include <algorithm>
#include <fstream>
#include <functional>

#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "data/blend.h"
#include "data/gpt_dataset.h"
#include "data/npy.h"
#include "data/numpy_random.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/temp_dir.h"
#include "tests/support/text.h"

using namespace bulkhead;
using namespace bulkhead::data;
using bulkhead::testing::contains;

namespace {

const std::string kFixtures = BULKHEAD_DATA_FIXTURES;

std::vector<int64_t> rows(const SampleSource& source, int64_t first, int64_t count) {
  const int width = source.sequence() + 1;
  std::vector<int64_t> out(static_cast<size_t>(count * width));
  for (int64_t r = 0; r < count; ++r) source.sample(first + r, out.data() + r * width);
  return out;
}

// Documents of 1 to 60 random tokens, one sequence each.
void writeRandom(const std::string& prefix, std::mt19937_64& rng, int documents, int64_t vocab) {
  IndexedDatasetWriter writer(prefix, dtypeForVocabulary(vocab));
  for (int d = 0; d < documents; ++d) {
    std::vector<int64_t> tokens(1 + rng() % 60);
    for (auto& t : tokens) t = static_cast<int64_t>(rng() % vocab);
    writer.addDocument(tokens);
  }
  writer.finish();
}

void checkContinuity(uint64_t seed);

std::vector<std::string> listDir(const std::string& path) {
  std::vector<std::string> names;
  if (DIR* dir = ::opendir(path.c_str())) {
    while (const dirent* entry = ::readdir(dir)) names.emplace_back(entry->d_name);
    ::closedir(dir);
  }
  return names;
}

std::string refusal(const std::function<void()>& call) {
  try {
    call();
  } catch (const ConfigError& error) {
    return error.what();
  }
  FAIL("no ConfigError");
  return {};
}

}  // namespace

TEST_CASE("the samples equal Megatron-LM's GPTDataset and BlendedDataset, token for token") {
  std::ifstream in(kFixtures + "/cases.json");
  REQUIRE(in.good());
  const nlohmann::json fixtures = nlohmann::json::parse(in);
  REQUIRE(fixtures["cases"].size() >= 3);
  for (const auto& c : fixtures["cases"]) {
    const std::string name = c["name"];
    INFO("case " << name);
    std::vector<std::string> words;
    for (const auto& word : c["blend"]) {
      const std::string w = word;
      words.push_back(w.find_first_not_of("0123456789.") == std::string::npos ? w : kFixtures + "/" + w);
    }
    const GptDatasetOptions options{.sequence = c["seq"], .seed = c["seed"]};
    for (const auto& [split, column] : {std::pair{Split::Train, 0}, std::pair{Split::Valid, 1}}) {
      const int64_t count = c["sizes"][column];
      if (count == 0) continue;
      const std::string file = fmt::format("{}/{}_{}.npy", kFixtures, name, splitName(split));
      const NpyArray expected = readNpy(file);
      INFO(file);
      REQUIRE(expected.shape == std::vector<int64_t>{count, options.sequence + 1});
      auto source = buildSplit(DataBlend::parse(words), c["split"], split, count, options);
      CHECK(source->size() == c[fmt::format("{}_length", splitName(split))].get<int64_t>());
      const std::vector<int64_t> got = rows(*source, 0, count);
      const std::vector<int64_t> want = expected.toInt64();
      int64_t firstDifference = -1;
      for (size_t i = 0; i < want.size() && firstDifference < 0; ++i)
        if (got[i] != want[i]) firstDifference = static_cast<int64_t>(i) / (options.sequence + 1);
      CHECK(firstDifference == -1);
    }
  }
}

TEST_CASE("the fixtures cover a separate and a joint last epoch") {
  std::set<bool> seen;
  for (const char* name : {"epochs_separate", "epochs_joint"}) {
    const nlohmann::json cases = nlohmann::json::parse(std::ifstream(kFixtures + "/cases.json"))["cases"];
    for (const auto& c : cases) {
      if (c["name"] != name) continue;
      auto dataset = std::make_shared<const IndexedDataset>(IndexedDataset::open(kFixtures + "/small_u16"));
      const auto range = splitRange(*parseSplit(c["split"])[0], dataset->sequences());
      GptDataset gpt(dataset, range.first, range.second, c["sizes"][0].get<int64_t>(), Split::Train,
                     {.sequence = c["seq"], .seed = c["seed"]});
      CHECK(gpt.epochs() > 1);
      seen.insert(gpt.separateFinalEpoch());
    }
  }
  CHECK(seen == std::set<bool>{false, true});
}

TEST_CASE("each sample continues the previous one, across documents and epochs") {
  for (uint64_t seed : {1, 2, 3}) checkContinuity(seed);
}

TEST_CASE("the legacy random state draws bounded integers as NumPy's does") {
  // The 64-bit path: two 32-bit draws, high word first, masked to the bound's width.
  std::mt19937 engine(0);
  LegacyRandomState same(0);
  const uint64_t max = (uint64_t{1} << 40) + 12345;
  uint64_t value;
  do {
    const uint64_t high = engine();
    value = ((high << 32) | engine()) & ((uint64_t{1} << 41) - 1);
  } while (value > max);
  CHECK(same.interval(max) == value);
  LegacyRandomState random(12345);
  for (uint64_t bound : {uint64_t{0}, uint64_t{1}, uint64_t{7}, uint64_t{1000}, uint64_t{0xffffffff}, max})
    for (int i = 0; i < 100; ++i) CHECK(random.interval(bound) <= bound);
  std::vector<int32_t> values(1000);
  for (int i = 0; i < 1000; ++i) values[i] = i;
  random.shuffle(std::span<int32_t>(values));
  std::vector<int32_t> sorted = values;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 1000; ++i) REQUIRE(sorted[i] == i);
  CHECK(values != sorted);
  // numpy.sum: 0.1 + 0.2 + 0.3 is 0.6000000000000001 there, as left to right.
  CHECK(numpySum(std::vector<double>{0.1, 0.2, 0.3}) == (0.1 + 0.2) + 0.3);
}

namespace {

void checkContinuity(uint64_t seed) {
  bulkhead::testing::TempDir dir;
  std::mt19937_64 rng(seed);
  writeRandom(dir.path() + "/d", rng, 50, 1000);
  auto dataset = std::make_shared<const IndexedDataset>(IndexedDataset::open(dir.path() + "/d"));
  const int sequence = 3 + static_cast<int>(rng() % 40);
  const int64_t wanted = 50 + static_cast<int64_t>(rng() % 400);
  GptDataset gpt(dataset, 5, 45, wanted, Split::Train, {.sequence = sequence, .seed = static_cast<uint32_t>(rng())});
  REQUIRE(gpt.size() >= wanted);
  // Each epoch of the document index holds the split's sequences once.
  const auto& documents = gpt.documentIndex();
  REQUIRE(static_cast<int64_t>(documents.size()) == 40 * gpt.epochs());
  std::vector<int> counts(50);
  for (int32_t s : documents) ++counts[s];
  for (int s = 0; s < 50; ++s) CHECK(counts[s] == (s >= 5 && s < 45 ? gpt.epochs() : 0));
  // In the order before the shuffle, the samples are the split's tokens back to back.
  std::vector<int64_t> stream;
  for (int32_t s : documents) {
    const auto tokens = dataset->read(s);
    stream.insert(stream.end(), tokens.begin(), tokens.end());
  }
  std::vector<int64_t> inverse(static_cast<size_t>(gpt.size()));
  for (int64_t i = 0; i < gpt.size(); ++i) inverse[gpt.shuffleIndex()[i]] = i;
  std::vector<int64_t> row(static_cast<size_t>(sequence + 1));
  for (int64_t k = 0; k < gpt.size(); ++k) {
    gpt.sample(inverse[k], row.data());
    REQUIRE(std::equal(row.begin(), row.end(), stream.begin() + k * sequence));
  }
}

}  // namespace

TEST_CASE("the cached indices give the same samples, and a damaged cache is rebuilt") {
  bulkhead::testing::TempDir dir;
  std::mt19937_64 rng(7);
  writeRandom(dir.path() + "/d", rng, 80, 70000);
  const GptDatasetOptions options{.sequence = 16, .seed = 42, .cacheDir = dir.path() + "/cache"};
  const DataBlend blend = DataBlend::parse({dir.path() + "/d"});
  auto built = buildSplit(blend, "90,10", Split::Train, 300, options);
  auto cached = buildSplit(blend, "90,10", Split::Train, 300, options);
  CHECK(!dynamic_cast<const GptDataset&>(*built).fromCache());
  CHECK(dynamic_cast<const GptDataset&>(*cached).fromCache());
  CHECK(rows(*built, 0, 300) == rows(*cached, 0, 300));
  // A shuffle index that is no permutation, then a truncated sample index: rebuilt each time.
  for (const char* damaged : {"shuffle_index", "sample_index"}) {
    std::string path;
    for (const std::string& entry : listDir(dir.path() + "/cache"))
      if (contains(entry, "-GPTDataset-train-") && contains(entry, damaged) && !contains(entry, "partial"))
        path = dir.path() + "/cache/" + entry;
    REQUIRE(!path.empty());
    std::string bytes;
    {
      std::ifstream f(path, std::ios::binary);
      bytes.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
    }
    if (std::string(damaged) == "shuffle_index")
      bytes[bytes.size() - 8] = bytes[bytes.size() - 16];
    else
      bytes.resize(bytes.size() - 16);
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    auto rebuilt = buildSplit(blend, "90,10", Split::Train, 300, options);
    CHECK(!dynamic_cast<const GptDataset&>(*rebuilt).fromCache());
    CHECK(rows(*rebuilt, 0, 300) == rows(*built, 0, 300));
  }
  // Another seed is another cache entry, and another order.
  GptDatasetOptions reseeded = options;
  reseeded.seed = 43;
  auto other = buildSplit(blend, "90,10", Split::Train, 300, reseeded);
  CHECK(!dynamic_cast<const GptDataset&>(*other).fromCache());
  CHECK(rows(*other, 0, 300) != rows(*built, 0, 300));
}

TEST_CASE("a blend keeps each dataset at its share, and refuses to oversample one") {
  bulkhead::testing::TempDir dir;
  std::mt19937_64 rng(11);
  writeRandom(dir.path() + "/a", rng, 40, 500);
  writeRandom(dir.path() + "/b", rng, 70, 100000);
  const DataBlend blend = DataBlend::parse({"0.25", dir.path() + "/a", "0.75", dir.path() + "/b"});
  REQUIRE(blend.weights == std::vector<double>{0.25, 0.75});
  auto source = buildSplit(blend, "1", Split::Train, 400, {.sequence = 8, .seed = 3});
  const auto& blended = dynamic_cast<const BlendedDataset&>(*source);
  REQUIRE(blended.size() == 400);
  int64_t fromA = 0;
  for (int64_t i = 0; i < blended.size(); ++i) {
    fromA += blended.dataset(i) == 0;
    // Never more than a sample away from its share.
    CHECK(std::abs(static_cast<double>(fromA) - 0.25 * static_cast<double>(std::max<int64_t>(i + 1, 1))) <= 1.0);
  }
  CHECK(fromA == 100);
  // A blend's datasets of one epoch each (no weights) cannot give more than they hold.
  const DataBlend unweighted = DataBlend::parse({dir.path() + "/a", dir.path() + "/b"});
  auto capped = buildSplit(unweighted, "1", Split::Train, 1'000'000, {.sequence = 8, .seed = 3});
  CHECK(capped->size() < 1'000'000);
  std::vector<std::shared_ptr<const SampleSource>> one{source};
  CHECK(contains(refusal([&] { BlendedDataset(one, {1.0}, 401, {"x"}); }), "the blend takes 401 samples from x"));
}

TEST_CASE("bad splits and data paths are ConfigErrors that say what to give") {
  bulkhead::testing::TempDir dir;
  std::mt19937_64 rng(5);
  writeRandom(dir.path() + "/d", rng, 10, 100);
  const DataBlend blend = DataBlend::parse({dir.path() + "/d.idx"});
  CHECK(blend.prefixes == std::vector<std::string>{dir.path() + "/d"});
  CHECK(contains(refusal([&] { buildSplit(blend, "0,1,0", Split::Train, 10, {.sequence = 4}); }),
                 "leaves the train split empty"));
  CHECK(contains(refusal([&] { buildSplit(blend, "100,0,0", Split::Valid, 10, {.sequence = 4}); }),
                 "leaves the valid split empty"));
  // 10 sequences: a 1% valid split rounds to none of them.
  CHECK(
      contains(refusal([&] { buildSplit(blend, "99,1,0", Split::Valid, 10, {.sequence = 4}); }), "holds no sequence"));
  CHECK(contains(refusal([] { parseSplit("1,2,3,4"); }), "4 numbers"));
  CHECK(contains(refusal([] { parseSplit("0,0"); }), "sum to 0"));
  CHECK(contains(refusal([] { parseSplit("1.2.3"); }), "not a number"));
  CHECK(contains(refusal([] { DataBlend::parse({"0", "a", "1", "b"}); }), "not positive"));
  CHECK(contains(refusal([] { DataBlend::parse({}); }), "no dataset"));
  // Megatron's split arithmetic: "969,30,1" of 1,000 sequences.
  const SplitMatrix matrix = parseSplit("969,30,1");
  CHECK(splitRange(*matrix[0], 1000) == std::pair<int64_t, int64_t>{0, 969});
  CHECK(splitRange(*matrix[1], 1000) == std::pair<int64_t, int64_t>{969, 999});
  CHECK(splitRange(*matrix[2], 1000) == std::pair<int64_t, int64_t>{999, 1000});
  CHECK(splitSamples(Split::Valid, 100, 8, 30, 2) == (100 / 30 + 1) * 2 * 8);
}
