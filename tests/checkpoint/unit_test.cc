// Checkpoint pieces in one process: checksums compatible with HDF5's filter,
// chunk plans, the manifest, the coverage check (with a 100,000-slice timing),
// fault specs, and a whole save/load through a file store with one rank.

#include <fcntl.h>
#include <fmt/format.h>
#include <hdf5.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <thread>

#include "checkpoint/checkpointer.h"
#include "checkpoint/checksum.h"
#include "checkpoint/chunking.h"
#include "checkpoint/fault.h"
#include "checkpoint/folder.h"
#include "checkpoint/fs.h"
#include "checkpoint/manifest.h"
#include "checkpoint/rank_file.h"
#include "checkpoint/reader.h"
#include "runtime/errors.h"
#include "runtime/store/file_store.h"
#include "tests/checkpoint/model.h"
#include "tests/support/catch_compat.h"
#include "tests/support/inputs.h"
#include "tests/support/temp_dir.h"

using namespace bulkhead;
using namespace bulkhead::checkpoint;

namespace {

// HDF5's H5_checksum_fletcher32 as the library writes it (H5checksum.c).
uint32_t referenceFletcher32(const uint8_t* data, size_t length) {
  size_t words = length / 2;
  uint32_t sum1 = 0, sum2 = 0;
  while (words) {
    size_t block = words > 360 ? 360 : words;
    words -= block;
    do {
      sum1 += static_cast<uint32_t>((data[0] << 8) | data[1]);
      data += 2;
      sum2 += sum1;
    } while (--block);
    sum1 = (sum1 & 0xffff) + (sum1 >> 16);
    sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  }
  if (length % 2) {
    sum1 += static_cast<uint32_t>(*data << 8);
    sum2 += sum1;
    sum1 = (sum1 & 0xffff) + (sum1 >> 16);
    sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  }
  sum1 = (sum1 & 0xffff) + (sum1 >> 16);
  sum2 = (sum2 & 0xffff) + (sum2 >> 16);
  return (sum2 << 16) | sum1;
}

std::vector<uint8_t> randomBytes(size_t size, uint32_t seed) {
  std::mt19937 generator(seed);
  std::vector<uint8_t> bytes(size);
  for (auto& byte : bytes) byte = static_cast<uint8_t>(generator());
  return bytes;
}

// Slices of a [rows x cols] tensor cut into a rowParts x colParts grid.
void addGrid(Manifest& manifest, const std::string& key, int64_t rows, int64_t cols, int rowParts, int colParts) {
  int tensor = static_cast<int>(manifest.tensors.size());
  manifest.tensors.push_back({key, c10::ScalarType::Float, {rows, cols}});
  for (int i = 0; i < rowParts; ++i)
    for (int j = 0; j < colParts; ++j)
      manifest.slices.push_back({.tensor = tensor,
                                 .rank = (i * colParts + j) % manifest.worldSize,
                                 .dataset = key,
                                 .offsets = {i * (rows / rowParts), j * (cols / colParts)},
                                 .shape = {rows / rowParts, cols / colParts}});
}

Manifest emptyManifest(int world) {
  Manifest manifest;
  manifest.step = 7;
  manifest.job = "0123456789abcdef";
  manifest.worldSize = world;
  for (int r = 0; r < world; ++r) manifest.files.push_back({r, rankFileName(r), 1000 + r});
  return manifest;
}

}  // namespace

TEST_CASE("fletcher32 is HDF5's Fletcher-32, bit for bit, on any length") {
  for (size_t length : {0, 1, 2, 3, 719, 720, 721, 722, 4096, 100001, 1 << 20}) {
    auto bytes = randomBytes(length, static_cast<uint32_t>(length));
    INFO("length " << length);
    CHECK(fletcher32(bytes.data(), length) == referenceFletcher32(bytes.data(), length));
  }
  std::vector<uint8_t> ones(1 << 16, 0xff);  // the largest words: the sums fold at their limit
  CHECK(fletcher32(ones.data(), ones.size()) == referenceFletcher32(ones.data(), ones.size()));
}

