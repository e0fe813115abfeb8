#include <fmt/format.h>
#include <fmt/ranges.h>

#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"

using namespace bulkhead;
using namespace bulkhead::testing;

namespace {

const std::vector<std::vector<int64_t>> kShapes = {{0}, {1}, {7}, {3, 5}, {1000}, {65537}, {2, 0, 3}};

at::Tensor reference(ReduceOp op, int salt, at::IntArrayRef shape, at::ScalarType dtype) {
  int n = world().size();
  bool product = op == ReduceOp::Prod;
  at::Tensor result = draw(0, salt, shape, dtype, product).to(at::kDouble);
  for (int r = 1; r < n; ++r) {
    at::Tensor next = draw(r, salt, shape, dtype, product).to(at::kDouble);
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        result = result + next;
        break;
      case ReduceOp::Prod:
        result = result * next;
        break;
      case ReduceOp::Min:
        result = at::minimum(result, next);
        break;
      case ReduceOp::Max:
        result = at::maximum(result, next);
        break;
    }
  }
  if (op == ReduceOp::Avg) return result.to(dtype).div_(n);
  return result.to(dtype);
}

std::vector<ReduceOp> opsFor(at::ScalarType dtype) {
  std::vector<ReduceOp> ops = {ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max};
  bool eightBit = dtype == at::kChar || dtype == at::kByte;
  if (!eightBit) ops.push_back(ReduceOp::Prod);  // 2^8 overflows 8-bit integers at 8 ranks
  if (at::isFloatingType(dtype)) ops.push_back(ReduceOp::Avg);
  return ops;
}

}  // namespace

TEST_CASE("all-reduce gives every rank the reduction of all ranks' tensors, for every dtype and op") {
  int salt = 0;
  for (at::ScalarType dtype : supportedDtypes()) {
    for (ReduceOp op : opsFor(dtype)) {
      for (const auto& shape : kShapes) {
        ++salt;
        INFO(fmt::format("{} {} shape [{}]", c10::toString(dtype), toString(op), fmt::join(shape, ",")));
        at::Tensor t = draw(world().rank(), salt, shape, dtype, op == ReduceOp::Prod);
        world().allReduce(t, {.op = op})->wait();
        CHECK(at::equal(t, reference(op, salt, shape, dtype)));
      }
    }
  }
}

TEST_CASE("all-gather puts rank r's input in chunk r of every rank's output") {
  int n = world().size(), salt = 1000;
  for (at::ScalarType dtype : supportedDtypes()) {
    for (const auto& shape : kShapes) {
      ++salt;
      at::Tensor in = draw(world().rank(), salt, shape, dtype);
      std::vector<int64_t> outShape = shape;
      outShape[0] *= n;
      at::Tensor out = at::empty(outShape, at::TensorOptions().dtype(dtype));
      world().allGather(in, out)->wait();
      std::vector<at::Tensor> parts;
      for (int r = 0; r < n; ++r) parts.push_back(draw(r, salt, shape, dtype));
      CHECK(at::equal(out, at::cat(parts)));
    }
  }
}

TEST_CASE("reduce-scatter gives rank r chunk r of the reduction") {
  int n = world().size(), me = world().rank(), salt = 2000;
  for (at::ScalarType dtype : supportedDtypes()) {
    for (ReduceOp op : opsFor(dtype)) {
      for (int64_t chunk : {0, 1, 5, 4099}) {
        ++salt;
        std::vector<int64_t> shape = {chunk * n};
        at::Tensor in = draw(me, salt, shape, dtype, op == ReduceOp::Prod);
        at::Tensor out = at::empty({chunk}, at::TensorOptions().dtype(dtype));
        world().reduceScatter(in, out, {.op = op})->wait();
        CHECK(at::equal(out, reference(op, salt, shape, dtype).slice(0, me * chunk, (me + 1) * chunk)));
      }
    }
  }
}

TEST_CASE("broadcast copies the root's tensor to every rank, from every root") {
  int salt = 3000;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    for (int root = 0; root < world().size(); ++root) {
      ++salt;
      at::Tensor t = world().rank() == root ? draw(root, salt, {129, 3}, dtype)
                                            : at::full({129, 3}, 99, at::TensorOptions().dtype(dtype));
      world().broadcast(t, root)->wait();
      CHECK(at::equal(t, draw(root, salt, {129, 3}, dtype)));
    }
  }
}

