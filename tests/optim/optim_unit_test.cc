// One-process tests of the optimizer's arithmetic: the learning-rate
// schedule's values, the shard layout's cuts, the AdamW update against the
// formula evaluated element by element, and bf16 parameters with float32
// master weights and float32 or bf16 moments.
#include <ATen/ATen.h>

#include <cmath>
#include <numbers>
#include <random>

#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "optim/shard_layout.h"
#include "parallel/shard_init.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;
using namespace bulkhead::optim;

TEST_CASE("LR schedule: linear warm-up, cosine decay to the minimum, then the minimum") {
  LrSchedule schedule{.peak = 1.0, .min = 0.1, .warmupSteps = 4, .totalSteps = 14};
  CHECK(schedule.at(0) == 0.25);
  CHECK(schedule.at(1) == 0.5);
  CHECK(schedule.at(3) == 1.0);
  CHECK(schedule.at(4) == 1.0);                    // the peak, at the start of the decay
  CHECK(std::abs(schedule.at(9) - 0.55) < 1e-15);  // half way: (peak + min) / 2
  CHECK(std::abs(schedule.at(6) - (0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.2)))) < 1e-15);
  CHECK(schedule.at(13) > 0.1);
  CHECK(schedule.at(14) == 0.1);
  CHECK(schedule.at(1000) == 0.1);
  for (int64_t s = 4; s < 14; ++s) CHECK(schedule.at(s + 1) < schedule.at(s));

  LrSchedule constant{.peak = 0.5, .min = 0.5, .warmupSteps = 0, .totalSteps = 3};
  CHECK(constant.at(0) == 0.5);
  CHECK(constant.at(2) == 0.5);
  CHECK_THROWS_AS((LrSchedule{.peak = 0.1, .min = 0.2}.at(0)), ConfigError);
  CHECK_THROWS_AS((LrSchedule{.warmupSteps = 5, .totalSteps = 4}.at(0)), ConfigError);
  CHECK_THROWS_AS(schedule.at(-1), ConfigError);
}

TEST_CASE("shard layout: row-aligned, balanced, contiguous cuts covering every element once") {
  std::vector<std::vector<int64_t>> shapes{{9, 5}, {5}, {3, 7}, {}, {13, 2, 3}, {0, 4}};
  for (int ranks : {1, 2, 3, 4, 8, 100}) {
    INFO("ranks " << ranks);
    ShardLayout layout = ShardLayout::create(shapes, ranks);
    CHECK(layout.total == 45 + 5 + 21 + 1 + 78);
    CHECK(layout.cuts.front() == 0);
    CHECK(layout.cuts.back() == layout.total);
    std::vector<int64_t> covered(static_cast<size_t>(layout.total), 0);
    for (int r = 0; r < ranks; ++r) {
      CHECK(layout.cuts[r] <= layout.cuts[r + 1]);
      CHECK(layout.shardLength(r) <= layout.shardMax);
      int64_t offset = 0;
      for (const auto& piece : layout.pieces(r)) {
        const auto& p = layout.params[piece.param];
        CHECK(piece.shardOffset == offset);  // pieces tile the shard in order
        CHECK(piece.numel == piece.rows * p.rowElems);
        CHECK(piece.rowBegin + piece.rows <= p.rows);
        for (int64_t e = 0; e < piece.numel; ++e) ++covered[p.offset + piece.rowBegin * p.rowElems + e];
        offset += piece.numel;
      }
      CHECK(offset == layout.shardLength(r));
    }
    for (int64_t count : covered) CHECK(count == 1);
  }
  // Balanced to within a row: 4 ranks over [8, 10] rows of 10: 20 elements each.
  ShardLayout even = ShardLayout::create({{8, 10}}, 4);
  CHECK(even.cuts == std::vector<int64_t>{0, 20, 40, 60, 80});
  CHECK(even.shardMax == 20);
  // Fewer rows than ranks: some shards are empty, none splits a row.
  ShardLayout few = ShardLayout::create({{3, 7}}, 4);
  for (int64_t cut : few.cuts) CHECK(cut % 7 == 0);
  CHECK(few.shardMax == 7);
  // One expert [1, 6, 4] over 4 expert-dp ranks: rows of 4 over all but the
  // last dimension, so every rank holds some of it.
  ShardLayout oneExpert = ShardLayout::create({{1, 6, 4}}, 4);
  CHECK(oneExpert.params[0].rows == 6);
  for (int r = 0; r < 4; ++r) CHECK(oneExpert.shardLength(r) > 0);
  for (int64_t cut : oneExpert.cuts) CHECK(cut % 4 == 0);
  CHECK(oneExpert.shardMax == 8);
}