TEST_CASE("a rank file is read by HDF5's own filter pipeline, which verifies our checksums") {
  testing::TempDir dir("ckpt-unit");
  std::string path = dir.path() + "/rank_00000.h5";
  at::Tensor values = testing::draw(0, 1, {37, 5, 3}, at::kFloat);
  StagedSlice slice{.key = "w/x",
                    .dtype = c10::ScalarType::Float,
                    .globalShape = {37, 5, 3},
                    .offsets = {0, 0, 0},
                    .shape = {37, 5, 3},
                    .dataset = "w%2Fx"};
  slice.plan = ChunkPlan::make(slice.shape, 4, 600);  // 10 rows of 60 bytes per chunk: 4 chunks, the last short
  REQUIRE(slice.plan.count == 4);
  std::vector<uint8_t> staged(slice.plan.count * slice.plan.stagedBytes(), 0);
  for (int64_t c = 0; c < slice.plan.count; ++c)
    std::memcpy(staged.data() + c * slice.plan.stagedBytes(),
                static_cast<const uint8_t*>(values.data_ptr()) + slice.plan.firstElement(c) * 4,
                slice.plan.validElements(c) * 4);
  slice.staged = staged.data();
  std::vector<StagedSlice> slices{slice};
  int64_t size = writeRankFile(path, {"0123456789abcdef", 7, 0, 1}, slices, 2, std::nullopt);
  CHECK(size > 37 * 5 * 3 * 4);

  auto readBack = [&](at::Tensor& out) {
    hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
    REQUIRE(file >= 0);
    hid_t dataset = H5Dopen2(file, "w%2Fx", H5P_DEFAULT);
    REQUIRE(dataset >= 0);
    H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr);
    herr_t rc = H5Dread(dataset, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, out.data_ptr());
    H5Dclose(dataset);
    H5Fclose(file);
    return rc;
  };
  at::Tensor out = at::zeros({37, 5, 3});
  REQUIRE(readBack(out) >= 0);
  CHECK(at::equal(out, values));

  // One flipped bit in the data of a chunk: HDF5 itself refuses the read.
  hid_t file = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  hid_t dataset = H5Dopen2(file, "w%2Fx", H5P_DEFAULT);
  hsize_t at[3] = {10, 0, 0};
  unsigned mask = 0;
  haddr_t address = 0;
  hsize_t bytes = 0;
  REQUIRE(H5Dget_chunk_info_by_coord(dataset, at, &mask, &address, &bytes) >= 0);
  CHECK(bytes == 600 + 4);
  H5Dclose(dataset);
  H5Fclose(file);
  int fd = ::open(path.c_str(), O_RDWR);
  uint8_t byte = 0;
  REQUIRE(::pread(fd, &byte, 1, static_cast<off_t>(address + 17)) == 1);
  byte ^= 1;
  REQUIRE(::pwrite(fd, &byte, 1, static_cast<off_t>(address + 17)) == 1);
  ::close(fd);
  CHECK(readBack(out) < 0);
}

TEST_CASE("chunk plans cut a slice into even contiguous chunks and find those overlapping a box") {
  for (auto shape : std::vector<std::vector<int64_t>>{{}, {1}, {1000}, {7, 300}, {4, 6, 5}, {3, 1, 100000}}) {
    for (int64_t target : {int64_t{16}, int64_t{100}, int64_t{4096}, int64_t{1} << 22}) {
      ChunkPlan plan = ChunkPlan::make(shape, 2, target);
      INFO("shape [" << formatDims(shape) << "], target " << target);
      int64_t total = volume(plan.dims), covered = 0;
      for (int64_t c = 0; c < plan.count; ++c) {
        CHECK(plan.firstElement(c) == covered);  // contiguous, in order
        covered += plan.validElements(c);
      }
      CHECK(covered == total);
      CHECK(plan.chunkBytes() <= std::max<int64_t>(target, plan.inner * 2) + plan.inner * 2);
      ChunkPlan again;
      REQUIRE(ChunkPlan::fromFile(plan.dims, plan.chunk, 2, again));
      CHECK(again.count == plan.count);
      CHECK(again.split == plan.split);
      // A box in the middle: exactly the chunks whose elements meet it.
      std::vector<int64_t> lo(plan.dims.size()), hi(plan.dims.size());
      for (size_t d = 0; d < plan.dims.size(); ++d) {
        lo[d] = plan.dims[d] / 3;
        hi[d] = std::max(lo[d] + 1, 2 * plan.dims[d] / 3);
      }
      std::vector<int64_t> visited;
      plan.forEachOverlapping(lo, hi, [&](int64_t c) { visited.push_back(c); });
      std::vector<int64_t> expected;
      for (int64_t c = 0; c < plan.count; ++c) {
        auto at = plan.offsets(c);
        bool meets = true;
        for (size_t d = 0; d < plan.dims.size(); ++d) {
          int64_t end = std::min(plan.dims[d], at[d] + plan.chunk[d]);
          meets = meets && at[d] < hi[d] && lo[d] < end;
        }
        if (meets) expected.push_back(c);
      }
      CHECK(visited == expected);
    }
  }
}

