// A C++ trainer on Bulkhead's API, start to finish: init, a parallel layout and its groups, a Qwen3-MoE or
// Mixtral language model from a Hugging Face config.json (bulkhead::models; its weights from a Hugging Face
// folder with --hf-model), the distributed optimizer, a checkpoint that holds the config (so that
// `bulkhead-ckpt export DIR --to OUT` writes a folder transformers loads), loaded back. It learns sequences
// in which each token follows from the one before (t' = 5 t + 3 mod vocab), from random first tokens.
//
//   mpirun -np 4 custom_trainer [--ep 2] [--tp 1] [--steps 60] [--model-config FILE | --hf-model DIR]
//                               [--ckpt-dir /tmp/custom_ckpt]
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <chrono>
#include <string>

#include "checkpoint/checkpointer.h"
#include "launch/cli.h"
#include "launch/init.h"
#include "models/config.h"
#include "models/decoder.h"
#include "models/hf_export.h"
#include "models/hf_weights.h"
#include "optim/distributed_optimizer.h"
#include "optim/lr_schedule.h"
#include "parallel/process_groups.h"
#include "runtime/errors.h"

using namespace bulkhead;

// A small Qwen3-MoE: 2 layers, 8 experts top-2, 4 heads over 2 kv heads (used without --model-config).
const char* kSmallQwen3Moe = R"({"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
  "intermediate_size": 128, "moe_intermediate_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
  "norm_topk_prob": true, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
  "tie_word_embeddings": false, "router_aux_loss_coef": 0.01})";

// Model weights and optimizer state, each under its global key, and the config for bulkhead-ckpt export.
checkpoint::StateDict stateOf(const models::Decoder& model, optim::DistributedOptimizer& optimizer, int64_t step) {
  checkpoint::StateDict state;
  for (const auto& parameter : model.parameters())
    state.add(parameter.name, parameter.tensor.detach(), parameter.shard);
  for (const auto& slice : optimizer.state()) state.add(slice.key, slice.local, slice.shard);
  state.dataPosition = std::to_string(step);
  state.user[models::kHfConfigKey] = model.config().text;
  return state;
}

