// A damaged checkpoint never loads: a flipped byte in a chunk or in HDF5
// metadata, a truncated or deleted rank file and a hand-edited manifest each
// make load raise CheckpointError on every rank, and `bulkhead-ckpt verify`
// exit non-zero; the command each error tells its reader to run finds the damage. Two checkpointers (two jobs) saving into one folder, even the
// same step at once, never damage each other's checkpoints.

#include <fcntl.h>
#include <fmt/format.h>
#include <hdf5.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "checkpoint/checkpointer.h"
#include "checkpoint/folder.h"
#include "checkpoint/fs.h"
#include "checkpoint/inspect.h"
#include "runtime/errors.h"
#include "tests/checkpoint/model.h"
#include "tests/checkpoint/support.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;
using namespace bulkhead::checkpoint;
using namespace bulkhead::testing::ckpt;

namespace {

// The file offset of the first chunk of `dataset` (read with HDF5 itself).
uint64_t chunkAddress(const std::string& file, const std::string& dataset) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  REQUIRE(f >= 0);
  hid_t d = H5Dopen2(f, dataset.c_str(), H5P_DEFAULT);
  REQUIRE(d >= 0);
  hsize_t offsets[3] = {0, 0, 0};
  unsigned mask = 0;
  haddr_t address = 0;
  hsize_t size = 0;
  REQUIRE(H5Dget_chunk_info_by_coord(d, offsets, &mask, &address, &size) >= 0);
  H5Dclose(d);
  H5Fclose(f);
  return address;
}

void flipByte(const std::string& path, uint64_t offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  unsigned char byte = 0;
  REQUIRE(::pread(fd, &byte, 1, static_cast<off_t>(offset)) == 1);
  byte ^= 0x20;
  REQUIRE(::pwrite(fd, &byte, 1, static_cast<off_t>(offset)) == 1);
  ::close(fd);
}

enum class Damage { ChunkByte, MetadataByte, Truncate, Delete, EditManifest };

const char* nameOf(Damage damage) {
  switch (damage) {
    case Damage::ChunkByte:
      return "a flipped byte in a chunk";
    case Damage::MetadataByte:
      return "a flipped byte in the HDF5 superblock";
    case Damage::Truncate:
      return "a truncated rank file";
    case Damage::Delete:
      return "a deleted rank file";
    case Damage::EditManifest:
      return "a hand-edited manifest";
  }
  return "?";
}

void damage(Damage kind, const std::string& folder) {
  std::string victim = folder + "/rank_00001.h5";
  switch (kind) {
    case Damage::ChunkByte:
      flipByte(victim, chunkAddress(victim, "layers.0.experts.w1") + 100);
      break;
    case Damage::MetadataByte:
      flipByte(victim, 20);
      break;
    case Damage::Truncate:
      REQUIRE(::truncate(victim.c_str(), *fs::fileSize(victim) / 2) == 0);
      break;
    case Damage::Delete:
      REQUIRE(::unlink(victim.c_str()) == 0);
      break;
    case Damage::EditManifest: {
      std::string path = folder + "/manifest.txt";
      std::string text = *fs::readFile(path);
      size_t at = text.find("\nslice ");
      REQUIRE(at != std::string::npos);
      text[text.find(" 0,", at) + 1] = '1';  // one slice now claims to start elsewhere
      std::ofstream(path, std::ios::trunc) << text;
      break;
    }
  }
}

}  // namespace

