#pragma once
// CUDA kernels behind the router's scores (moe/router_scores.h): one warp per
// token turns its logits into scores, picks its top-k experts and adds its
// terms of the aux and z losses, which a second kernel sums. Raw pointers, so
// that this header and its .cu need no libtorch. Launched on `stream`; they
// never synchronize.
//
// Per token t, with logits l over E experts and lse = logsumexp(l):
// - scores p: softmax(l), or sigmoid(l); normalised scores: p, or p / sum(p).
// - selection: the top-k of p + bias + noise (either may be absent), descending, ties to
//   the lower expert id, NaN counted as +inf; weights: the selected p, divided
//   by their sum when `normalize`.
// All arithmetic is in the logits' type (float32 or float64).

#include <cstdint>

namespace bulkhead::moe::cuda {

constexpr int64_t kMaxScoreExperts = 1024;
constexpr int64_t kMaxScoreTopK = 32;

struct ScoreArgs {
  int64_t tokens = 0, experts = 0, topK = 0;
  bool sigmoid = false;          // else softmax
  bool normalize = true;         // weights renormalised to sum to one per token
  bool doubles = false;          // float64 logits, weights and sums; else float32
  const void* logits = nullptr;  // [T, E] contiguous
  // Selection noise (moe/router_noise.h), drawn in the kernel from each
  // token's key: std * N(0, 1) added to the selection only. Null: none.
  const int64_t* noiseKeys = nullptr;  // [T]
  double noiseStd = 0;
  uint64_t noiseSeed = 0;
  void* stream = nullptr;  // cudaStream_t
};

// Rows of the partial sums below for `tokens` tokens: one per launched warp.
int64_t scorePartialRows(int64_t tokens);

struct ScoreOutputs {
  int64_t* indices = nullptr;     // [T, k] selected expert ids
  void* weights = nullptr;        // [T, k] combine weights
  bool* keep = nullptr;           // [T, k] set to true where not null (dropless routing)
  int64_t* counts = nullptr;      // [E], zeroed by the caller: slots selected per expert
  void* probSum = nullptr;        // [E]: the normalised scores summed over tokens
  void* lseSquaredSum = nullptr;  // []: lse^2 summed over tokens
  // Scratch for those sums: per row, the sum over its tokens; the rows are
  // then summed in a fixed order, so both sums are the same every run.
  void* probPartial = nullptr;  // [rows, E]
  void* lsePartial = nullptr;   // [rows]
};
// Two launches: the warps' kernel, then the sums over its rows. With no
// tokens nothing is launched and nothing written.
void scoreForward(const ScoreArgs& args, const float* bias, const ScoreOutputs& out);

// Gradients reaching the forward's outputs; each may be null (no gradient).
struct ScoreGrads {
  const int64_t* indices = nullptr;     // [T, k] the forward's selection
  const void* weights = nullptr;        // [T, k]
  const void* probSum = nullptr;        // [E]: of the normalised scores summed over tokens
  const void* lseSquaredSum = nullptr;  // []: of lse^2 summed over tokens
};
// gradLogits [T, E], contiguous, every entry written.
void scoreBackward(const ScoreArgs& args, const ScoreGrads& grads, void* gradLogits);

}  // namespace bulkhead::moe::cuda
