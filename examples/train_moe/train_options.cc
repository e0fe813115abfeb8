#include "examples/train_moe/train_options.h"

#include <ATen/ATen.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "runtime/dtype.h"

namespace bulkhead::examples {

void addTrainFlags(CLI::App& app, TrainOptions& o) {
  auto& m = o.model;
  const CLI::Validator positive = cli::positive();
  const CLI::Validator count = cli::nonNegative();
  // Layout.
  app.add_option("--tp", o.tp, "tensor-parallel size (expert-tp too)")->check(positive)->group("Layout");
  app.add_option("--ep", o.ep, "expert-parallel size")->check(positive)->group("Layout");
  app.add_option("--pp", o.pp, "pipeline-parallel size (the layers split evenly over the stages)")
      ->check(positive)
      ->group("Layout");
  app.add_option("--vpp", o.virtualStages, "model chunks per pipeline rank (interleaved 1F1B when above 1)")
      ->check(positive)
      ->group("Layout");
  app.add_option("--microbatches", o.microBatches, "micro-batches per step, through the pipeline schedule")
      ->check(positive)
      ->group("Layout");
  cli::addBackend(app, o.backend)->group("Layout");
  app.add_option("--spares", o.spares,
                 "processes of the job that wait to take a lost rank's place (the launcher's last ranks; needs "
                 "a job started without MPI and bulkhead-store)")
      ->check(count)
      ->group("Recovery");
  app.add_option("--snapshot-every", o.snapshotEvery, "steps between the in-memory snapshots a recovery resumes from")
      ->check(positive)
      ->group("Recovery");
  app.add_flag("--snapshot-in-place", o.snapshotInPlace,
               "copy GPU state to the host in place at each snapshot, without a device copy downloaded behind the "
               "training: saves that GPU memory, holds each snapshot's step up")
      ->group("Recovery");
  // Model.
  app.add_option("--layers", m.layers, "transformer layers")->check(positive)->group("Model");
  app.add_option("--hidden", m.hidden, "model width")->check(positive)->group("Model");
  app.add_option("--heads", m.heads, "attention heads")->check(positive)->group("Model");
  app.add_option("--ffn", m.ffn, "each expert's hidden size")->check(positive)->group("Model");
  app.add_option("--experts", m.experts, "experts per MoE layer")->check(positive)->group("Model");
  app.add_option("--topk", m.topK, "experts each token goes to")->check(positive)->group("Model");
  app.add_option("--shared-ffn", m.sharedFfn, "a shared expert of this hidden size (0: none)")
      ->check(count)
      ->group("Model");
  app.add_option("--aux-coeff", m.auxLossCoeff, "load-balancing loss coefficient")->check(count)->group("Model");
  app.add_option("--z-coeff", m.zLossCoeff, "router z-loss coefficient")->check(count)->group("Model");
  app.add_option("--router-noise", m.routerNoise,
                 "std of the noise on the router's scores when it picks experts in training (0: none)")
      ->check(count)
      ->group("Model");
  app.add_flag("--tied-embedding", m.tiedEmbedding, "the output layer is the embedding matrix")->group("Model");
  app.add_option("--capacity", m.capacityFactor, "expert capacity factor (0: dropless)")->check(count)->group("Model");
  app.add_flag_callback(
         "--per-slot", [&m] { m.oncePerRank = false; },
         "dispatch once per selected expert, not once per destination rank")
      ->group("Model");
  app.add_option_function<std::string>(
         "--dtype", [&m](const std::string& name) { m.dtype = *parseDtype(name); }, "parameter and activation dtype")
      ->check(CLI::IsMember({"float32", "float64", "bfloat16"}))
      ->default_str("float32")
      ->group("Model");
  app.add_option("--seed", m.seed, "seed of the weights and the data (Megatron's --seed for a dataset's order)")
      ->group("Model");
  app.add_option("--vocab", m.vocab, "vocabulary size (256: bytes); every token id of the data must be below it")
      ->check(positive)
      ->group("Model");
  // A Hugging Face model.
  auto& hf = o.hf;
  app.add_option("--hf-model", hf.model,
                 "a Hugging Face folder (config.json, model.safetensors or a sharded index) of a qwen3_moe or "
                 "mixtral model; each rank reads only its own slices")
      ->group("Hugging Face");
  app.add_option("--model-config", hf.modelConfig, "a Hugging Face config.json: that model from random weights")
      ->group("Hugging Face");
  app.add_option("--tokens", hf.tokens,
                 "with --steps 0: print the LM loss of these token ids (safetensors, input_ids int64 [rows, seq])")
      ->group("Hugging Face");
  app.add_option("--logits-out", hf.logitsOut, "with --tokens: write their logits [rows, seq, vocab] (safetensors)")
      ->group("Hugging Face");
  app.add_option_function<std::string>(
         "--logits-dtype", [&hf](const std::string& name) { hf.logitsDtype = *parseDtype(name); },
         "the dtype of --logits-out (default: the model's)")
      ->check(CLI::IsMember({"float32", "float64", "bfloat16"}))
      ->group("Hugging Face");
  app.add_flag("--float32-internals,!--no-float32-internals", hf.float32Internals,
               "RMSNorm, RoPE and the softmaxes in float32 as transformers computes them (the default), or in the "
               "model's dtype where it is wider (float64 throughout)")
      ->group("Hugging Face");
  app.add_flag("--recompute", hf.recompute,
               "recompute each layer's activations in the backward: memory for one layer's activations instead of "
               "every layer's, for about a third more compute (the same gradients)")
      ->group("Hugging Face");
  // Data.
  auto& d = o.data;
  app.add_option("--data-path", d.dataPath,
                 "indexed datasets (Megatron's .bin/.idx prefixes), or weight prefix pairs to blend; none: the "
                 "generated corpus")
      ->group("Data");
  app.add_option("--split", d.split, "train, valid and test weights of each dataset's sequences")->group("Data");
  app.add_option("--data-cache-path", d.cacheDir, "where the sample indices are cached (none: rebuilt each run)")
      ->group("Data");
  app.add_option("--eod", d.eod, "the end-of-document token id")->check(count)->group("Data");
  app.add_flag("--eod-mask-loss", d.eodMaskLoss, "targets after an end-of-document input do not count")->group("Data");
  app.add_option("--eval-interval", d.evalInterval, "steps between validation losses on the valid split (0: none)")
      ->check(count)
      ->group("Data");
  app.add_option("--eval-iters", d.evalIters, "global batches of the valid split each validation reads")
      ->check(positive)
      ->group("Data");
  app.add_flag("--data-changed-ok", d.dataChangedOk,
               "resume against data other than the checkpoint's, from the same consumed-sample count")
      ->group("Data");
  app.add_option("--data-log", d.dataLog, "a folder where each rank appends 'step sample digest' per row it trains on")
      ->group("Tests");
  // Data and training.
  app.add_option("--seq", o.sequence, "sequence length")->check(positive)->group("Training");
  app.add_option("--batch", o.globalBatch, "sequences per step over all data-parallel ranks")
      ->check(positive)
      ->group("Training");
  app.add_option("--steps", o.steps, "length of the schedule (0: only evaluate --tokens)")
      ->check(count)
      ->group("Training");
  app.add_option("--stop-after", o.stopAfter, "stop (and save) after this step, as a job time limit would; 0: never")
      ->check(count)
      ->group("Training");
  app.add_option("--lr", o.lr, "peak learning rate")->check(positive)->group("Training");
  app.add_option("--warmup", o.warmup, "warm-up steps")->check(count)->group("Training");
  app.add_flag("--grad-overlap,!--no-grad-overlap", o.gradOverlap,
               "reduce-scatter gradient buckets during the backward (the default), or all at the optimizer step")
      ->group("Training");
  app.add_flag("--grad-reduce-bf16,!--grad-reduce-fp32", o.gradReduceBf16,
               "reduce-scatter bf16 gradients in bf16 (the default: half the bytes, each addition rounded) or in "
               "float32")
      ->group("Training");
  app.add_option_function<std::string>(
         "--moment-dtype", [&o](const std::string& name) { o.bf16Moments = name == "bfloat16"; },
         "dtype of AdamW's moments: float32, or bfloat16 (8 bytes of state a parameter less; Megatron-LM's "
         "--exp-avg-dtype bf16); a checkpoint resumes with the dtype it was saved with")
      ->check(CLI::IsMember({"float32", "bfloat16"}))
      ->default_str("float32")
      ->group("Training");
  app.add_flag("--cuda-graph", o.cudaGraph,
               "capture each step's forward and backward in a CUDA graph and replay it (GPU, --capacity, pp 1)")
      ->group("Training");
  app.add_flag("--static-shapes", o.staticShapes,
               "the MoE layers' fixed shapes (capacity-padded exchanges, no counts read on the host), eagerly")
      ->group("Training");
  app.add_option("--clip", o.clip, "global gradient-norm clip (0: none)")->check(count)->group("Training");
  app.add_option("--log-interval", o.logInterval, "steps between log lines")->check(positive)->group("Training");
  // Checkpoints.
  app.add_option("--ckpt-dir", o.checkpointDir, "checkpoint folder (empty: no checkpoints)")->group("Checkpoints");
  app.add_option("--ckpt-interval", o.checkpointInterval, "steps between saves (0: only at the end)")
      ->check(count)
      ->group("Checkpoints");
  app.add_option("--keep", o.keep, "committed checkpoints kept (0: all)")->check(count)->group("Checkpoints");
  app.add_option("--resume", o.resume, "latest or a step number")->group("Checkpoints");
  // Tests.
  app.add_option("--loss-log", o.lossLog, "rank 0 appends 'step loss grad_norm' per step to this file")->group("Tests");
  app.add_option("--profile", o.profile,
                 "Chrome trace of 5 steps after 10 of warm-up (GPU builds; see bench/profile_summary.py)")
      ->group("Training");
  app.add_flag("--digest", o.printDigest, "print a digest of every rank's parameters at the end")->group("Tests");
}

std::string parameterDigest(const std::vector<parallel::Parameter>& parameters, Communicator& cpuWorld) {
  std::vector<const parallel::Parameter*> sorted;
  for (const auto& parameter : parameters) sorted.push_back(&parameter);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->name < b->name; });
  uint64_t hash = 1469598103934665603ULL;
  for (const auto* parameter : sorted) {
    at::Tensor bytes = parameter->tensor.detach().to(at::kCPU).contiguous();
    const auto* data = static_cast<const unsigned char*>(bytes.data_ptr());
    for (size_t i = 0; i < bytes.nbytes(); ++i) hash = (hash ^ data[i]) * 1099511628211ULL;
  }
  at::Tensor mine = at::full({1}, static_cast<int64_t>(hash), at::kLong);
  at::Tensor all = at::empty({cpuWorld.size()}, at::kLong);
  cpuWorld.allGather(mine, all)->wait();
  std::vector<std::string> hex;
  for (int rank = 0; rank < cpuWorld.size(); ++rank)
    hex.push_back(fmt::format("{:016x}", static_cast<uint64_t>(all[rank].item<int64_t>())));
  return fmt::format("parameter digest: {}", fmt::join(hex, " "));
}

}  // namespace bulkhead::examples
