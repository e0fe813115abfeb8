// Round trips under mpirun: what is saved loads back bitwise, with its
// non-tensor state; a save copies the tensors before it returns; old
// checkpoints beyond `keep` are removed; an incompatible state dict fails the
// load on every rank.

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <functional>

#include "checkpoint/checkpointer.h"
#include "checkpoint/folder.h"
#include "checkpoint/inspect.h"
#include "runtime/errors.h"
#include "tests/checkpoint/model.h"
#include "tests/checkpoint/support.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;
using namespace bulkhead::checkpoint;
using namespace bulkhead::testing::ckpt;

namespace {

std::unique_ptr<Checkpointer> open(const std::string& dir, CheckpointOptions options = {}) {
  options.dir = dir;
  if (!options.timeoutSeconds) options.timeoutSeconds = 60;
  return Checkpointer::create(options, runtime().store(), rank(), worldSize());
}

parallel::Layout layout(parallel::LayoutOptions options) { return parallel::Layout::create(worldSize(), options); }

}  // namespace

TEST_CASE("a saved state dict loads back bitwise, with its rng, data position, layout and user blob") {
  SharedDir dir("ckpt-roundtrip");
  auto ckpt = open(dir.path());
  ModelShape shape;
  auto saved = layout({.tp = 2, .ep = 2});
  auto state = build(shape, saved, rank(), 11);
  SaveHandle handle = ckpt->save(100, state);
  // The save copied the tensors before returning: changing them now does not change the checkpoint.
  for (auto& entry : state.tensors) entry.local.zero_();
  SaveResult result = handle.wait(Deadline::afterSeconds(60));
  INFO(result.error);
  REQUIRE(result.ok);
  CHECK(result.path == dir.path() + "/step_000100");
  CHECK(result.bytes > 0);

  auto targets = build(shape, saved, rank(), 12);
  REQUIRE(!mismatches(targets, shape, 11).empty());  // the targets start different
  LoadResult loaded = ckpt->load(targets);
  CHECK(loaded.step == 100);
  CHECK(mismatches(targets, shape, 11).empty());
  CHECK(loaded.rankStateFound);
  CHECK(loaded.dataPosition == dataPositionOf(rank(), 11));
  CHECK(loaded.rng.size() == 2);
  CHECK(loaded.rng["torch.cpu"] == rngOf(rank(), 11));
  CHECK(loaded.rng["cuda:0"] == rngOf(rank(), 12));
  CHECK(loaded.user["blob"] == userBlobOf(11));
  CHECK(loaded.user["config"] == "seed=11 layers=2");
  REQUIRE(loaded.layout);
  CHECK(loaded.layout->text() == LayoutRecord::of(saved).text());
  CHECK(loaded.savedWorldSize == worldSize());
  if (rank() == 0) {
    CHECK(run(fmt::format("{} verify {} > /dev/null", BULKHEAD_CKPT_TOOL, dir.path())) == 0);
    // Plain HDF5 tools read every dataset, verifying the Fletcher-32 checksums we wrote.
    if (run("command -v h5dump > /dev/null") == 0)
      for (int r = 0; r < worldSize(); ++r)
        CHECK(run(fmt::format("h5dump {}/step_000100/rank_{:05d}.h5 > /dev/null", dir.path(), r)) == 0);
    else
      WARN("h5dump not installed: not checked");
  }
}

TEST_CASE("each save commits a new step and moves latest; checkpoints beyond keep are removed") {
  SharedDir dir("ckpt-keep");
  auto ckpt = open(dir.path(), {.keep = 2});
  ModelShape shape{.layers = 1};
  auto saved = layout({.ep = 2});
  for (int step : {10, 20, 30, 40}) {
    ckpt->save(step, build(shape, saved, rank(), step));
    SaveResult result = ckpt->wait(Deadline::afterSeconds(60));
    INFO(result.error);
    REQUIRE(result.ok);
    CHECK(readLatest(dir.path(), rank()) == step);
  }
  barrier();
  std::vector<int64_t> committed;
  for (const auto& step : listCheckpoints(dir.path())) {
    CHECK(step.state == "committed");
    committed.push_back(step.step);
  }
  CHECK(committed == std::vector<int64_t>{30, 40});
  auto targets = build(shape, saved, rank(), 1);
  CHECK(ckpt->load(targets, {.step = 30}).step == 30);
  CHECK(mismatches(targets, shape, 30).empty());
  CHECK(ckpt->load(targets).step == 40);
  CHECK(mismatches(targets, shape, 40).empty());
}

