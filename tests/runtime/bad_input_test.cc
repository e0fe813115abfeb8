// Bad input is a ConfigError on the calling rank before any communication:
// nothing is issued (the ledger does not move), so no peer is left waiting.
#include <string>

#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"

using namespace bulkhead;
using namespace bulkhead::testing;

namespace {

// Runs `call`, expects a ConfigError whose message holds `part`, and checks
// that nothing was issued on the world communicator.
template <typename Call>
void rejectsBeforeCommunicating(Call call, const std::string& part) {
  LedgerHeads before = world().ledger().heads();
  try {
    call();
    FAIL("expected a ConfigError containing '" << part << "'");
  } catch (const ConfigError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(part) != std::string::npos);
    CHECK(e.group() == "world");
    CHECK(e.rank() == world().rank());
  }
  LedgerHeads after = world().ledger().heads();
  CHECK(after.lastIssued == before.lastIssued);
  CHECK(after.lastIssuedP2P == before.lastIssuedP2P);
}

}  // namespace

TEST_CASE("all-to-all split lists of the wrong length are rejected") {
  int n = world().size();
  at::Tensor send = at::ones({n, 2}), recv = at::empty({n, 2});
  std::vector<int64_t> ones(n, 1), tooLong(n + 1, 0);
  tooLong[0] = n;
  rejectsBeforeCommunicating([&] { world().allToAll(send, recv, tooLong, ones); }, "entries for a group of");
  rejectsBeforeCommunicating([&] { world().allToAll(send, recv, ones, std::vector<int64_t>(n + 2, 0)); },
                             "entries for a group of");
}

TEST_CASE("negative split sizes are rejected") {
  int n = world().size();
  at::Tensor send = at::ones({n, 2}), recv = at::empty({n, 2});
  std::vector<int64_t> splits(n, 1);
  splits[0] = -1;  // rejected for being negative, whatever the rows add up to
  rejectsBeforeCommunicating([&] { world().allToAll(send, recv, splits, std::vector<int64_t>(n, 1)); }, "is negative");
}

TEST_CASE("split sizes that do not add up to the tensor's rows are rejected") {
  int n = world().size();
  at::Tensor send = at::ones({n, 2}), recv = at::empty({n, 2});
  rejectsBeforeCommunicating([&] { world().allToAll(send, recv, std::vector<int64_t>(n, 2), {}); }, "add up to");
  if (n > 1)
    rejectsBeforeCommunicating([&] { world().allToAll(at::ones({n + 1, 2}), recv, {}, {}); }, "do not split evenly");
  // A rank's own pair must agree: it sends one row to itself but expects two.
  std::vector<int64_t> sendOne(n, 1), receive(n, 1);
  receive[world().rank()] = 2;
  receive[(world().rank() + 1) % n] -= n > 1 ? 1 : 0;
  if (n > 1)
    rejectsBeforeCommunicating([&] { world().allToAll(at::ones({n, 2}), recv, sendOne, receive); }, "to itself");
}

TEST_CASE("an unsupported dtype is rejected") {
  rejectsBeforeCommunicating([] { world().allReduce(at::ones({4}, at::kBool)); }, "does not support");
  rejectsBeforeCommunicating([] { world().allReduce(at::ones({4}, at::kComplexFloat)); }, "does not support");
  rejectsBeforeCommunicating([] { world().allReduce(at::ones({4}, at::kInt), {.op = ReduceOp::Avg}); },
                             "floating-point");
}

TEST_CASE("a tensor on the wrong device is rejected") {
  at::Tensor meta = at::empty({4}, at::TensorOptions().device(at::kMeta));
  rejectsBeforeCommunicating([&] { world().allReduce(meta); },
                             std::string("the ") + world().backend() + " backend works on cpu tensors");
  rejectsBeforeCommunicating([&] { world().send(meta, 0); }, "meta");
}

TEST_CASE("non-contiguous, undefined and mis-sized tensors are rejected") {
  int n = world().size();
  rejectsBeforeCommunicating([] { world().allReduce(at::ones({4, 4}).t()); }, "not contiguous");
  rejectsBeforeCommunicating([] { world().broadcast(at::Tensor(), 0); }, "undefined");
  rejectsBeforeCommunicating([&] { world().allGather(at::ones({3}), at::empty({3 * n + 1})); }, "elements");
  rejectsBeforeCommunicating([&] { world().reduceScatter(at::ones({3 * n + 1}), at::empty({3})); }, "elements");
  rejectsBeforeCommunicating([&] { world().allGather(at::ones({3}), at::empty({3 * n}, at::kDouble)); },
                             "input is float32 but output is float64");
  rejectsBeforeCommunicating([&] { world().allToAll(at::ones({n, 2}), at::empty({n, 3}), {}, {}); }, "rows differ");
}

TEST_CASE("a peer or root outside the group is rejected") {
  int n = world().size();
  rejectsBeforeCommunicating([&] { world().send(at::ones({2}), n); }, "is not a rank of world");
  rejectsBeforeCommunicating([&] { world().recv(at::empty({2}), -1); }, "is not a rank of world");
  rejectsBeforeCommunicating([&] { world().broadcast(at::ones({2}), n + 3); }, "root");
}
