// The tensor-parallel layers at tp 2 and 4 equal the single-rank layer on the
// gathered weights: outputs, input gradients and weight gradients, in float64
// within 1e-12 relative, on seeded random weights and data.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>

#include "parallel/linear.h"
#include "parallel/vocab_parallel.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"
#include "tests/support/parallel_helpers.h"

using namespace bulkhead;
using namespace bulkhead::parallel;
using namespace bulkhead::testing;

namespace {

constexpr double kTolerance = 1e-12;

// Sets a parameter's local slice from the global tensor.
void setFromGlobal(const Parameter& param, const at::Tensor& global) {
  c10::NoGradGuard noGrad;
  param.tensor.copy_(sliceOf(global, param.shard.offsets, param.tensor.sizes()));
}

at::Tensor leaf(const at::Tensor& t) { return t.clone().set_requires_grad(true); }

std::vector<int> tpSizes() {
  std::vector<int> sizes;
  for (int tp : {2, 4})
    if (world().size() % tp == 0) sizes.push_back(tp);
  return sizes;
}

}  // namespace

TEST_CASE("column-parallel linear equals the single-rank linear on the gathered weight") {
  for (int tp : tpSizes()) {
    for (bool gather : {false, true}) {
      INFO(fmt::format("tp {}, gatherOutput {}", tp, gather));
      ProcessGroups groups = makeGroups({.tp = tp});
      TpGroup group = TpGroup::dense(groups);
      const int64_t in = 6, out = 8;
      at::Tensor w = seeded({out, in}, 1, tp), b = seeded({out}, 2, tp);
      ColumnParallelLinear layer("col", in, out, group, {.gatherOutput = gather, .dtype = at::kDouble});
      auto params = layer.parameters();
      REQUIRE(params.size() == 2);
      CHECK(params[0].name == "col.weight");
      CHECK(params[0].shard.globalShape == std::vector<int64_t>{out, in});
      CHECK(params[0].shard.offsets == std::vector<int64_t>{out / tp * group.rank(), 0});
      setFromGlobal(params[0], w);
      setFromGlobal(params[1], b);

      // Data differ between dp replicas; the tp ranks of a group share them.
      int dp = groups.dp()->rank();
      at::Tensor x = leaf(seeded({3, 5, in}, 3, tp, dp)), dy = seeded({3, 5, out}, 4, tp, dp);
      at::Tensor y = layer.forward(x);
      at::Tensor dyMine = gather ? dy : dy.narrow(-1, layer.outBegin(), out / tp);
      (y * dyMine).sum().backward();

      at::Tensor xr = leaf(x.detach()), wr = leaf(w), br = leaf(b);
      at::Tensor yr = at::linear(xr, wr, br);
      (yr * dy).sum().backward();

      at::Tensor yWant = gather ? yr : yr.narrow(-1, layer.outBegin(), out / tp);
      CHECK(relativeError(y, yWant) <= kTolerance);
      CHECK(relativeError(x.grad(), xr.grad()) <= kTolerance);
      CHECK(relativeError(layer.weight().grad(), wr.grad().narrow(0, layer.outBegin(), out / tp)) <= kTolerance);
      CHECK(relativeError(layer.bias().grad(), br.grad().narrow(0, layer.outBegin(), out / tp)) <= kTolerance);
    }
  }
}

TEST_CASE("row-parallel linear equals the single-rank linear on the gathered weight") {
  for (int tp : tpSizes()) {
    for (bool parallelInput : {true, false}) {
      INFO(fmt::format("tp {}, inputIsParallel {}", tp, parallelInput));
      ProcessGroups groups = makeGroups({.tp = tp});
      TpGroup group = TpGroup::dense(groups);
      const int64_t in = 8, out = 6, block = in / tp;
      at::Tensor w = seeded({out, in}, 5, tp), b = seeded({out}, 6, tp);
      RowParallelLinear layer("row", in, out, group, {.inputIsParallel = parallelInput, .dtype = at::kDouble});
      auto params = layer.parameters();
      REQUIRE(params.size() == 2);
      CHECK(params[0].shard.offsets == std::vector<int64_t>{0, block * group.rank()});
      CHECK(params[1].tpReplicated);
      CHECK(params[1].shard.replicaId == groups.dp()->rank() * tp + group.rank());
      setFromGlobal(params[0], w);
      setFromGlobal(params[1], b);

      int dp = groups.dp()->rank();
      at::Tensor xFull = seeded({3, 5, in}, 7, tp, dp), dy = seeded({3, 5, out}, 8, tp, dp);
      at::Tensor x = leaf(parallelInput ? xFull.narrow(-1, layer.inBegin(), block) : xFull);
      at::Tensor y = layer.forward(x);
      (y * dy).sum().backward();

      at::Tensor xr = leaf(xFull), wr = leaf(w), br = leaf(b);
      at::Tensor yr = at::linear(xr, wr, br);
      (yr * dy).sum().backward();

      CHECK(relativeError(y, yr) <= kTolerance);
      at::Tensor dxWant = parallelInput ? xr.grad().narrow(-1, layer.inBegin(), block) : xr.grad();
      CHECK(relativeError(x.grad(), dxWant) <= kTolerance);
      CHECK(relativeError(layer.weight().grad(), wr.grad().narrow(1, layer.inBegin(), block)) <= kTolerance);
      CHECK(relativeError(layer.bias().grad(), br.grad()) <= kTolerance);
    }
  }
}