TEST_CASE("every kind of damage to a checkpoint is caught by load on every rank and by bulkhead-ckpt verify") {
  ModelShape shape;
  auto layout = parallel::Layout::create(worldSize(), {.tp = 2, .ep = 2});
  for (Damage kind :
       {Damage::ChunkByte, Damage::MetadataByte, Damage::Truncate, Damage::Delete, Damage::EditManifest}) {
    INFO(nameOf(kind));
    SharedDir dir("ckpt-damage");
    auto ckpt = Checkpointer::create({.dir = dir.path(), .timeoutSeconds = 60}, runtime().store(), rank(), worldSize());
    ckpt->save(100, build(shape, layout, rank(), 31));
    SaveResult result = ckpt->wait(Deadline::afterSeconds(60));
    INFO(result.error);
    REQUIRE(result.ok);
    std::string folder = dir.path() + "/step_000100";
    if (rank() == 0) {
      REQUIRE(run(fmt::format("{} verify {} > /dev/null", BULKHEAD_CKPT_TOOL, dir.path())) == 0);
      REQUIRE(run(fmt::format("{} verify {} > /dev/null", BULKHEAD_CKPT_TOOL, folder)) == 0);  // its step folder
      damage(kind, folder);
    }
    barrier();
    auto targets = build(shape, layout, rank(), 32);
    try {
      ckpt->load(targets);
      FAIL("the damaged checkpoint loaded");
    } catch (const CheckpointError& error) {
      std::string text = error.what();
      INFO(text);
      bool named = kind == Damage::EditManifest ? text.find("manifest.txt") != std::string::npos
                                                : text.find("rank_00001.h5") != std::string::npos;
      CHECK(named);
      CHECK(text.find("bulkhead-ckpt verify") != std::string::npos);  // says what to do
      if (rank() == 0) {  // and what it says runs as written: it finds the damage
        auto hints = runHints(text, dir.path());
        REQUIRE(!hints.empty());
        for (const auto& hint : hints) {
          INFO(hint.hint << " printed: " << hint.output);
          CHECK(hint.code == 1);
          CHECK(hint.output.find("fault") != std::string::npos);
          CHECK(hint.output.find(kind == Damage::EditManifest ? "manifest" : "rank_00001.h5") != std::string::npos);
        }
      }
    }
    if (rank() == 0) {
      std::string log = dir.path() + "/verify.log";
      int code = run(fmt::format("{} verify {} > {} 2>&1", BULKHEAD_CKPT_TOOL, dir.path(), log));
      std::string output = fs::readFile(log).value_or("");
      INFO(output);
      CHECK(code == 1);
      CHECK(output.find("fault") != std::string::npos);
      if (kind == Damage::ChunkByte && run("command -v h5dump > /dev/null") == 0)  // HDF5 itself sees the checksum fail
        CHECK(run(fmt::format("h5dump {}/rank_00001.h5 > /dev/null 2>&1", folder)) != 0);
    }
    barrier();
  }
}

TEST_CASE("two jobs saving into one folder, the same step at once included, keep every checkpoint intact") {
  SharedDir dir("ckpt-two-jobs");
  ModelShape shape{.layers = 1};
  auto layout = parallel::Layout::create(worldSize(), {.ep = 2});
  auto first = Checkpointer::create({.dir = dir.path(), .keep = 0, .timeoutSeconds = 60}, runtime().store(), rank(),
                                    worldSize());
  auto second = Checkpointer::create({.dir = dir.path(), .keep = 0, .timeoutSeconds = 60}, runtime().store(), rank(),
                                     worldSize());
  REQUIRE(first->job() != second->job());
  // Interleaved and concurrent: each save of one job overlaps a save of the other.
  SaveHandle a100 = first->save(100, build(shape, layout, rank(), 1));
  SaveHandle b200 = second->save(200, build(shape, layout, rank(), 2));
  SaveHandle a200 = first->save(200, build(shape, layout, rank(), 1));
  SaveHandle b300 = second->save(300, build(shape, layout, rank(), 2));
  auto deadline = Deadline::afterSeconds(60);
  SaveResult r100 = a100.wait(deadline), rb200 = b200.wait(deadline), ra200 = a200.wait(deadline),
             r300 = b300.wait(deadline);
  CHECK(r100.ok);
  CHECK(r300.ok);
  CHECK(rb200.ok != ra200.ok);  // one of the two saves of step 200 wins, the other is dropped cleanly
  const SaveResult& dropped = rb200.ok ? ra200 : rb200;
  CHECK(dropped.error.find("already exists") != std::string::npos);
  int winner = rb200.ok ? 2 : 1;
  barrier();
  if (rank() == 0) CHECK(run(fmt::format("{} verify {} --step all > /dev/null", BULKHEAD_CKPT_TOOL, dir.path())) == 0);
  for (auto [step, seed] : {std::pair<int64_t, int>{100, 1}, {200, winner}, {300, 2}}) {
    auto targets = build(shape, layout, rank(), 9);
    CHECK(first->load(targets, {.step = step}).step == step);
    INFO("step " << step);
    CHECK(mismatches(targets, shape, seed).empty());
  }
  for (const auto& step : listCheckpoints(dir.path())) CHECK(step.state == "committed");
}