TEST_CASE("a run resumed from an earlier step commits its own steps; the later ones it went back from move aside") {
  SharedDir dir("ckpt-rollback");
  ModelShape shape{.layers = 1};
  auto saved = layout({.ep = 2});
  {
    auto first = open(dir.path(), {.keep = 0});
    for (int step : {10, 20, 30}) {
      first->save(step, build(shape, saved, rank(), step));
      REQUIRE(first->wait(Deadline::afterSeconds(60)).ok);
    }
  }
  // A job that never loaded still refuses an existing step: it may be another job's. So does one
  // that only read an earlier step.
  auto stranger = open(dir.path());
  stranger->save(20, build(shape, saved, rank(), 99));
  SaveResult refused = stranger->wait(Deadline::afterSeconds(60));
  CHECK_FALSE(refused.ok);
  CHECK(refused.error.find("already exists") != std::string::npos);
  auto evaluated = build(shape, saved, rank(), 2);
  REQUIRE(stranger->load(evaluated, {.step = 10, .resume = false}).step == 10);
  stranger->save(20, build(shape, saved, rank(), 98));
  CHECK_FALSE(stranger->wait(Deadline::afterSeconds(60)).ok);
  CHECK(readLatest(dir.path(), rank()) == 30);

  // Went back to step 10 (say, past a loss spike), the run saves 20 and 30 again.
  auto resumed = open(dir.path(), {.keep = 3});
  auto targets = build(shape, saved, rank(), 1);
  REQUIRE(resumed->load(targets, {.step = 10}).step == 10);
  const std::string job = resumed->job();
  resumed->save(20, build(shape, saved, rank(), 120));
  SaveResult twenty = resumed->wait(Deadline::afterSeconds(60));
  INFO(twenty.error);
  REQUIRE(twenty.ok);
  CHECK(readLatest(dir.path(), rank()) == 20);
  barrier();
  std::vector<std::pair<int64_t, std::string>> folders;
  for (const auto& step : listCheckpoints(dir.path())) folders.emplace_back(step.step, step.name);
  CHECK(folders == std::vector<std::pair<int64_t, std::string>>{{10, "step_000010"},
                                                                {20, "step_000020"},
                                                                {20, supersededFolderName(20, job)},
                                                                {30, supersededFolderName(30, job)}});
  for (const auto& step : listCheckpoints(dir.path()))
    if (step.name.find("superseded") != std::string::npos) {
      CHECK(step.state == "superseded (left by a resumed run)");
      CHECK(step.files == worldSize());  // moved whole, not deleted
    }
  CHECK(resumed->load(targets).step == 20);
  CHECK(mismatches(targets, shape, 120).empty());

  // Later saves commit as usual, and later commits move nothing more aside.
  resumed->save(30, build(shape, saved, rank(), 130));
  REQUIRE(resumed->wait(Deadline::afterSeconds(60)).ok);
  resumed->save(40, build(shape, saved, rank(), 140));
  REQUIRE(resumed->wait(Deadline::afterSeconds(60)).ok);
  barrier();
  std::vector<std::string> names;
  for (const auto& step : listCheckpoints(dir.path())) names.push_back(step.name);
  CHECK(names == std::vector<std::string>{"step_000020", supersededFolderName(20, job), "step_000030",
                                          supersededFolderName(30, job), "step_000040"});
  for (auto [step, seed] : {std::pair<int64_t, int>{20, 120}, {30, 130}, {40, 140}}) {
    INFO("step " << step);
    CHECK(resumed->load(targets, {.step = step}).step == step);
    CHECK(mismatches(targets, shape, seed).empty());
  }

  // Going back again in the same process, after saves: to 20, then twice over step 30, the second
  // time over the step `latest` names. Each superseded copy keeps a name of its own.
  for (int seed : {230, 330}) {
    REQUIRE(resumed->load(targets, {.step = 20}).step == 20);
    resumed->save(30, build(shape, saved, rank(), seed));
    SaveResult again = resumed->wait(Deadline::afterSeconds(60));
    INFO(again.error);
    REQUIRE(again.ok);
    CHECK(readLatest(dir.path(), rank()) == 30);
    CHECK(resumed->load(targets).step == 30);
    CHECK(mismatches(targets, shape, seed).empty());
  }
  barrier();
  names.clear();
  for (const auto& step : listCheckpoints(dir.path())) names.push_back(step.name);
  CHECK(names == std::vector<std::string>{"step_000020", supersededFolderName(20, job), "step_000030",
                                          supersededFolderName(30, job), supersededFolderName(30, job + ".2"),
                                          supersededFolderName(30, job + ".3"), supersededFolderName(40, job)});
}

