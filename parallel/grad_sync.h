#pragma once
// Data-parallel gradient reduction for training without the distributed
// optimizer: after backward, every replica of a parameter ends with the same
// gradient, the gradient of the loss averaged over data-parallel replicas.
//
// The averaging rule (shared with optim::DistributedOptimizer):
// - Dense parameters: summed over the dp x cp group, divided by its size.
// - Expert parameters: summed over the expert-dp group, divided by the DENSE
//   dp x cp size, not by the expert-dp size. The loss is the mean over dense
//   data-parallel replicas, and an expert's local gradient already sums the
//   contributions of the tokens of every rank of its ep group (they reach it
//   through the all-to-all), so the edp sum covers every replica's tokens
//   once and the mean divides by the number of dense replicas. This holds
//   when each token of a dense replica is dispatched once (tp ranks that share
//   tokens split them before dispatch); otherwise pass another divisor.

#include <optional>
#include <vector>

#include "parallel/parameter.h"
#include "runtime/deadline.h"

namespace bulkhead::parallel {

class ProcessGroups;

// The number summed gradients are divided by, for both groups: dp x cp.
int64_t gradientDivisor(const ProcessGroups& groups);

struct GradSyncOptions {
  // Gradients of one group and dtype are flattened into buckets of at most
  // this many bytes (a larger gradient gets a bucket of its own), one
  // all-reduce per bucket, all in flight together.
  int64_t bucketBytes = int64_t{32} << 20;
  // Covers every bucket; unset: BULKHEAD_COLLECTIVE_TIMEOUT from the call.
  std::optional<Deadline> deadline;
  // Unset: gradientDivisor(groups) for both groups.
  std::optional<int64_t> expertDivisor;
};

// Collective over the dp x cp group (dense) and the expert-dp group (expert):
// every rank of those groups passes the same parameters (names, shapes and
// dtypes) in the same order. A parameter without a gradient gets a zero one
// first, so every rank issues the same all-reduces. Gradients must be on
// the groups' device. bf16 and fp16 gradients are summed and divided in
// float32, then rounded once (as the distributed optimizer reduces them).
void syncGradients(const std::vector<Parameter>& params, const ProcessGroups& groups, GradSyncOptions options = {});

}  // namespace bulkhead::parallel