TEST_CASE("a column-then-row MLP equals the single-rank MLP") {
  for (int tp : tpSizes()) {
    INFO(fmt::format("tp {}", tp));
    ProcessGroups groups = makeGroups({.tp = tp});
    TpGroup group = TpGroup::dense(groups);
    const int64_t dim = 4, hidden = 12;
    at::Tensor w1 = seeded({hidden, dim}, 9), b1 = seeded({hidden}, 10), w2 = seeded({dim, hidden}, 11),
               b2 = seeded({dim}, 12);
    ColumnParallelLinear up("mlp.up", dim, hidden, group, {.dtype = at::kDouble});
    RowParallelLinear down("mlp.down", hidden, dim, group, {.dtype = at::kDouble});
    setFromGlobal(up.parameters()[0], w1);
    setFromGlobal(up.parameters()[1], b1);
    setFromGlobal(down.parameters()[0], w2);
    setFromGlobal(down.parameters()[1], b2);

    at::Tensor x = leaf(seeded({7, dim}, 13, groups.dp()->rank())), dy = seeded({7, dim}, 14, groups.dp()->rank());
    (down.forward(at::gelu(up.forward(x))) * dy).sum().backward();

    at::Tensor xr = leaf(x.detach()), w1r = leaf(w1), b1r = leaf(b1), w2r = leaf(w2), b2r = leaf(b2);
    (at::linear(at::gelu(at::linear(xr, w1r, b1r)), w2r, b2r) * dy).sum().backward();

    int64_t block = hidden / tp;
    CHECK(relativeError(x.grad(), xr.grad()) <= kTolerance);
    CHECK(relativeError(up.weight().grad(), w1r.grad().narrow(0, up.outBegin(), block)) <= kTolerance);
    CHECK(relativeError(up.bias().grad(), b1r.grad().narrow(0, up.outBegin(), block)) <= kTolerance);
    CHECK(relativeError(down.weight().grad(), w2r.grad().narrow(1, down.inBegin(), block)) <= kTolerance);
    CHECK(relativeError(down.bias().grad(), b2r.grad()) <= kTolerance);
  }
}

TEST_CASE("vocab-parallel embedding, tied logits and cross-entropy equal the single-rank model") {
  for (int tp : tpSizes()) {
    INFO(fmt::format("tp {}", tp));
    ProcessGroups groups = makeGroups({.tp = tp});
    TpGroup group = TpGroup::dense(groups);
    const int64_t vocab = 11, dim = 5;  // uneven over tp 2 (6+5) and tp 4 (3+3+3+2)
    at::Tensor table = seeded({vocab, dim}, 15, tp);
    VocabParallelEmbedding embedding("embed", vocab, dim, group, {.dtype = at::kDouble});
    Range rows = embedding.vocabRange();
    CHECK(rows.begin == partition(vocab, tp, group.rank()).begin);
    CHECK(embedding.weight().size(0) == rows.length);
    setFromGlobal(embedding.parameters()[0], table);

    int dp = groups.dp()->rank();
    auto generator = at::detail::createCPUGenerator(1000 + 10 * tp + dp);
    at::Tensor ids = at::randint(vocab, {2, 9}, generator, at::kLong);
    at::Tensor targets = at::randint(vocab, {2, 9}, generator, at::kLong);
    targets.view({-1}).narrow(0, 0, vocab).copy_(at::arange(vocab));  // every rank's block holds some targets
    at::Tensor weights = seeded({2, 9}, 16, tp, dp);                  // a non-uniform loss gradient

    at::Tensor hidden = embedding.forward(ids);
    at::Tensor logits = embedding.logits(at::tanh(hidden));
    at::Tensor loss = vocabParallelCrossEntropy(logits, targets, rows.begin, group);
    (loss * weights).sum().backward();

    at::Tensor tr = leaf(table);
    at::Tensor hiddenRef = at::embedding(tr, ids);
    at::Tensor logitsRef = at::linear(at::tanh(hiddenRef), tr);
    at::Tensor lossRef = logitsRef.logsumexp(-1) - logitsRef.gather(-1, targets.unsqueeze(-1)).squeeze(-1);
    (lossRef * weights).sum().backward();

    CHECK(relativeError(hidden, hiddenRef) <= kTolerance);
    CHECK(relativeError(logits, logitsRef.narrow(-1, rows.begin, rows.length)) <= kTolerance);
    CHECK(relativeError(loss, lossRef) <= kTolerance);
    CHECK(relativeError(embedding.weight().grad(), tr.grad().narrow(0, rows.begin, rows.length)) <= kTolerance);
  }
}