TEST_CASE("send and recv deliver between every pair of ranks, in order") {
  int n = world().size(), me = world().rank();
  for (int shift = 1; shift < std::max(n, 2); ++shift) {
    int to = (me + shift) % n, from = (me - shift % n + n) % n;
    // Two messages back to back to the same peer arrive in the order sent.
    at::Tensor first = draw(me, 4000 + shift, {333}, at::kFloat), second = draw(me, 5000 + shift, {17}, at::kDouble);
    at::Tensor got1 = at::empty({333}, at::kFloat), got2 = at::empty({17}, at::kDouble);
    auto s1 = world().send(first, to);
    auto s2 = world().send(second, to);
    auto r1 = world().recv(got1, from);
    auto r2 = world().recv(got2, from);
    for (auto& work : {s1, s2, r1, r2}) work->wait();
    CHECK(at::equal(got1, draw(from, 4000 + shift, {333}, at::kFloat)));
    CHECK(at::equal(got2, draw(from, 5000 + shift, {17}, at::kDouble)));
  }
}

TEST_CASE("a grouped send and receive goes both ways at once, in order, one ledger entry a message") {
  const int n = world().size(), me = world().rank();
  for (int shift = 1; shift < std::max(n, 2); ++shift) {
    const int to = (me + shift) % n, from = (me - shift % n + n) % n;
    // Each rank sends two messages to `to` and receives two from `from` in
    // one call; with large messages separate blocking sends would wait on
    // each other.
    std::vector<PeerOp> ops;
    std::vector<at::Tensor> got;
    for (int k = 0; k < 2; ++k) {
      ops.push_back({PeerOp::Kind::Send, draw(me, 6000 + 10 * shift + k, {70000 + k}, at::kFloat), to, "out"});
      got.push_back(at::full({70000 + k}, 77.0, at::kFloat));
    }
    for (int k = 0; k < 2; ++k) ops.push_back({PeerOp::Kind::Recv, got[k], from, fmt::format("in {}", k)});
    const uint64_t before = world().ledger().heads().lastIssuedP2P;
    world().sendRecv(ops)->wait();
    for (int k = 0; k < 2; ++k) CHECK(at::equal(got[k], draw(from, 6000 + 10 * shift + k, {70000 + k}, at::kFloat)));
    CHECK(world().ledger().heads().lastIssuedP2P == before + 4);
    for (const LedgerEntry& entry : world().ledger().entries()) {
      if (!isPointToPoint(entry.fingerprint.op) || entry.seq <= before) continue;
      CHECK(entry.fingerprint.root == (entry.fingerprint.op == OpType::Send ? to : from));
      CHECK(!entry.fingerprint.label.empty());
    }
  }
  // A peer outside the group is refused before anything is issued.
  const uint64_t before = world().ledger().heads().lastIssuedP2P;
  CHECK_THROWS_AS(world().sendRecv({{PeerOp::Kind::Send, at::ones({4}), n, "out of range"}}), ConfigError);
  CHECK(world().ledger().heads().lastIssuedP2P == before);
}

TEST_CASE("a barrier completes on every rank and takes a sequence number") {
  uint64_t before = world().ledger().heads().lastIssued;
  auto work = world().barrier();
  work->wait();
  CHECK(work->isCompleted());
  CHECK(work->exception() == nullptr);
  CHECK(work->sequence() == before + 1);
}

TEST_CASE("every rank numbers the same collectives the same way") {
  world().barrier()->wait();
  at::Tensor heads = at::tensor({static_cast<int64_t>(world().ledger().heads().lastCompleted)}, at::kLong);
  at::Tensor all = at::empty({world().size()}, at::kLong);
  world().allGather(heads, all)->wait();
  CHECK(at::equal(all, at::full({world().size()}, heads.item<int64_t>(), at::kLong)));
  auto entries = world().ledger().entries();
  REQUIRE_FALSE(entries.empty());
  CHECK(entries.back().fingerprint.op == OpType::AllGather);
  CHECK(entries.back().state == OpState::Completed);
}

TEST_CASE("operations in flight complete when waited out of order") {
  int salt = 6000;
  std::vector<at::Tensor> tensors;
  std::vector<WorkPtr> works;
  for (int i = 0; i < 16; ++i) {
    tensors.push_back(draw(world().rank(), salt + i, {257}, at::kFloat));
    works.push_back(world().allReduce(tensors.back()));
  }
  for (int i = 15; i >= 0; --i) works[i]->wait();
  for (int i = 0; i < 16; ++i) CHECK(at::equal(tensors[i], reference(ReduceOp::Sum, salt + i, {257}, at::kFloat)));
}
