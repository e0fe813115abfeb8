// Qwen3-MoE and Mixtral on GPUs against transformers' own GPU numbers (fixtures/hf, written on a GPU by
// fixtures/make_hf_fixtures.py): each fixture loaded in float32 gives transformers' float32 eager logits
// within 1e-4, and in bfloat16 within a mean KL divergence of 1e-4 of transformers' bfloat16 model as
// from_pretrained makes it (SDPA attention, grouped-mm experts). The two still round differently (a float32
// weighted sum of the experts here, a bfloat16 one there), so the bfloat16 logits must also be no farther
// from transformers' float64 ones than transformers' own bfloat16 logits are, within 25%.
// One rank per GPU: every rank holds the whole model (dp), and where the GPUs split the experts, ep too.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "models/config.h"
#include "models/decoder.h"
#include "models/hf_weights.h"
#include "parallel/process_groups.h"
#include "tests/support/catch_compat.h"
#include "tests/support/gpu_helpers.h"

using namespace bulkhead;

namespace {

const std::string kFixtures = BULKHEAD_MODEL_FIXTURES;

at::Tensor referenceOf(const std::string& name, const std::string& key) {
  const checkpoint::SafetensorsFile f(kFixtures + "/" + name + "/" + (key == "input_ids" ? "tokens" : "reference") +
                                      ".safetensors");
  const checkpoint::SafetensorsTensor* t = f.find(key);
  REQUIRE(t != nullptr);
  return f.read(*t);
}

// KL(want || got) per token [rows x seq], both from float32 logits [rows, seq, vocab].
at::Tensor tokenKl(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor logWant = at::log_softmax(want.to(at::kDouble), -1);
  const at::Tensor logGot = at::log_softmax(got.to(at::kDouble), -1);
  return (logWant.exp() * (logWant - logGot)).sum(-1).flatten();
}
double meanKl(const at::Tensor& got, const at::Tensor& want) { return tokenKl(got, want).mean().item<double>(); }
// This rank's whole-vocabulary logits of the fixture at `dtype`, on its GPU, as float32 on the host.
at::Tensor logitsOn(const std::string& name, at::ScalarType dtype, const parallel::ProcessGroups& groups) {
  const std::string folder = kFixtures + "/" + name;
  const models::DecoderConfig config = models::loadDecoderConfig(folder + "/config.json");
  models::Decoder model(config, groups, {.dtype = dtype});
  models::loadHfWeights(model, folder);
  const at::NoGradGuard noGrad;
  const at::Tensor ids = referenceOf(name, "input_ids").to(testing::gpu());
  return model.forward(ids).output.to(at::kFloat).cpu();
}

parallel::LayoutOptions layoutFor(const std::string& name) {
  const models::DecoderConfig config = models::loadDecoderConfig(kFixtures + "/" + name + "/config.json");
  const int world = testing::gpuWorld().size();
  return {.ep = config.experts % world == 0 ? world : 1};
}

}  // namespace

TEST_CASE("every fixture on the GPU gives transformers' float32 and bfloat16 logits", "[gpu]") {
  for (const std::string name : {"qwen3_moe_mixed", "qwen3_moe_kv1", "mixtral"}) {
    const parallel::ProcessGroups groups = parallel::ProcessGroups::create(
        testing::gpuWorldPtr(), layoutFor(name), {.deadline = Deadline::after(std::chrono::seconds(120))});
    const at::Tensor float32 = logitsOn(name, at::kFloat, groups);
    const double error = (float32 - referenceOf(name, "logits_cuda_float32")).abs().max().item<double>();
    const at::Tensor bf16 = logitsOn(name, at::kBFloat16, groups);
    const double kl = meanKl(bf16, referenceOf(name, "logits_cuda_bfloat16"));
    const double klFloat64 = meanKl(bf16, referenceOf(name, "logits"));
    const double transformersKl =
        meanKl(referenceOf(name, "logits_cuda_bfloat16"), referenceOf(name, "logits"));  // its own bf16 error
    const std::string line = fmt::format(
        "{}: float32 max logit error {:.3g}; bfloat16 mean KL {:.3g} from transformers' bfloat16, {:.3g} "
        "from its float64 (transformers' bfloat16: {:.3g})",
        name, error, kl, klFloat64, transformersKl);
    INFO(line);
    if (testing::gpuWorld().rank() == 0) fmt::print("{}\n", line);
    CHECK(error <= 1e-4);
    CHECK(kl <= 1e-4);
    CHECK(klFloat64 <= 1.25 * transformersKl);
  }
}
