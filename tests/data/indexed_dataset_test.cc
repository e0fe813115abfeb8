// Megatron's indexed format: what the writer writes reads back token for token, in every dtype Megatron's
// preprocessing picks; each kind of damage to the files is a ConfigError naming the file and the field;
// 10,000 mutated indexes each open with every read inside the files, or are refused (run under ASan in CI).

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "data/indexed_dataset.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/temp_dir.h"
#include "tests/support/text.h"

using namespace bulkhead;
using namespace bulkhead::data;
using bulkhead::testing::contains;

namespace {

using Documents = std::vector<std::vector<int64_t>>;

// Random documents of 0 to 40 tokens, ids below `vocab`.
Documents randomDocuments(std::mt19937_64& rng, int count, int64_t vocab) {
  Documents documents(count);
  for (auto& document : documents) {
    document.resize(rng() % 41);
    for (auto& id : document) id = static_cast<int64_t>(rng() % vocab);
  }
  return documents;
}

void write(const std::string& prefix, TokenDtype dtype, const Documents& documents) {
  IndexedDatasetWriter writer(prefix, dtype);
  for (const auto& document : documents) writer.addDocument(document);
  writer.finish();
}

std::string readBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void writeBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

template <typename T>
void put(std::string& bytes, size_t at, T value) {
  std::memcpy(bytes.data() + at, &value, sizeof(T));
}

// The error opening `prefix` raises; fails the test when it opens.
std::string refusal(const std::string& prefix) {
  try {
    IndexedDataset::open(prefix);
  } catch (const ConfigError& error) {
    return error.what();
  }
  FAIL("the damaged dataset opened");
  return "";
}

}  // namespace

TEST_CASE("an indexed dataset reads back the documents written, token for token, in uint16, int32 and int64") {
  bulkhead::testing::TempDir dir("bulkhead-data");
  std::mt19937_64 rng(0x1d5a7);
  for (auto [dtype, vocab] : {std::pair{TokenDtype::UInt16, int64_t{65535}},
                              {TokenDtype::Int32, int64_t{151936}},
                              {TokenDtype::Int64, int64_t{1} << 40},
                              {TokenDtype::UInt8, int64_t{256}}}) {
    INFO(dtypeName(dtype));
    Documents documents = randomDocuments(rng, 200, vocab);
    std::string prefix = dir.path() + "/" + dtypeName(dtype);
    write(prefix, dtype, documents);
    IndexedDataset dataset = IndexedDataset::open(prefix);
    CHECK(dataset.dtype() == dtype);
    REQUIRE(dataset.sequences() == 200);
    CHECK(dataset.documents() == 200);
    int64_t tokens = 0;
    for (int64_t s = 0; s < 200; ++s) {
      CHECK(dataset.read(s) == documents[s]);
      tokens += static_cast<int64_t>(documents[s].size());
    }
    CHECK(dataset.tokens() == tokens);
    CHECK(dataset.binBytes() == tokens * dtypeBytes(dtype));
    // A range inside a sequence, and one past its end.
    int64_t s = 0;
    while (documents[s].size() < 5) ++s;
    std::vector<int64_t> part(3);
    dataset.read(s, 2, 3, part.data());
    CHECK(part == std::vector<int64_t>(documents[s].begin() + 2, documents[s].begin() + 5));
    CHECK_THROWS_AS(dataset.read(s, 2, static_cast<int64_t>(documents[s].size()), part.data()), ConfigError);
  }
  CHECK(dtypeForVocabulary(50257) == TokenDtype::UInt16);
  CHECK(dtypeForVocabulary(151936) == TokenDtype::Int32);
}

TEST_CASE("the writer refuses a token its dtype cannot hold") {
  bulkhead::testing::TempDir dir("bulkhead-data");
  IndexedDatasetWriter writer(dir.path() + "/narrow", TokenDtype::UInt16);
  std::vector<int64_t> tokens{1, 2, 70000};
  try {
    writer.addDocument(tokens);
    FAIL("a token of 70000 went into uint16");
  } catch (const ConfigError& error) {
    CHECK(contains(error.what(), "70000"));
    CHECK(contains(error.what(), "uint16"));
  }
}