TEST_CASE("a key missing from the checkpoint or of another shape fails the load on every rank") {
  SharedDir dir("ckpt-incompatible");
  auto ckpt = open(dir.path());
  ModelShape shape{.layers = 1};
  auto saved = layout({.tp = 2});
  ckpt->save(5, build(shape, saved, rank(), 5));
  REQUIRE(ckpt->wait(Deadline::afterSeconds(60)).ok);

  auto targets = build(shape, saved, rank(), 6);
  if (rank() == 1) targets.addWhole("layers.9.new_weight", at::ones({4}));
  try {
    ckpt->load(targets);
    FAIL("the load succeeded");
  } catch (const CheckpointError& error) {
    std::string text = error.what();
    INFO(text);
    CHECK(text.find("layers.9.new_weight") != std::string::npos);
    if (rank() != 1) CHECK(text.find("failed on rank 1") != std::string::npos);
  }
  LoadResult lenient = ckpt->load(targets, {.allowMissing = true});
  CHECK(lenient.missingKeys ==
        (rank() == 1 ? std::vector<std::string>{"layers.9.new_weight"} : std::vector<std::string>{}));
  CHECK(mismatches(targets, shape, 5).empty());

  ModelShape wider{.layers = 1, .hidden = 32};
  auto other = build(wider, saved, rank(), 7);
  try {
    ckpt->load(other);
    FAIL("the load succeeded");
  } catch (const CheckpointError& error) {
    INFO(error.what());
    CHECK(std::string(error.what()).find("the checkpoint holds") != std::string::npos);
  }
}

TEST_CASE("a load with no step to load is a CheckpointError whose hint runs as written") {
  SharedDir dir("ckpt-empty");
  auto ckpt = open(dir.path());
  auto targets = build(ModelShape{.layers = 1}, layout({}), rank(), 1);
  // Each error names `bulkhead-ckpt list DIR`; run as written, it lists the folder, committed steps included.
  auto refusedWithHint = [&](const char* what, const std::function<void()>& load, const std::string& listed) {
    INFO(what);
    try {
      load();
      FAIL("the load succeeded");
    } catch (const CheckpointError& error) {
      if (rank() != 0) return;
      INFO(error.what());
      auto hints = runHints(error.what(), dir.path());
      REQUIRE(!hints.empty());
      for (const auto& hint : hints) {
        INFO(hint.hint << " printed: " << hint.output);
        CHECK(hint.code == 0);
        CHECK(hint.output.find(listed) != std::string::npos);
      }
    }
  };
  refusedWithHint(
      "no latest", [&] { ckpt->load(targets); }, "");
  refusedWithHint(
      "a step never saved", [&] { ckpt->load(targets, {.step = 7}); }, "");
  ckpt->save(5, build(ModelShape{.layers = 1}, layout({}), rank(), 5));
  REQUIRE(ckpt->wait(Deadline::afterSeconds(60)).ok);
  if (rank() == 0) std::filesystem::create_directory(dir.path() + "/" + temporaryFolderName(9, "0123456789abcdef"));
  barrier();
  refusedWithHint(
      "a partial step", [&] { ckpt->load(targets, {.step = 9}); }, "step_000005");
  refusedWithHint(
      "a step never saved, beside one", [&] { ckpt->load(targets, {.step = 7}); }, "step_000005");
  if (rank() == 0) std::ofstream(dir.path() + "/latest", std::ios::trunc) << "edited by hand\n";
  barrier();
  refusedWithHint(
      "latest edited by hand", [&] { ckpt->load(targets); }, "step_000005");
}

TEST_CASE("with continueOnFailure false, a failed save raises from wait() on every rank, once") {
  SharedDir dir("ckpt-strict");
  ModelShape shape{.layers = 1};
  auto saved = layout({.ep = 2});
  auto state = build(shape, saved, rank(), 3);
  auto ckpt = open(dir.path(), {.continueOnFailure = false});
  ckpt->reserve(state);
  ckpt->save(8, state);
  REQUIRE(ckpt->wait(Deadline::afterSeconds(60)).ok);
  ckpt->save(8, state);  // the step exists: this save is dropped
  try {
    ckpt->wait(Deadline::afterSeconds(60));
    FAIL("the failed save did not raise");
  } catch (const CheckpointError& error) {
    INFO(error.what());
    CHECK(std::string(error.what()).find("already exists") != std::string::npos);
  }
  CHECK_FALSE(ckpt->wait(Deadline::afterSeconds(60)).ok);  // raised once; the result stays readable
  CHECK(readLatest(dir.path(), rank()) == 8);
  auto targets = build(shape, saved, rank(), 4);
  CHECK(ckpt->load(targets).step == 8);
  CHECK(mismatches(targets, shape, 3).empty());
}