int main(int argc, char** argv) {
  // 0. The command line (CLI11, with Bulkhead's --help, --version and exit codes).
  cli::App app("Trains a Hugging Face MoE language model with Bulkhead's API, saves and loads it back.",
               "custom_trainer");
  int ep = 2, tp = 1, steps = 60;
  std::string dir, modelConfig, hfModel;  // dir default: a folder of this run's own, under /tmp
  app.add_option("--ep", ep, "expert-parallel size")->check(cli::positive());
  app.add_option("--tp", tp, "tensor-parallel size (also expert-tp)")->check(cli::positive());
  app.add_option("--steps", steps, "training steps")->check(cli::positive());
  app.add_option("--model-config", modelConfig, "a qwen3_moe or mixtral config.json (default: a small Qwen3-MoE)");
  app.add_option("--hf-model", hfModel, "a Hugging Face folder: its config.json and weights");
  app.add_option("--ckpt-dir", dir, "checkpoint folder (default: one of its own under /tmp)");
  if (auto code = cli::parse(app, argc, argv)) return *code;

  return guardedMain([&] {
    // 1. The runtime (MPI or NCCL, chosen from the machine) and every group,
    //    built and warmed now rather than at the first collective.
    auto runtime = init();
    auto groups =
        parallel::ProcessGroups::create(runtime->worldPtr(), parallel::LayoutOptions{.tp = tp, .ep = ep, .etp = tp});
    const int rank = runtime->world().rank();

    // 2. The model: every rank builds its own slices (heads and vocabulary over tp, experts over ep), and
    //    with --hf-model reads only those slices' bytes from the folder.
    const models::DecoderConfig config = !hfModel.empty() ? models::loadDecoderConfig(hfModel + "/config.json")
                                         : !modelConfig.empty()
                                             ? models::loadDecoderConfig(modelConfig)
                                             : models::parseDecoderConfig(kSmallQwen3Moe, "built-in");
    models::Decoder model(config, groups, {.initStd = hfModel.empty() ? 0.02 : 0.0});
    if (!hfModel.empty()) models::loadHfWeights(model, hfModel);

    // 3. AdamW with state sharded over dp (dense) and expert dp (experts).
    optim::DistributedOptimizer optimizer(model.parameters(), groups);
    const optim::LrSchedule schedule{.peak = 3e-3, .min = 3e-4, .warmupSteps = 5, .totalSteps = steps};

    const auto device = at::TensorOptions(at::kLong).device(runtime->device());
    auto batch = [&](int64_t step) {  // 8 sequences of 17 tokens on each dp rank
      at::manual_seed(1000 * step + groups.dp()->rank());
      std::vector<at::Tensor> tokens{at::randint(config.vocab, {8, 1}, at::kLong)};
      for (int i = 0; i < 16; ++i) tokens.push_back((tokens.back() * 5 + 3) % config.vocab);
      return at::cat(tokens, 1).to(device);
    };
    auto lossAt = [&](int64_t step, bool train) {
      const at::Tensor ids = batch(step);
      const int64_t length = ids.size(1) - 1;
      models::DecoderOutput out = model.forward(ids.narrow(1, 0, length));
      const at::Tensor loss = model.tokenLosses(out.output, ids.narrow(1, 1, length)).mean();
      if (train) {
        (loss + out.auxLoss).backward();
        optimizer.step(schedule.at(step), {.maxGradNorm = 1.0});
        optimizer.zeroGrad();
      }
      at::Tensor mean = loss.detach().to(at::kDouble).reshape({1}).clone();
      groups.dp()->allReduce(mean)->wait();
      return mean.item<double>() / groups.dp()->size();
    };

    // 4. Train, printing the data-parallel mean loss.
    if (rank == 0)
      fmt::print("{}: {} layers, {} experts top-{}, {:.3g}M parameters, tp {} ep {} dp {}\n", config.modelType,
                 config.layers, config.experts, config.topK, models::parameterCount(config) / 1e6, tp, ep,
                 groups.dp()->size());
    for (int64_t step = 0; step < steps; ++step) {
      const double loss = lossAt(step, true);
      if (rank == 0 && (step % 10 == 0 || step + 1 == steps)) fmt::print("step {:>3}  loss {:.5f}\n", step, loss);
    }

    // 5. Save (async: returns once tensors are in host memory), wait, load
    //    back into the live tensors, and check the loss is what it was.
    if (dir.empty()) {  // rank 0's clock names it, so a rerun never meets an old step folder
      at::Tensor stamp = at::full({1}, std::chrono::system_clock::now().time_since_epoch().count(), at::kLong);
      runtime->cpuWorld().broadcast(stamp, 0)->wait(Deadline::afterSeconds(30));
      dir = fmt::format("/tmp/bulkhead_custom_trainer_{}", stamp.item<int64_t>());
    }
    auto checkpointer =
        checkpoint::Checkpointer::create({.dir = dir, .keep = 2}, runtime->store(), rank, runtime->world().size());
    checkpointer->save(steps, stateOf(model, optimizer, steps));
    auto saved = checkpointer->wait(Deadline::afterSeconds(60));
    const c10::NoGradGuard noGrad;
    const double before = lossAt(steps, false);
    for (const auto& parameter : model.parameters()) parameter.tensor.mul_(0.5);  // disturb: the load restores
    checkpoint::StateDict targets = stateOf(model, optimizer, 0);
    auto loaded = checkpointer->load(targets, {.step = steps});
    optimizer.afterLoad();
    const double after = lossAt(steps, false);
    if (rank == 0) {
      fmt::print("saved {} ({}), loaded step {}: loss {:.6f} before, {:.6f} after\n", saved.path,
                 saved.ok ? "committed" : saved.error, loaded.step, before, after);
      fmt::print("a Hugging Face folder of it: bulkhead-ckpt export {} --to OUT\n", dir);
    }
    runtime->shutdown();
    return saved.ok && before == after ? 0 : 1;
  });
}