TEST_CASE("each kind of damage to an indexed dataset is a ConfigError naming the file and the field") {
  bulkhead::testing::TempDir dir("bulkhead-data");
  std::mt19937_64 rng(0x5eed);
  const std::string prefix = dir.path() + "/corpus";
  write(prefix, TokenDtype::UInt16, randomDocuments(rng, 10, 1000));
  const std::string idx = readBytes(prefix + ".idx"), bin = readBytes(prefix + ".bin");
  const int64_t S = 10;
  const size_t lengths = 34, pointers = 34 + 4 * S, documents = 34 + 12 * S;
  struct Case {
    const char* name;
    const char* file;
    const char* field;
    std::function<void(std::string& idx, std::string& bin)> damage;
  };
  std::vector<Case> cases{
      {"a truncated .bin", ".bin", "sequence_pointers", [](std::string&, std::string& b) { b.resize(b.size() - 3); }},
      {"a wrong magic", ".idx", "magic", [](std::string& i, std::string&) { i[0] = 'X'; }},
      {"version 2", ".idx", "version", [](std::string& i, std::string&) { put<uint64_t>(i, 9, 2); }},
      {"a float dtype", ".idx", "dtype", [](std::string& i, std::string&) { i[17] = 6; }},
      {"a pointer past the end", ".bin", "sequence_pointers",
       [&](std::string& i, std::string&) { put<int64_t>(i, pointers + 8 * (S - 1), 1 << 20); }},
      {"overlapping pointers", ".idx", "sequence_pointers",
       [&](std::string& i, std::string&) { put<int64_t>(i, pointers + 8 * 5, 0); }},
      {"a length that overflows", ".bin", "sequence_lengths",
       [&](std::string& i, std::string&) { put<int32_t>(i, lengths + 4 * 3, 0x7fffffff); }},
      {"a negative length", ".idx", "sequence_lengths",
       [&](std::string& i, std::string&) { put<int32_t>(i, lengths + 4 * 3, -4); }},
      {"document indices not ending at S", ".idx", "document_indices",
       [&](std::string& i, std::string&) { put<int64_t>(i, documents + 8 * S, S - 1); }},
      {"document indices not starting at 0", ".idx", "document_indices",
       [&](std::string& i, std::string&) { put<int64_t>(i, documents, 1); }},
      {"counts beyond the file", ".idx", "sequence_count",
       [](std::string& i, std::string&) { put<uint64_t>(i, 18, uint64_t{1} << 62); }},
      {"a truncated .idx", ".idx", "sequence_count", [](std::string& i, std::string&) { i.resize(i.size() - 8); }},
      {"a header cut short", ".idx", "header", [](std::string& i, std::string&) { i.resize(20); }},
      {"an empty dataset", ".idx", "sequence_count",
       [](std::string& i, std::string&) {
         i.resize(34 + 8);
         put<uint64_t>(i, 18, 0);
         put<uint64_t>(i, 26, 1);
         put<int64_t>(i, 34, 0);
       }},
  };
  for (const auto& c : cases) {
    INFO(c.name);
    std::string damagedIdx = idx, damagedBin = bin;
    c.damage(damagedIdx, damagedBin);
    writeBytes(prefix + ".idx", damagedIdx);
    writeBytes(prefix + ".bin", damagedBin);
    std::string text = refusal(prefix);
    INFO(text);
    CHECK(contains(text, prefix + c.file));
    CHECK(contains(text, c.field));
    CHECK(contains(text, "preprocess_data.py"));  // what to do
  }
  std::remove((prefix + ".bin").c_str());
  CHECK(contains(refusal(prefix), "corpus.bin does not exist"));
}

TEST_CASE("10,000 mutated indexes each open with every token read inside the .bin, or are refused") {
  bulkhead::testing::TempDir dir("bulkhead-data");
  std::mt19937_64 rng(0xf022);
  const std::string prefix = dir.path() + "/fuzz";
  write(prefix, TokenDtype::Int32, randomDocuments(rng, 24, 151936));
  const std::string idx = readBytes(prefix + ".idx");
  int opened = 0, refused = 0;
  std::vector<int64_t> tokens;
  for (int round = 0; round < 10000; ++round) {
    std::string mutated = idx;
    switch (rng() % 4) {
      case 0:  // flipped bytes
        for (int flips = 1 + static_cast<int>(rng() % 4); flips > 0; --flips)
          mutated[rng() % mutated.size()] ^= static_cast<char>(1 + rng() % 255);
        break;
      case 1:  // cut short or grown
        mutated.resize(rng() % 2 ? rng() % mutated.size() : mutated.size() + rng() % 64, '\x01');
        break;
      case 2:  // a random 8-byte value in the header or an array
        put<uint64_t>(mutated, rng() % (mutated.size() - 8), rng() >> (rng() % 64));
        break;
      default:  // a small change to one length or pointer
        put<int32_t>(mutated, 34 + 4 * (rng() % 72), static_cast<int32_t>(rng() % 9) - 4);
        break;
    }
    writeBytes(prefix + ".idx", mutated);
    try {
      IndexedDataset dataset = IndexedDataset::open(prefix);
      for (int64_t s = 0; s < dataset.sequences(); ++s) {
        tokens.resize(static_cast<size_t>(dataset.length(s)));
        dataset.read(s, 0, dataset.length(s), tokens.data());
      }
      CHECK(dataset.tokens() * 4 <= dataset.binBytes());
      ++opened;
    } catch (const ConfigError&) {
      ++refused;
    }
  }
  CHECK(opened + refused == 10000);
  CHECK(refused > 5000);
  CHECK(opened > 100);  // flips inside token-free regions and small valid edits still open
}