TEST_CASE("a manifest round trips, and any change to it is caught by its checksum") {
  Manifest manifest = emptyManifest(4);
  manifest.layout = LayoutRecord{.worldSize = 4, .options = {.tp = 2, .ep = 2}};
  addGrid(manifest, "layers.0 weird key/%\n", 8, 6, 2, 2);
  manifest.slices[1].digest = 0xfeedbeefcafe1234ull;
  std::string text = manifest.serialize();
  Manifest back = Manifest::parse(text, "m", 0);
  CHECK(back.serialize() == text);
  CHECK(back.tensors[0].key == "layers.0 weird key/%\n");
  CHECK(back.slices[1].digest == 0xfeedbeefcafe1234ull);
  CHECK(back.layout->text() == manifest.layout->text());
  for (size_t at : {size_t{0}, text.size() / 3, text.size() / 2, text.size() - 30}) {
    std::string edited = text;
    edited[at] = edited[at] == '1' ? '2' : '1';
    INFO("byte " << at);
    CHECK_THROWS_AS(Manifest::parse(edited, "m", 0), CheckpointError);
  }
  CHECK_THROWS_AS(Manifest::parse(text.substr(0, text.size() / 2), "m", 0), CheckpointError);
}

TEST_CASE("coverage: a grid passes; an overlap, a gap or a slice outside the tensor is named") {
  Manifest good = emptyManifest(8);
  addGrid(good, "a", 8, 6, 2, 3);
  addGrid(good, "b", 10, 1, 5, 1);
  CHECK_NOTHROW(checkCoverage(good, 0));

  Manifest overlap = good;
  overlap.slices.push_back(overlap.slices[2]);  // the same slice written twice
  overlap.slices.back().rank = 5;
  try {
    checkCoverage(overlap, 0);
    FAIL("no error");
  } catch (const CheckpointError& error) {
    CHECK(std::string(error.what()).find("overlap") != std::string::npos);
    CHECK(std::string(error.what()).find("rank 5") != std::string::npos);
  }
  Manifest gap = good;
  gap.slices.erase(gap.slices.begin() + 4);
  try {
    checkCoverage(gap, 0);
    FAIL("no error");
  } catch (const CheckpointError& error) {
    CHECK(std::string(error.what()).find("written by no rank") != std::string::npos);
    CHECK(std::string(error.what()).find("offsets [4, 2]") != std::string::npos);
  }
  Manifest outside = good;
  outside.slices[0].offsets = {7, 0};
  CHECK_THROWS_AS(checkCoverage(outside, 0), CheckpointError);

  // Bricks: rows cut at different columns (many more cells than slices: the sweep).
  Manifest bricks = emptyManifest(2);
  bricks.tensors.push_back({"bricks", c10::ScalarType::Float, {40, 1000}});
  for (int64_t row = 0; row < 40; ++row) {
    int64_t cut = 10 + row * 23;
    bricks.slices.push_back({.tensor = 0, .rank = 0, .dataset = "x", .offsets = {row, 0}, .shape = {1, cut}});
    bricks.slices.push_back({.tensor = 0, .rank = 1, .dataset = "y", .offsets = {row, cut}, .shape = {1, 1000 - cut}});
  }
  CHECK_NOTHROW(checkCoverage(bricks, 0));
  bricks.slices[7].shape[1] += 1;
  bricks.slices[6].shape[1] -= 1;  // same volume, shifted: rows 3 overlap and leave a gap
  CHECK_THROWS_AS(checkCoverage(bricks, 0), CheckpointError);
}

TEST_CASE("coverage of 100,000 slices takes time linear in the slices (timing printed)") {
  Manifest many = emptyManifest(1000);
  for (int k = 0; k < 1000; ++k) addGrid(many, fmt::format("layers.{}.experts.w1", k), 640, 80, 10, 10);
  Manifest rows = emptyManifest(1000);
  addGrid(rows, "embedding", 100000, 8, 100000, 1);
  for (Manifest* manifest : {&many, &rows}) {
    REQUIRE(manifest->slices.size() == 100000);
    auto started = std::chrono::steady_clock::now();
    CHECK_NOTHROW(checkCoverage(*manifest, 0));
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("coverage check of %zu slices over %zu keys: %.3f s\n", manifest->slices.size(),
                manifest->tensors.size(), seconds);
    started = std::chrono::steady_clock::now();
    std::string text = manifest->serialize();
    Manifest back = Manifest::parse(text, "m", 0);
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("manifest of %zu slices (%.1f MB) written and parsed: %.3f s\n", back.slices.size(), text.size() / 1e6,
                seconds);
  }
}

