// Qwen3-MoE and Mixtral against Hugging Face transformers' own numbers (fixtures/hf, written by
// fixtures/make_hf_fixtures.py with transformers' code): each fixture's folder loaded at a layout (tp, ep,
// expert-tp, pp), its float64 logits against transformers' float64 eager logits, and the LM loss from them
// against the loss from transformers' logits. At one rank also both expert forms (per expert, fused 3D).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "models/config.h"
#include "models/decoder.h"
#include "models/hf_weights.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/mpi_helpers.h"
#include "tests/support/parallel_helpers.h"

using namespace bulkhead;

namespace {

const std::string kFixtures = BULKHEAD_MODEL_FIXTURES;

at::Tensor tensorOf(const std::string& file, const std::string& name) {
  const checkpoint::SafetensorsFile f(file);
  const checkpoint::SafetensorsTensor* t = f.find(name);
  REQUIRE(t != nullptr);
  return f.read(*t);
}

// The LM loss with transformers' convention: the ids shifted inside, the mean over the predicted tokens.
at::Tensor lmLoss(const models::Decoder& model, const at::Tensor& logits, const at::Tensor& ids) {
  const int64_t sequence = ids.size(1);
  const at::Tensor predicted = logits.narrow(1, 0, sequence - 1).contiguous();
  return model.tokenLosses(predicted, ids.narrow(1, 1, sequence - 1).contiguous()).mean();
}

// Two references, both from transformers' code (fixtures/make_hf_fixtures.py):
// - "logits": its float64 model as it runs, which computes its RMSNorms, RoPE tables and both softmaxes
//   (attention, router) in float32 by design, as Bulkhead does by default. The two libtorch builds' float32
//   kernels (exp, cos, reductions) round differently in the last bit, so these agree to float32's precision.
// - "logits_float64_throughout": the same code with those float32 casts kept in float64, against Bulkhead
//   with float32Internals off: float64's precision (docs/models.md#numerics).
// Across Bulkhead's layouts, where every rank computes the same float32 inputs, the logits agree to float64's.
struct Tolerance {
  double logits, loss;
};
constexpr Tolerance kTransformers{1e-5, 1e-7}, kThroughout{1e-9, 1e-12};
constexpr double kAcrossLayouts = 1e-12;

struct Logits {
  at::Tensor block;  // this rank's vocabulary block; undefined on pipeline stages before the last
  parallel::Range rows;
};

struct Mode {
  bool float32Internals = true;
  std::string weights;  // the folder to load: the case's own when empty, or its fused copy
};

// This rank's part of the model at `layout`: pipeline stage s of pp holds layers [s L / pp, (s + 1) L / pp).
models::DecoderOptions partOf(const models::DecoderConfig& config, const parallel::ProcessGroups& groups,
                              const parallel::LayoutOptions& layout, const Mode& mode) {
  const int stage = groups.pp()->rank(), stages = layout.pp;
  return {.dtype = at::kDouble,
          .float32Internals = mode.float32Internals,
          .firstLayer = stage * config.layers / stages,
          .endLayer = (stage + 1) * config.layers / stages,
          .first = stage == 0,
          .last = stage == stages - 1};
}

Logits logitsAt(const std::string& name, const parallel::LayoutOptions& layout, const Mode& mode = {}) {
  const std::string folder = kFixtures + "/" + name;
  const models::DecoderConfig config = models::loadDecoderConfig(folder + "/config.json");
  const parallel::ProcessGroups groups = testing::makeGroups(layout);
  models::Decoder model(config, groups, partOf(config, groups, layout, mode));
  const models::HfLoadReport report = models::loadHfWeights(model, mode.weights.empty() ? folder : mode.weights);
  CHECK(report.tensors > 0);
  const at::Tensor ids = tensorOf(folder + "/tokens.safetensors", "input_ids");
  const at::NoGradGuard noGrad;
  Logits result{models::forwardOverStages(model, groups, ids), {}};
  if (!result.block.defined()) return result;
  result.rows = model.vocabRange();
  REQUIRE(result.block.sizes() == at::IntArrayRef({ids.size(0), ids.size(1), result.rows.length}));
  const std::string reference = folder + "/reference.safetensors";
  const at::Tensor want = tensorOf(reference, mode.float32Internals ? "logits" : "logits_float64_throughout")
                              .narrow(-1, result.rows.begin, result.rows.length)
                              .contiguous();
  const Tolerance tolerance = mode.float32Internals ? kTransformers : kThroughout;
  const double loss = lmLoss(model, result.block, ids).item<double>();
  const double wantLoss = lmLoss(model, want, ids).item<double>();
  if (mode.float32Internals) {  // the loss torch's cross_entropy gave for the same logits
    const double transformers = tensorOf(reference, "loss").item<double>();
    CHECK(std::abs(wantLoss - transformers) <= 1e-12 * transformers);
  }
  const double lossError = std::abs(loss - wantLoss) / wantLoss;
  const double error = (result.block - want).abs().max().item<double>();
  INFO(fmt::format("{} ({}) at tp {} ep {} etp {} pp {}: max logit error {:.3g}, loss error {:.3g}", name,
                   mode.float32Internals ? "float32 internals" : "float64 throughout", layout.tp, layout.ep, layout.etp,
                   layout.pp, error, lossError));
  CHECK(error <= tolerance.logits);
  CHECK(lossError <= tolerance.loss);
  return result;
}

const std::vector<std::string> kCases{"qwen3_moe_mixed", "qwen3_moe_kv1", "mixtral"};

}  // namespace

