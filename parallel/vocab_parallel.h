#pragma once
// A vocabulary-parallel embedding and cross-entropy over the tp group
// (Megatron-LM's VocabParallelEmbedding and vocab_parallel_cross_entropy).
// tp rank r holds the rows partition(vocab, tp, r) of the global [vocab, dim]
// table "<name>.weight" (uneven vocabularies allowed: the first vocab % tp
// ranks hold one row more), so the logits of a tied output layer are split
// along the vocabulary and never gathered.

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

#include "parallel/parameter.h"
#include "parallel/shard_init.h"
#include "parallel/tensor_parallel.h"

namespace bulkhead::parallel {

struct VocabEmbeddingOptions {
  double initStd = 0.02;
  uint64_t seed = 0;
  at::ScalarType dtype = at::kFloat;
};

class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding(std::string name, int64_t vocabSize, int64_t dim, TpGroup group,
                         VocabEmbeddingOptions options = {});
  // Token ids [...] (int64, any id in [0, vocab)) -> [..., dim], the same on
  // every tp rank: each rank looks up the ids in its rows, zeros the others,
  // and the results are summed over tp.
  at::Tensor forward(const at::Tensor& ids) const;
  // The tied output layer: hidden [..., dim] (replicated over tp) -> this
  // rank's block of the logits [..., vocabRange().length]; feed them to
  // vocabParallelCrossEntropy with vocabRange().begin.
  at::Tensor logits(const at::Tensor& hidden) const;
  std::vector<Parameter> parameters() const;
  const at::Tensor& weight() const { return weight_; }
  Range vocabRange() const { return rows_; }
  int64_t vocabSize() const { return vocab_; }

 private:
  std::string name_;
  TpGroup group_;
  int64_t vocab_, dim_;
  Range rows_;
  at::Tensor weight_;
};

// Per-token cross-entropy of logits split along the vocabulary: `logits`
// [..., Vr] holds vocabulary entries [vocabBegin, vocabBegin + Vr) of this tp
// rank, `targets` [...] the global target ids. Returns the loss per token
// [...] (take its mean for the usual loss), the same on every tp rank, in the
// logits' dtype (computed in at least float32). Forward: two all-reduces over
// tp (max, then the target logit and the sum of exponentials together);
// backward: none (each rank's gradient is softmax minus one-hot on its block,
// a closed form without a graph: a double backward raises ConfigError).
at::Tensor vocabParallelCrossEntropy(const at::Tensor& logits, const at::Tensor& targets, int64_t vocabBegin,
                                     const TpGroup& group);

}  // namespace bulkhead::parallel