TEST_CASE("vocab-parallel cross-entropy of bf16 logits is computed in float32") {
  ProcessGroups groups = makeGroups({.tp = world().size() % 2 == 0 ? 2 : 1});
  TpGroup group = TpGroup::dense(groups);
  const int64_t vocab = 10;
  Range rows = partition(vocab, group.size(), group.rank());
  at::Tensor full = seeded({6, vocab}, 17).mul(3).to(at::kBFloat16);
  at::Tensor logits = full.narrow(-1, rows.begin, rows.length).contiguous().set_requires_grad(true);
  auto generator = at::detail::createCPUGenerator(77);
  at::Tensor targets = at::randint(vocab, {6}, generator, at::kLong);
  at::Tensor loss = vocabParallelCrossEntropy(logits, targets, rows.begin, group);
  loss.sum().backward();
  CHECK(loss.scalar_type() == at::kBFloat16);
  CHECK(logits.grad().scalar_type() == at::kBFloat16);

  at::Tensor ref = leaf(full.to(at::kFloat));
  at::Tensor lossRef = ref.logsumexp(-1) - ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1);
  lossRef.sum().backward();
  CHECK(relativeError(loss, lossRef) <= 1e-2);  // one bf16 rounding of each result
  CHECK(relativeError(logits.grad(), ref.grad().narrow(-1, rows.begin, rows.length)) <= 1e-2);
}

TEST_CASE("a double backward through the tp collectives or the vocab-parallel loss is refused on every rank") {
  ProcessGroups groups = makeGroups({.tp = world().size() % 2 == 0 ? 2 : 1});
  TpGroup group = TpGroup::dense(groups);
  auto refused = [](const at::Tensor& loss, const at::Tensor& input) {
    try {
      torch::autograd::grad({loss}, {input}, {}, /*retain_graph=*/true, /*create_graph=*/true);
      return false;
    } catch (const ConfigError& error) {
      return std::string(error.what()).find("no double backward") != std::string::npos;
    }
  };
  at::Tensor x = leaf(seeded({5, 8}, 21, groups.dp()->rank()));
  if (group.size() > 1) {
    for (bool scatter : {false, true}) {
      INFO((scatter ? "scatterToTensorParallel" : "copyToTensorParallel"));
      at::Tensor y = scatter ? scatterToTensorParallel(x, group) : copyToTensorParallel(x, group);
      at::Tensor loss = (y * y).sum();
      CHECK(refused(loss, x));
      CHECK(torch::autograd::grad({loss}, {x})[0].abs().sum().item<double>() > 0);  // first order still runs
    }
  }
  const int64_t vocab = 10;
  Range rows = partition(vocab, group.size(), group.rank());
  at::Tensor logits = leaf(seeded({6, vocab}, 22).narrow(-1, rows.begin, rows.length).contiguous());
  auto generator = at::detail::createCPUGenerator(78);
  at::Tensor loss =
      vocabParallelCrossEntropy(logits, at::randint(vocab, {6}, generator, at::kLong), rows.begin, group).sum();
  CHECK(refused(loss, logits));
  CHECK(torch::autograd::grad({loss}, {logits})[0].abs().sum().item<double>() > 0);
}
