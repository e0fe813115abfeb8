#pragma once
// The router of a MoE layer (docs/design.md#the-moe-layer): a linear gate scores every
// token against every expert and picks its top-k experts.
//
// Contract:
// - Scores are softmax or sigmoid of the gate's logits, computed in at least
//   float32. Selection takes the top-k of scores + expertBias (the bias steers
//   selection only, "aux-loss-free" balancing); the combine weights are the
//   unbiased scores of the selected experts, renormalised to sum to one per
//   token when normalizeWeights is set. Exact ties (float32 sigmoid saturates
//   at 1) go to the lower expert id on the GPU's fused path; the ATen path
//   leaves their order to at::topk.
// - auxLoss = auxLossCoeff * E * sum_i f_i * P_i (Switch/GShard), f_i the
//   fraction of this rank's token-slots selected for expert i, P_i the mean
//   (per-token normalised) score of expert i. Only P carries a gradient.
//   zLoss = zLossCoeff * mean_t logsumexp(logits_t)^2. Both are computed over
//   this rank's tokens, so they do not depend on the ep size.
// - capacityFactor > 0 caps every expert at ceil(capacityFactor * T * k / E)
//   token-slots of this rank; an expert keeps its slots with the highest
//   weights (ties: the lower token index) and the others are dropped (their
//   keep flag is false, their weight is not redistributed). 0: dropless.
// - The bias lives outside autograd; updateBias moves each expert's bias by
//   biasUpdateRate towards balance (+rate when underloaded, -rate when
//   overloaded) from loads the caller has summed over the data-parallel group,
//   so every replica of the router keeps the same bias.
// - selectionNoise > 0 (noisy top-k gating, as Shazeer et al. 2017 add noise
//   to the gate for balance): while autograd records (training), the
//   selection is the top-k of scores + bias + noise, noise[t, e] = selectionNoise
//   * N(0, 1), a pure function of (noiseSeed, the token's key, e); the weights
//   and both losses keep the clean scores. Tokens whose scores are near-equal
//   (early in training, or tokens the gate cannot tell apart yet) spread over
//   the experts instead of all taking the same few. Under a no-grad guard
//   (evaluation, inference) the selection is deterministic, without noise.

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace bulkhead::moe {

enum class ScoreFunction { Softmax, Sigmoid };

struct RouterOptions {
  int numExperts = 8;
  int topK = 2;
  ScoreFunction scoreFunction = ScoreFunction::Softmax;
  bool normalizeWeights = true;
  double auxLossCoeff = 1e-2;
  double zLossCoeff = 1e-3;
  bool expertBias = false;  // aux-loss-free balancing
  double biasUpdateRate = 1e-3;
  double capacityFactor = 0;  // 0: dropless
  double selectionNoise = 0;  // std of the selection noise in score units; 0: off
  uint64_t noiseSeed = 0;
  // Scores, selection and weights in float32 even for float64 tokens, from logits in the tokens' dtype
  // (Hugging Face's Qwen3-MoE and Mixtral routers: softmax(logits, dtype=float32), then top-k and the
  // renormalisation in float32). The weights are float32; the combine promotes them exactly.
  bool float32Scores = false;
};

struct Routing {
  at::Tensor indices;  // [T, k] int64 global expert ids
  at::Tensor weights;  // [T, k] combine weights (autograd), dtype of the scores
  at::Tensor keep;     // [T, k] bool; false where capacity dropped the slot
  // With a capacity: [T, k] int64, each slot's place among its expert's slots
  // (best weight first, ties by slot order); kept where it is below the capacity.
  at::Tensor position;
  at::Tensor auxLoss;          // scalar, coefficient applied
  at::Tensor zLoss;            // scalar, coefficient applied
  at::Tensor tokensPerExpert;  // [E] int64: slots selected per expert, before dropping
  at::Tensor meanProb;         // [E] P_i over this rank's tokens (autograd; zeros without tokens)
  int64_t droppedSlots = 0;    // counted on the host, unless select() was told not to
  at::Tensor dropped;          // with a capacity: the same count, a 0-dim int64 tensor on the device
  at::Tensor logits;           // [T, E] in the score dtype (autograd)
  // addLosses' inputs, not for callers: scores [T, E] may be undefined (the
  // GPU's fused path keeps only their sums probSum and lseSquaredSum); read
  // meanProb, auxLoss and zLoss instead.
  at::Tensor scores, probSum, lseSquaredSum;
};

class Router {
 public:
  // gateWeight: [E, H], the caller's parameter.
  Router(RouterOptions options, at::Tensor gateWeight);

  // tokens [T, H]: select, then addLosses.
  Routing route(const at::Tensor& tokens, const at::Tensor& noiseKeys = {}) const;

  // route() in two steps: the selection (indices, weights, keep, dropped
  // slots), then the losses, meanProb and tokensPerExpert, from the Routing
  // select() returned, unchanged (the fused path's sums come with it). The
  // layer adds the losses after the dispatch, so their small kernels are
  // launched while the experts run rather than before the dispatch's sync.
  // hostCounts = false: no read back to the host (droppedSlots stays 0; read
  // `dropped`), so a CUDA graph can capture the selection.
  // noiseKeys: [T] int64, each token's identity for the selection noise (the
  // same token must have the same key in every layout and on every rank that
  // routes it); required while the noise applies (ConfigError otherwise).
  Routing select(const at::Tensor& tokens, bool hostCounts = true, const at::Tensor& noiseKeys = {}) const;
  // Whether select() adds noise now: selectionNoise > 0 and autograd records.
  bool noisy() const;
  void addLosses(Routing& routing) const;

  // coeff * E * sum_i (slots_i / totalSlots) * meanProb_i: the aux loss from
  // slot counts gathered over any set of ranks (see MoEOptions::globalAuxLoss).
  at::Tensor switchLoss(const at::Tensor& slotsPerExpert, double totalSlots, const at::Tensor& meanProb) const;

  // loads: [E] slot counts summed over the data-parallel group.
  void updateBias(const at::Tensor& loads);
  const at::Tensor& bias() const { return bias_; }
  const RouterOptions& options() const { return options_; }

 private:
  RouterOptions options_;
  at::Tensor gate_;
  at::Tensor bias_;  // [E] float32, zero until updated
};

// How many entries of `values` (int64, each in [0, bins)) equal each of
// 0..bins-1. Unlike at::bincount, no device sync on CUDA.
at::Tensor countValues(const at::Tensor& values, int64_t bins);

// The capacity policy on its own (exposed for tests): each slot's place among
// its expert's slots of `indices` ranked by `weights` (descending, ties by slot
// order), and keep flags: at most `capacity` per expert. Every index in
// [0, numExperts); on a GPU with float32 weights the positions come from
// moe/router_scores.h's capacityPositionKernels.
at::Tensor capacityPosition(const at::Tensor& indices, const at::Tensor& weights, int numExperts);
at::Tensor capacityKeep(const at::Tensor& indices, const at::Tensor& weights, int numExperts, int64_t capacity);

}  // namespace bulkhead::moe