TEST_CASE("row boxes cover exactly the rows asked for, each box contiguous and in order") {
  std::mt19937_64 random(23);
  const std::vector<std::vector<int64_t>> shapes{{7},       {5, 3},    {3, 4, 2},         {2, 3, 4, 5},
                                                 {1, 6, 4}, {4, 1, 3}, {2, 3, 2, 3, 2, 2}};
  for (const auto& shape : shapes) {
    const int64_t lastExtent = shape.size() == 1 ? 1 : shape.back();
    int64_t rows = 1;
    for (size_t d = 0; d + (shape.size() == 1 ? 0 : 1) < shape.size(); ++d) rows *= shape[d];
    std::vector<int64_t> strides(shape.size(), 1);
    for (size_t d = shape.size() - 1; d > 0; --d) strides[d - 1] = strides[d] * shape[d];
    for (int draw = 0; draw < 200; ++draw) {
      int64_t begin = static_cast<int64_t>(random() % static_cast<uint64_t>(rows + 1));
      int64_t end = static_cast<int64_t>(random() % static_cast<uint64_t>(rows + 1));
      if (begin > end) std::swap(begin, end);
      INFO("shape [" << shape.size() << " dims] rows [" << begin << ", " << end << ")");
      int64_t next = begin * lastExtent;  // the flat element each box must start at
      const auto boxes = rowBoxes(shape, begin, end);
      const size_t rowDims = shape.size() == 1 ? 1 : shape.size() - 1;
      CHECK(boxes.size() <= 2 * rowDims - 1);
      if (begin < end && begin % (rows / shape[0]) == 0 && end % (rows / shape[0]) == 0) CHECK(boxes.size() == 1);
      for (const Box& box : boxes) {
        REQUIRE(box.offsets.size() == shape.size());
        REQUIRE(box.extents.size() == shape.size());
        int64_t start = 0, numel = 1;
        for (size_t d = 0; d < shape.size(); ++d) {
          CHECK(box.extents[d] >= 1);
          CHECK(box.offsets[d] + box.extents[d] <= shape[d]);
          start += box.offsets[d] * strides[d];
          numel *= box.extents[d];
        }
        CHECK(start == next);
        // Contiguous: past the first dimension that is not 1, every extent is whole.
        size_t d = 0;
        while (d < shape.size() && box.extents[d] == 1) ++d;
        for (size_t inner = d + 1; inner < shape.size(); ++inner) CHECK(box.extents[inner] == shape[inner]);
        next += numel;
      }
      CHECK(next == end * lastExtent);
    }
  }
  CHECK(rowBoxes({}, 0, 1).size() == 1);
  CHECK(rowBoxes({3, 4}, 2, 2).empty());
}

TEST_CASE("adamwUpdate follows the AdamW formula element by element") {
  AdamWOptions options{.beta1 = 0.8, .beta2 = 0.9, .eps = 1e-3, .weightDecay = 0.3};
  auto generator = at::detail::createCPUGenerator(42);
  at::Tensor master = at::randn({17}, generator, at::kDouble);
  at::Tensor m = at::zeros({17}, at::kDouble), v = at::zeros({17}, at::kDouble);
  std::vector<double> w(master.data_ptr<double>(), master.data_ptr<double>() + 17), mm(17, 0.0), vv(17, 0.0);
  for (int64_t step = 1; step <= 4; ++step) {
    at::Tensor grad = at::randn({17}, generator, at::kDouble);
    double lr = 0.01 * static_cast<double>(step);
    adamwUpdate(master, grad, m, v, step, lr, options.weightDecay, options);
    for (int i = 0; i < 17; ++i) {
      double g = grad[i].item<double>();
      w[i] *= 1 - lr * options.weightDecay;
      mm[i] = options.beta1 * mm[i] + (1 - options.beta1) * g;
      vv[i] = options.beta2 * vv[i] + (1 - options.beta2) * g * g;
      double mHat = mm[i] / (1 - std::pow(options.beta1, step)), vHat = vv[i] / (1 - std::pow(options.beta2, step));
      w[i] -= lr * mHat / (std::sqrt(vHat) + options.eps);
    }
    for (int i = 0; i < 17; ++i) CHECK(std::abs(master[i].item<double>() - w[i]) <= 1e-14 * (1 + std::abs(w[i])));
  }
}