TEST_CASE("fault specs parse, and a malformed one is a ConfigError showing the form") {
  auto fault = fault::parse("rank=3,step=200,action=stall:2.5");
  CHECK(fault.rank == 3);
  CHECK(fault.step == 200);
  CHECK(fault.action == fault::Action::Stall);
  CHECK(fault.stallSeconds == 2.5);
  CHECK(fault::parse("rank=0,action=commit-exit").action == fault::Action::CommitExit);
  CHECK_THROWS_AS(fault::parse("rank=1,action=explode"), ConfigError);
  CHECK_THROWS_AS(fault::parse("action=exit"), ConfigError);
  CHECK_THROWS_AS(fault::parse("rank=x,action=exit"), ConfigError);
  CHECK_THROWS_AS(fault::parse("rank=1,action=stall"), ConfigError);   // stall needs its seconds
  CHECK_THROWS_AS(fault::parse("rank=1,action=exit:3"), ConfigError);  // exit takes none
  CHECK_THROWS_AS(fault::parse("rank=1,rank=2,action=exit"), ConfigError);
}

TEST_CASE("one rank saves and loads through a file store; folder names carry the step and the job") {
  testing::TempDir dir("ckpt-unit");
  auto store = std::make_shared<FileStore>(dir.path() + "/store");
  auto ckpt = Checkpointer::create({.dir = dir.path() + "/ckpt", .timeoutSeconds = 30}, store, 0, 1);
  CHECK(ckpt->job().size() == 16);
  auto layout = parallel::Layout::create(1, {});
  testing::ckpt::ModelShape shape{.layers = 1};
  StateDict state = testing::ckpt::build(shape, layout, 0, 5);
  // Two slices of one key on one rank: two datasets in its file.
  at::Tensor two = testing::draw(0, 9, {4, 6}, at::kDouble);
  state.add("two", two.narrow(0, 0, 1).clone(), {{4, 6}, {0, 0}, 0});
  state.add("two", two.narrow(0, 1, 3).clone(), {{4, 6}, {1, 0}, 0});
  ckpt->save(3, state);
  SaveResult result = ckpt->wait(Deadline::afterSeconds(30));
  INFO(result.error);
  REQUIRE(result.ok);
  CHECK(readLatest(dir.path() + "/ckpt", 0) == 3);
  CHECK(temporaryFolderName(3, ckpt->job()) == "step_000003.tmp." + ckpt->job());
  auto targets = testing::ckpt::build(shape, layout, 0, 6);
  targets.addWhole("two", at::zeros({4, 6}, at::kDouble));
  CHECK(ckpt->load(targets).step == 3);
  CHECK(testing::ckpt::mismatches(targets, shape, 5).empty());
  CHECK(at::equal(targets.find("two")->local, two));
  // A state dict the checkpoint cannot take: ConfigError at save(), on the caller's thread.
  StateDict bad;
  bad.add("x", at::ones({4}), {{4}, {2}, 0});  // [2, 6) lies outside [0, 4)
  CHECK_THROWS_AS(ckpt->save(4, bad), ConfigError);
  CHECK_FALSE(ckpt->wait(Deadline::afterSeconds(30)).ok);
  CHECK(readLatest(dir.path() + "/ckpt", 0) == 3);
}

// The niceness of each thread of this process, by thread id: field 19 of
// /proc/self/task/<tid>/stat (a thread that ends meanwhile is left out).
std::map<int, int> threadNiceness() {
  std::map<int, int> niceness;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream stat(entry.path() / "stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const auto nameEnd = text.rfind(')');
    if (nameEnd == std::string::npos) continue;
    std::istringstream fields(text.substr(nameEnd + 1));
    std::string field;
    for (int number = 3; number <= 19 && fields >> field; ++number)
      if (number == 19) niceness[std::stoi(entry.path().filename().string())] = std::stoi(field);
  }
  return niceness;
}

