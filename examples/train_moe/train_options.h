#pragma once
// train_moe's command line, and the parameter digest its resume tests compare.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "examples/train_moe/model.h"
#include "examples/train_moe/training_data.h"
#include "launch/cli.h"
#include "launch/init.h"
#include "parallel/parameter.h"
#include "runtime/communicator.h"

namespace bulkhead::examples {

// A Hugging Face model (docs/models.md) in place of the built-in one.
struct HfOptions {
  std::string model;        // --hf-model: a folder with config.json and safetensors
  std::string modelConfig;  // --model-config: a config.json alone (random weights)
  std::string tokens;       // --tokens: safetensors holding input_ids int64 [rows, seq], evaluated with --steps 0
  std::string logitsOut;    // --logits-out: the logits of --tokens, [rows, seq, vocab]
  std::optional<at::ScalarType> logitsDtype;  // unset: the model's dtype
  // RMSNorms, RoPE tables and softmaxes in float32, as transformers computes them; false: in the model's
  // dtype where it is wider (float64 throughout, docs/models.md#numerics).
  bool float32Internals = true;
  bool recompute = false;  // --recompute: each layer's activations recomputed in the backward
  bool any() const { return !model.empty() || !modelConfig.empty(); }
};

struct TrainOptions {
  std::optional<Backend> backend;  // unset: BULKHEAD_BACKEND
  int tp = 1, ep = 1, pp = 1;
  int virtualStages = 1;         // model chunks per pipeline rank (interleaved 1F1B when > 1)
  int microBatches = 1;          // per step, run through the pipeline schedule
  int spares = 0;                // processes waiting to replace a lost rank (launch/recovery.h)
  int64_t snapshotEvery = 1;     // steps between in-memory snapshots, with spares
  bool snapshotInPlace = false;  // GPU state copied to the host in place, without the device copy
  ModelConfig model;
  HfOptions hf;
  DataOptions data;
  int sequence = 64;
  int globalBatch = 16;   // sequences per step, over all data-parallel ranks
  int64_t steps = 200;    // the schedule's length; 0: evaluate --tokens only
  int64_t stopAfter = 0;  // > 0: stop (and save) after this step, as a job time limit would
  double lr = 2e-3;
  int64_t warmup = 20;
  double clip = 1.0;
  int logInterval = 25;
  std::string checkpointDir;
  int64_t checkpointInterval = 0;  // 0: only at the end
  int keep = 3;
  std::string resume;   // "latest", a step number, or empty
  std::string lossLog;  // rank 0 appends "step loss grad_norm" per step
  bool printDigest = false;
  std::string profile;      // Chrome trace of 5 steps after 10 of warm-up; empty: none
  bool gradOverlap = true;  // gradient reduce-scatters during the backward
  // bf16 gradients reduce-scattered in bf16, not float32: on 4 H100s 5-10% more tokens/s, and the
  // 200-step loss within the run-to-run spread (bench/results/train_grad_reduce_h100x4_2026-11-28.md).
  bool gradReduceBf16 = true;
  // AdamW's moments (of float32 masters) in bfloat16, not float32: 8 bytes of
  // state a parameter less (optim::AdamWOptions::momentType).
  bool bf16Moments = false;
  // Forward and backward captured in a CUDA graph and replayed each step
  // (examples/train_moe/captured_step.h): needs a GPU, --capacity and pp 1.
  bool cudaGraph = false;
  // The MoE layers' fixed shapes without the capture (what --cuda-graph
  // replays, run eagerly): needs --capacity.
  bool staticShapes = false;
};

// train_moe's flags, writing into `options` (parse with cli::parse).
void addTrainFlags(CLI::App& app, TrainOptions& options);

// "parameter digest: <hex per rank>": an FNV-1a hash of every local parameter's
// bytes, in name order, gathered over `cpuWorld` (collective).
std::string parameterDigest(const std::vector<parallel::Parameter>& parameters, Communicator& cpuWorld);

}  // namespace bulkhead::examples