TEST_CASE("by default matrices decay and norm gains and biases do not; a decays function overrides that") {
  auto generator = at::detail::createCPUGenerator(11);
  at::Tensor weight = at::randn({5, 3}, generator, at::kDouble).set_requires_grad(true);
  at::Tensor gain = at::randn({3}, generator, at::kDouble).add_(2.0).set_requires_grad(true);
  // A tp shard of a matrix is a matrix, whatever its local shape.
  at::Tensor shard = at::randn({1, 4}, generator, at::kDouble).set_requires_grad(true);
  std::vector<parallel::Parameter> params{{.name = "w", .tensor = weight, .shard = parallel::ShardInfo::whole({5, 3})},
                                          {.name = "norm", .tensor = gain, .shard = parallel::ShardInfo::whole({3})},
                                          {.name = "w_tp", .tensor = shard, .shard = {{2, 4}, {1, 0}, 0}}};
  const AdamWOptions options{.weightDecay = 0.25};
  CHECK(weightDecayFor(params[0], options) == 0.25);
  CHECK(weightDecayFor(params[1], options) == 0.0);
  CHECK(weightDecayFor(params[2], options) == 0.25);
  const AdamWOptions named{.weightDecay = 0.25,
                           .decays = [](const parallel::Parameter& p) { return p.name == "norm"; }};
  CHECK(weightDecayFor(params[0], named) == 0.0);
  CHECK(weightDecayFor(params[1], named) == 0.25);
  // A step moves each parameter as adamwUpdate does with its decay.
  std::vector<at::Tensor> expected;
  for (auto& p : params) {
    p.tensor.mutable_grad() = at::randn(p.tensor.sizes(), generator, at::kDouble);
    at::Tensor master = p.tensor.detach().clone(), m = at::zeros_like(master), v = at::zeros_like(master);
    adamwUpdate(master, p.tensor.grad(), m, v, 1, 0.1, weightDecayFor(p, options), options);
    expected.push_back(master);
  }
  AdamW adamw(params, options);
  adamw.step(0.1);
  for (size_t i = 0; i < params.size(); ++i) CHECK(at::equal(params[i].tensor, expected[i]));
}

TEST_CASE("AdamW on bf16 parameters keeps float32 masters that accumulate updates below bf16 resolution") {
  at::Tensor weight = at::ones({4, 3}, at::kBFloat16).set_requires_grad(true);
  at::Tensor bias = at::full({3}, 2.0, at::kBFloat16).set_requires_grad(true);
  std::vector<parallel::Parameter> params{{.name = "w", .tensor = weight, .shard = parallel::ShardInfo::whole({4, 3})},
                                          {.name = "b", .tensor = bias, .shard = parallel::ShardInfo::whole({3})}};
  AdamW adamw(params, {.weightDecay = 0.0});
  CHECK(adamw.master(0).scalar_type() == at::kFloat);
  auto generator = at::detail::createCPUGenerator(7);
  weight.mutable_grad() = at::rand({4, 3}, generator, at::kFloat).add_(0.5).to(at::kBFloat16);  // positive
  bias.mutable_grad() = at::rand({3}, generator, at::kFloat).add_(0.5).to(at::kBFloat16);
  // The first step moves the master by lr (Adam's first step is lr * sign(g)):
  // under half the bf16 spacing below 1.0 (2^-9).
  adamw.step(1e-3);
  CHECK(at::equal(weight, at::ones({4, 3}, at::kBFloat16)));  // the bf16 value has not moved...
  CHECK((adamw.master(0) < 1.0 - 9e-4).all().item<bool>());   // ...its master has
  for (int step = 0; step < 7; ++step) {
    weight.mutable_grad() = at::ones({4, 3}, at::kBFloat16);
    bias.mutable_grad() = at::ones({3}, at::kBFloat16);
    adamw.step(1e-3);
  }
  CHECK((weight < 1.0).all().item<bool>());  // past half an ulp below 1.0 (2^-9), bf16 rounds down
  CHECK(at::equal(weight, adamw.master(0).to(at::kBFloat16)));
  CHECK(at::equal(bias, adamw.master(1).to(at::kBFloat16)));
  auto state = adamw.state();
  REQUIRE(state.size() == 7);  // master, exp_avg, exp_avg_sq for each, and the step
  CHECK(state[0].key == "optim.w.master");
  CHECK(state[6].key == "optim.step");
  CHECK(state[6].local.item<int64_t>() == 8);
}