TEST_CASE("every fixture gives transformers' float64 logits on one rank", "[np1]") {
  for (const std::string& name : kCases) {
    logitsAt(name, {});
    logitsAt(name, {}, {.float32Internals = false});
  }
}

TEST_CASE("fused 3D experts load as the per-expert tensors do", "[np1]") {
  const Logits perExpert = logitsAt("qwen3_moe_mixed", {});
  const Logits fused = logitsAt("qwen3_moe_mixed", {}, {.weights = kFixtures + "/qwen3_moe_mixed/fused"});
  CHECK(at::equal(perExpert.block, fused.block));
}

TEST_CASE("every layout gives transformers' logits and those of one rank: tp, ep, expert-tp, pp, kv heads replicated",
          "[np4]") {
  const std::vector<parallel::LayoutOptions> layouts{
      {.tp = 2, .etp = 2}, {.ep = 2}, {.pp = 2, .ep = 2}, {.tp = 2, .ep = 2, .etp = 2}, {.tp = 4, .etp = 4}};
  for (const std::string& name : kCases) {
    const models::DecoderConfig config = models::loadDecoderConfig(kFixtures + "/" + name + "/config.json");
    for (const bool float32Internals : {true, false}) {
      const Mode mode{.float32Internals = float32Internals};
      const Logits whole = logitsAt(name, {}, mode);  // dp 4: every rank holds the whole model
      for (const auto& layout : layouts) {
        if (layout.pp > 1 && config.tieEmbeddings) continue;  // refused: below
        const Logits got = logitsAt(name, layout, mode);
        if (!got.block.defined()) continue;
        const double error =
            (got.block - whole.block.narrow(-1, got.rows.begin, got.rows.length)).abs().max().item<double>();
        INFO(fmt::format("{} at tp {} ep {} etp {} pp {}: {:.3g} from one rank's logits", name, layout.tp, layout.ep,
                         layout.etp, layout.pp, error));
        CHECK(error <= kAcrossLayouts);
      }
    }
  }
}

TEST_CASE("tied embeddings over pipeline stages are refused before anything is allocated", "[np4]") {
  const models::DecoderConfig config = models::loadDecoderConfig(kFixtures + "/qwen3_moe_kv1/config.json");
  REQUIRE(config.tieEmbeddings);
  const parallel::LayoutOptions layout{.pp = 2, .ep = 2};
  const parallel::ProcessGroups groups = testing::makeGroups(layout);
  const models::DecoderOptions part = partOf(config, groups, layout, {});
  if (part.first) return;  // the first stage alone builds
  CHECK_THROWS_AS(models::Decoder(config, groups, part), ConfigError);
}