TEST_CASE("a save's background part runs at the configured niceness above the caller's, which keeps its own") {
  testing::TempDir dir("ckpt-nice");
  auto store = std::make_shared<FileStore>(dir.path() + "/store");
  const auto self = static_cast<id_t>(::gettid());
  const int own = ::getpriority(PRIO_PROCESS, self);
  const int added = 7;
  if (own + added > 19) {
    WARN("this test runs at niceness " << own << ": no room above it to check");
    return;
  }
  CHECK_THROWS_AS(Checkpointer::create({.dir = dir.path() + "/bad", .backgroundNice = 20}, store, 0, 1), ConfigError);
  CHECK_THROWS_AS(Checkpointer::create({.dir = dir.path() + "/bad", .backgroundNice = -1}, store, 0, 1), ConfigError);
  // Rank 0 of 2, rank 1 absent: after writing its file the background part
  // waits for rank 1's report until the deadline, long enough to be seen.
  auto ckpt =
      Checkpointer::create({.dir = dir.path() + "/ckpt", .timeoutSeconds = 3, .backgroundNice = added}, store, 0, 2);
  StateDict state;
  state.addWhole("w", testing::draw(0, 11, {64, 32}, at::kFloat));
  const std::map<int, int> before = threadNiceness();
  ckpt->save(1, state);
  bool seen = false;
  for (int attempt = 0; attempt < 200 && !seen; ++attempt) {
    for (const auto& [tid, niceness] : threadNiceness())
      if (!before.count(tid) && niceness == own + added) seen = true;
    if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(seen);
  CHECK(::getpriority(PRIO_PROCESS, self) == own);
  SaveResult result = ckpt->wait(Deadline::afterSeconds(30));
  CHECK_FALSE(result.ok);  // rank 1 never reported
  CHECK_FALSE(readLatest(dir.path() + "/ckpt", 0).has_value());
}

TEST_CASE("reads into caller's aligned buffers (O_DIRECT where the file system has it) deliver the same bytes") {
  testing::TempDir dir("ckpt-direct");
  auto store = std::make_shared<FileStore>(dir.path() + "/store");
  auto ckpt =
      Checkpointer::create({.dir = dir.path() + "/ckpt", .timeoutSeconds = 30, .chunkBytes = 4096}, store, 0, 1);
  StateDict state;
  state.add("odd", testing::draw(0, 11, {137, 29}, at::kFloat), {{137, 29}, {0, 0}, 0});
  state.add("bf", testing::draw(0, 12, {164, 33}, at::kFloat).to(at::kBFloat16), {{164, 33}, {0, 0}, 0});
  REQUIRE(ckpt->save(1, state).wait(Deadline::afterSeconds(30)).ok);
  std::string folder = dir.path() + "/ckpt/" + stepFolderName(1);
  auto readAll = [&](bool aligned) {
    Manifest manifest = Manifest::parse(*fs::readFile(folder + "/" + kManifestName), folder, 0);
    CheckpointReader reader(folder, manifest, 0, 3);
    std::vector<CheckpointReader::Piece> pieces;
    for (int s = 0; s < static_cast<int>(manifest.slices.size()); ++s)
      for (int64_t c = 0; c < reader.plan(s).count; ++c) pieces.push_back({s, c});
    std::vector<std::string> got(pieces.size());
    std::vector<std::unique_ptr<uint8_t, decltype(&std::free)>> buffers;
    size_t bytes = static_cast<size_t>(reader.largestChunk(pieces)) + CheckpointReader::kDirectSlack;
    for (int w = 0; w < 3; ++w)
      buffers.emplace_back(
          static_cast<uint8_t*>(std::aligned_alloc(CheckpointReader::kDirectAlignment, (bytes + 4095) / 4096 * 4096)),
          &std::free);
    CheckpointReader::Acquire acquire;
    if (aligned) acquire = [&](int worker, size_t) { return buffers.at(worker).get(); };
    reader.read(
        pieces,
        [&](int, const CheckpointReader::Piece& piece, const uint8_t* chunk) {
          got[&piece - pieces.data()].assign(reinterpret_cast<const char*>(chunk),
                                             reader.plan(piece.slice).chunkBytes());
        },
        acquire);
    return got;
  };
  auto buffered = readAll(false);
  REQUIRE(buffered.size() > 4);
  CHECK(readAll(true) == buffered);
  // A truncated file is caught on that path too.
  std::string file = folder + "/" + rankFileName(0);
  REQUIRE(::truncate(file.c_str(), *fs::fileSize(file) - 3000) == 0);
  CHECK_THROWS_AS(readAll(true), CheckpointError);
}