TEST_CASE("AdamW with bf16 moments rounds float32 moments once a step and tracks float32 moments") {
  auto generator = at::detail::createCPUGenerator(23);
  const at::Tensor initial = at::randn({24, 16}, generator, at::kFloat);
  auto make = [&](at::ScalarType moments) {
    std::vector<parallel::Parameter> params{{.name = "w",
                                             .tensor = initial.to(at::kBFloat16).set_requires_grad(true),
                                             .shard = parallel::ShardInfo::whole({24, 16})}};
    return std::pair{params, AdamW(params, {.weightDecay = 0.1, .momentType = moments})};
  };
  auto [halfParams, half] = make(at::kBFloat16);
  auto [fullParams, full] = make(at::kFloat);
  CHECK(half.master(0).scalar_type() == at::kFloat);
  CHECK(half.expAvg(0).scalar_type() == at::kBFloat16);
  CHECK(half.expAvgSq(0).scalar_type() == at::kBFloat16);
  CHECK(full.expAvg(0).scalar_type() == at::kFloat);
  // The reference: the float32 update, its moments rounded to bf16 after each step.
  at::Tensor master = half.master(0).clone(), m = at::zeros_like(master), v = at::zeros_like(master);
  const AdamWOptions reference{.weightDecay = 0.1};
  for (int step = 1; step <= 20; ++step) {
    const at::Tensor grad = at::randn({24, 16}, generator, at::kFloat).add_(0.3).to(at::kBFloat16);
    halfParams[0].tensor.mutable_grad() = grad;
    fullParams[0].tensor.mutable_grad() = grad;
    half.step(1e-2);
    full.step(1e-2);
    adamwUpdate(master, grad, m, v, step, 1e-2, 0.1, reference);
    m = m.to(at::kBFloat16).to(at::kFloat);
    v = v.to(at::kBFloat16).to(at::kFloat);
  }
  CHECK(at::equal(half.master(0), master));
  CHECK(at::equal(half.expAvg(0).to(at::kFloat), m));
  CHECK(at::equal(half.expAvgSq(0).to(at::kFloat), v));
  // bf16's 8 bits of moment change the 20 steps' update by well under a percent of it.
  const at::Tensor moved = full.master(0) - initial.to(at::kBFloat16).to(at::kFloat);
  CHECK((half.master(0) - full.master(0)).norm().item<double>() < 0.01 * moved.norm().item<double>());
  CHECK_FALSE(at::equal(half.master(0), full.master(0)));
  for (const auto& entry : half.state())
    if (entry.key.find(".exp_avg") != std::string::npos) CHECK(entry.local.scalar_type() == at::kBFloat16);
  // Float64 masters keep float64 moments; moments in float16 are refused.
  std::vector<parallel::Parameter> wide{{.name = "w",
                                         .tensor = initial.to(at::kDouble).set_requires_grad(true),
                                         .shard = parallel::ShardInfo::whole({24, 16})}};
  CHECK(AdamW(wide, {.momentType = at::kBFloat16}).expAvg(0).scalar_type() == at::kDouble);
  CHECK_THROWS_AS(AdamW(wide, {.momentType = at::kHalf}), ConfigError);
}

TEST_CASE("zeroGrad releases the gradients, so the next backward writes them rather than adding") {
  auto generator = at::detail::createCPUGenerator(11);
  at::Tensor weight = at::randn({5, 3}, generator, at::kDouble).set_requires_grad(true);
  at::Tensor input = at::randn({4, 5}, generator, at::kDouble);
  std::vector<parallel::Parameter> params{{.name = "w", .tensor = weight, .shard = parallel::ShardInfo::whole({5, 3})}};
  AdamW adamw(params, {});
  input.mm(weight).pow(2).sum().backward();
  adamw.step(1e-3);
  adamw.zeroGrad();
  CHECK_FALSE(weight.grad().defined());
  adamw.step(1e-3);  // a step with no gradient takes zeros (weight decay and momentum only)
  input.mm(weight).sin().sum().backward();
  at::Tensor expected = input.t().mm(input.mm(weight.detach()).cos());  // this backward's gradient alone
  CHECK(at::allclose(weight.grad(), expected, 1e-12, 1e-12));
}

TEST_CASE("seeded parameter slices are independent of the layout") {
  parallel::ShardInfo whole = parallel::ShardInfo::whole({6, 4});
  at::Tensor all = parallel::seededSlice("layer.weight", 3, whole, {6, 4}, 0.5, at::kDouble);
  for (int parts : {2, 3}) {
    for (int r = 0; r < parts; ++r) {
      parallel::Range rows = parallel::partition(6, parts, r);
      at::Tensor slice =
          parallel::seededSlice("layer.weight", 3, {{6, 4}, {rows.begin, 0}}, {rows.length, 4}, 0.5, at::kDouble);
      CHECK(at::equal(slice, all.narrow(0, rows.begin, rows.length)));
    }
  }
  CHECK_FALSE(at::equal(all, parallel::seededSlice("layer.bias", 3, whole, {6, 4}, 0.5, at::kDouble)));
  CHECK_FALSE(at::equal(all, parallel::seededSlice("layer.weight", 4, whole, {6, 4}, 0.5, at::kDouble)));
  CHECK(parallel::partition(11, 4, 3).begin == 9);
  CHECK(parallel::partition(11, 4, 3).length == 2);
  CHECK(parallel::partition(11, 4, 0).length == 3);
}
