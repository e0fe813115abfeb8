// The process-group manager on 8 ranks (CTest groups_np8): for several
// layouts every group is built, warmed with the traffic it will carry, holds
// exactly the layout's ranks, and reduces seeded data correctly; a layout that
// does not fit the world fails on every rank before any communication.
#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "parallel/process_groups.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"

using namespace bulkhead;
using namespace bulkhead::parallel;
using namespace bulkhead::testing;

namespace {

// Bootstrap in tests: generous for 8 oversubscribed ranks on 2 cores, but bounded.
ProcessGroupOptions testOptions(int64_t warmupBytes) {
  return {.deadline = Deadline::after(std::chrono::seconds(60)), .warmupBytes = warmupBytes};
}

// The operations the manager's warm-up left in a group's ledger.
// Names, so a failed check prints them.
std::vector<std::string> warmupOps(const Communicator& comm) {
  std::vector<std::string> ops;
  for (const LedgerEntry& entry : comm.ledger().entries()) ops.push_back(toString(entry.fingerprint.op));
  return ops;
}

void checkLayout(const LayoutOptions& options, int64_t warmupBytes) {
  int me = world().rank();
  Layout layout = Layout::create(world().size(), options);
  ProcessGroups groups = ProcessGroups::create(worldPtr(), layout, testOptions(warmupBytes));
  REQUIRE(groups.report().size() == allGroupKinds().size());

  for (GroupKind kind : allGroupKinds()) {
    INFO(fmt::format("rank {}, kind {}", me, toString(kind)));
    const CommunicatorPtr& comm = groups.get(kind);
    std::vector<int> expected = layout.groupOf(kind, me);
    const GroupReport& row = groups.report()[static_cast<size_t>(kind)];
    CHECK(row.kind == kind);
    CHECK(row.members == expected);
    if (expected.empty()) {  // only embedding, on middle pipeline stages
      CHECK(comm == nullptr);
      continue;
    }
    REQUIRE(comm != nullptr);
    CHECK(comm->members() == expected);
    CHECK(comm->name() == fmt::format("{}[{}]", toString(kind), layout.groupIndex(kind, me)));
    CHECK(row.name == comm->name());

    // Warm-up: each group of two or more carried its own kind of traffic once.
    std::vector<std::string> ops = warmupOps(*comm);
    if (comm->size() == 1) {
      CHECK(ops.empty());
    } else if (kind == GroupKind::Ep) {
      CHECK(ops == std::vector<std::string>{toString(OpType::AllToAll)});
    } else if (kind == GroupKind::Pp) {
      // Around the ring both ways (the interleaved schedule's wrap included):
      // a send to and a receive from each neighbour.
      CHECK(std::count(ops.begin(), ops.end(), toString(OpType::Send)) == 2);
      CHECK(std::count(ops.begin(), ops.end(), toString(OpType::Recv)) == 2);
      CHECK(ops.size() == 4);
    } else {
      CHECK(ops == std::vector<std::string>{toString(OpType::AllReduce)});
    }
    if (comm->size() > 1) CHECK(row.warmMs > 0);

    // Each member's seeded tensor, summed over the group: the reference every
    // rank computes alone.
    int salt = 100 + static_cast<int>(kind);
    at::Tensor mine = draw(me, salt, {257}, at::kFloat);
    comm->allReduce(mine, {.deadline = Deadline::after(std::chrono::seconds(60))})->wait();
    at::Tensor want = at::zeros({257});
    for (int member : expected) want += draw(member, salt, {257}, at::kFloat);
    CHECK(at::equal(mine, want));
  }

  // The pipeline neighbours are the adjacent stages of this rank's pp group.
  std::vector<int> stages = layout.groupOf(GroupKind::Pp, me);
  auto at = std::find(stages.begin(), stages.end(), me) - stages.begin();
  auto [prev, next] = groups.pipelinePeers();
  CHECK(prev == (at > 0 ? stages[at - 1] : -1));
  CHECK(next == (at + 1 < static_cast<long>(stages.size()) ? stages[at + 1] : -1));

  std::string table = groups.formatReport();
  for (GroupKind kind : allGroupKinds()) CHECK(table.find(toString(kind)) != std::string::npos);
}

}  // namespace

TEST_CASE("every group of tp2 ep2 is built, warmed (1 MiB), holds the layout's ranks and reduces correctly") {
  REQUIRE(world().size() == 8);
  checkLayout({.tp = 2, .ep = 2}, int64_t{1} << 20);
}

TEST_CASE("tp2 pp2 ep2: pipeline groups warm with send/recv both ways, embedding groups pair first and last stage") {
  REQUIRE(world().size() == 8);
  checkLayout({.tp = 2, .pp = 2, .ep = 2}, 64 << 10);
}

TEST_CASE("tp4 etp2 ep2 pp1: the expert grid differs from the dense grid") {
  REQUIRE(world().size() == 8);
  checkLayout({.tp = 4, .ep = 2, .etp = 2}, 64 << 10);
}

TEST_CASE("cp2 ep4 with 2 optimizer instances: expert-dp intra and inter instance groups") {
  REQUIRE(world().size() == 8);
  checkLayout({.cp = 2, .ep = 4, .optimizerInstances = 2}, 64 << 10);
}

TEST_CASE("pure ep8: one all-to-all group of every rank, every other group of one rank but ep's dp") {
  REQUIRE(world().size() == 8);
  checkLayout({.ep = 8}, 64 << 10);
}

TEST_CASE("pp4 tp2 with a non-default order: middle stages are in no embedding group") {
  REQUIRE(world().size() == 8);
  checkLayout({.tp = 2, .pp = 4, .order = "cp-tp-dp-ep-pp"}, 16 << 10);
}

TEST_CASE("a layout that does not fit the world is a ConfigError on every rank before any communication") {
  REQUIRE(world().size() == 8);
  uint64_t before = world().ledger().heads().lastIssued;
  auto messageOf = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "no ConfigError";
  };
  // tp 3 does not divide 8.
  std::string notDividing =
      messageOf([] { ProcessGroups::create(worldPtr(), LayoutOptions{.tp = 3}, testOptions(1)); });
  CHECK(notDividing.find("ConfigError") != std::string::npos);
  CHECK(notDividing.find("3") != std::string::npos);
  // ep 16 needs more ranks than the world has.
  std::string expertTooBig =
      messageOf([] { ProcessGroups::create(worldPtr(), LayoutOptions{.ep = 16}, testOptions(1)); });
  CHECK(expertTooBig.find("ConfigError") != std::string::npos);
  // A layout computed for another world size.
  std::string wrongWorld =
      messageOf([] { ProcessGroups::create(worldPtr(), Layout::create(4, {.tp = 2}), testOptions(1)); });
  CHECK(wrongWorld.find("the layout is for 4 ranks but the world has 8") != std::string::npos);
  CHECK(world().ledger().heads().lastIssued == before);
}
