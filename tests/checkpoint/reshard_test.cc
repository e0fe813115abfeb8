// Resharding under mpirun: a checkpoint saved under one layout loads bitwise
// under another (ep 4 -> 2 and 8, tp 2 -> 1, etp, dp changes), expert and
// optimizer state included, and each rank reads only the chunks that overlap
// its slices.

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "checkpoint/checkpointer.h"
#include "checkpoint/dtype.h"
#include "runtime/errors.h"
#include "tests/checkpoint/model.h"
#include "tests/checkpoint/support.h"
#include "tests/support/catch_compat.h"
#include "tests/support/inputs.h"

using namespace bulkhead;
using namespace bulkhead::checkpoint;
using namespace bulkhead::testing::ckpt;

namespace {

std::string describe(const parallel::LayoutOptions& o) { return fmt::format("tp {} ep {} etp {}", o.tp, o.ep, o.etp); }

int64_t bytesHeld(const StateDict& state) {
  int64_t bytes = 0;
  for (const auto& entry : state.tensors) bytes += entry.local.numel() * entry.local.element_size();
  return bytes;
}

}  // namespace

TEST_CASE("a checkpoint saved under one layout loads bitwise under any other") {
  int world = worldSize();
  ModelShape shape;
  std::vector<parallel::LayoutOptions> saves = {{.ep = std::min(4, world)}, {.tp = 2, .ep = 2}};
  std::vector<parallel::LayoutOptions> loads = {
      {.ep = 2}, {.ep = world}, {.tp = 1}, {.tp = 2, .ep = 2, .etp = 2}, {.tp = world / 2, .ep = 1}};
  for (const auto& savedOptions : saves) {
    SharedDir dir("ckpt-reshard");
    // Small chunks, so that reading only the overlapping ones shows in the byte count.
    auto ckpt = Checkpointer::create({.dir = dir.path(), .timeoutSeconds = 60, .chunkBytes = 4096}, runtime().store(),
                                     rank(), world);
    auto saved = parallel::Layout::create(world, savedOptions);
    ckpt->save(200, build(shape, saved, rank(), 21));
    SaveResult result = ckpt->wait(Deadline::afterSeconds(60));
    INFO(result.error);
    REQUIRE(result.ok);
    for (const auto& loadOptions : loads) {
      INFO("saved under " << describe(savedOptions) << ", loaded under " << describe(loadOptions));
      auto now = parallel::Layout::create(world, loadOptions);
      auto targets = build(shape, now, rank(), 22);
      LoadResult loaded = ckpt->load(targets);
      CHECK(loaded.step == 200);
      auto wrong = mismatches(targets, shape, 21);
      INFO("mismatching keys: " << fmt::format("{}", fmt::join(wrong, ", ")));
      CHECK(wrong.empty());
      // Whole chunks of 4 KiB at most around each slice: never the whole checkpoint.
      int64_t needed = bytesHeld(targets);
      CHECK(loaded.bytesRead <= 2 * needed + 8192 * static_cast<int64_t>(targets.tensors.size()));
      CHECK(loaded.bytesRead >= needed);
    }
  }
}

TEST_CASE("uneven and empty slices round trip, and a key split along two dimensions reassembles") {
  SharedDir dir("ckpt-uneven");
  int world = worldSize();
  auto ckpt = Checkpointer::create({.dir = dir.path(), .timeoutSeconds = 60, .chunkBytes = 4096}, runtime().store(),
                                   rank(), world);
  // Rows split unevenly: rank r holds r rows (rank 0 none) of a [sum, 33] tensor; a
  // [6, 10] int64 tensor cut in a 2 x (world/2) grid.
  int64_t rows = int64_t{world} * (world - 1) / 2, before = int64_t{rank()} * (rank() - 1) / 2;
  at::Tensor uneven = testing::draw(1, 7, {rows, 33}, at::kBFloat16);
  at::Tensor grid = testing::draw(1, 8, {6, int64_t{world} * 5}, at::kLong);
  int cols = world / 2;
  int64_t r0 = (rank() / cols) * 3, c0 = (rank() % cols) * 10;
  StateDict state;
  state.add("uneven", uneven.narrow(0, before, rank()).clone(), {{rows, 33}, {before, 0}, 0});
  state.add("grid", grid.narrow(0, r0, 3).narrow(1, c0, 10).clone(), {{6, int64_t{world} * 5}, {r0, c0}, 0});
  ckpt->save(1, state);
  SaveResult result = ckpt->wait(Deadline::afterSeconds(60));
  INFO(result.error);
  REQUIRE(result.ok);
  StateDict whole;
  whole.addWhole("uneven", at::zeros({rows, 33}, at::kBFloat16), rank());
  whole.addWhole("grid", at::zeros({6, int64_t{world} * 5}, at::kLong), rank());
  ckpt->load(whole);
  CHECK(bitwiseEqual(whole.find("uneven")->local, uneven));
  CHECK(bitwiseEqual(whole.find("grid")->local, grid));
}
