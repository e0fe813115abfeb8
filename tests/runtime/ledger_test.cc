#include "runtime/diagnosis/ledger.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;

namespace {
Fingerprint collective(OpType op, int64_t rows, int64_t cols, c10::ScalarType dtype = c10::ScalarType::Float) {
  return {.op = op, .dtype = dtype, .numel = rows * cols, .shape = {rows, cols}};
}
}  // namespace

TEST_CASE("the ledger numbers collectives and point-to-point operations apart, from 1") {
  Ledger ledger(16);
  CHECK(ledger.issue(collective(OpType::AllReduce, 4, 4)) == 1);
  CHECK(ledger.issue({.op = OpType::Send, .root = 1}) == 1);
  CHECK(ledger.issue(collective(OpType::AllGather, 4, 4)) == 2);
  CHECK(ledger.issue({.op = OpType::Recv, .root = 1}) == 2);
  LedgerHeads heads = ledger.heads();
  CHECK(heads.lastIssued == 2);
  CHECK(heads.lastIssuedP2P == 2);
  CHECK(heads.lastCompleted == 0);

  ledger.complete(OpType::AllReduce, 1);
  ledger.complete(OpType::Send, 1);
  ledger.fail(OpType::AllGather, 2);
  heads = ledger.heads();
  CHECK(heads.lastCompleted == 1);
  CHECK(heads.lastCompletedP2P == 1);
  auto entries = ledger.entries();
  REQUIRE(entries.size() == 4);
  CHECK(entries[0].state == OpState::Completed);
  CHECK(entries[2].state == OpState::Failed);
  CHECK(entries[3].state == OpState::Issued);
}

TEST_CASE("the ledger is a bounded ring that keeps the newest entries") {
  Ledger ledger(3);
  for (int i = 0; i < 10; ++i) ledger.issue(collective(OpType::AllReduce, 1, i + 1));
  auto entries = ledger.entries();
  REQUIRE(entries.size() == 3);
  CHECK(entries.front().seq == 8);
  CHECK(entries.back().seq == 10);
  CHECK(ledger.heads().lastIssued == 10);
}

TEST_CASE("a fingerprint describes itself the way timeout reports quote it") {
  CHECK(collective(OpType::AllToAll, 4096, 2048, c10::ScalarType::BFloat16)
            .describe()
            .rfind("all_to_all bfloat16 [4096 x 2048]", 0) == 0);
  CHECK(collective(OpType::AllReduce, 8, 1).describe() == "all_reduce float32 [8 x 1] sum");
  CHECK(Fingerprint{.op = OpType::Barrier}.describe() == "barrier");
}

TEST_CASE("fingerprints match when ranks issue the same collective") {
  Fingerprint a = collective(OpType::AllReduce, 8, 8);
  CHECK(a.matches(collective(OpType::AllReduce, 8, 8)));
  CHECK_FALSE(a.matches(collective(OpType::AllReduce, 8, 9)));
  CHECK_FALSE(a.matches(collective(OpType::AllGather, 8, 8)));
  CHECK_FALSE(a.matches(collective(OpType::AllReduce, 8, 8, c10::ScalarType::BFloat16)));
  Fingerprint max = a;
  max.reduce = ReduceOp::Max;
  CHECK_FALSE(a.matches(max));
  // All-to-all ranks send different row counts; the row width must agree.
  CHECK(collective(OpType::AllToAll, 10, 64).matches(collective(OpType::AllToAll, 3, 64)));
  CHECK_FALSE(collective(OpType::AllToAll, 10, 64).matches(collective(OpType::AllToAll, 10, 32)));
}
