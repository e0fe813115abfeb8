#pragma once
// Gradient clipping by the global norm: the 2-norm of the whole model's
// gradient, as if every global parameter were gathered in one place, across
// tp, pp, ep and dp. Every element of a global gradient counts once:
// - data-parallel replicas once (after parallel::syncGradients every replica
//   holds the same gradient: dp x cp rank 0 counts dense parameters, expert-dp
//   rank 0 expert parameters; the distributed optimizer's shards partition the
//   gradient, so there every rank counts its shard);
// - tpReplicated parameters (every tp rank holds the same values) only on tp
//   rank 0 (expert-tp rank 0 for expert parameters);
// - tp-, ep- and pp-split parameters on every rank holding a slice.
// Ranks sum their squares in float64 and one world all-reduce adds them.

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "parallel/parameter.h"
#include "runtime/deadline.h"

namespace bulkhead::parallel {
class ProcessGroups;
}

namespace bulkhead::optim {

// The factor that brings `norm` down to `maxNorm`: maxNorm / (norm + 1e-6)
// when norm > maxNorm > 0, else 1.
double clipScale(double norm, double maxNorm);

// Whether a tpReplicated parameter of `group` counts on this rank (tp rank 0,
// expert-tp rank 0 for experts); a pipelineCopy never counts; other
// parameters always count.
bool countsOnThisTpRank(const parallel::Parameter& param, const parallel::ProcessGroups& groups);

// Adds the squares of `values` to `total` (float64, one element).
void addSquares(at::Tensor& total, const at::Tensor& values);

// sqrt of the sum of every world rank's `partial` (float64, one element on
// the world's device). Collective over the world, under `deadline`.
double worldNorm(at::Tensor partial, const parallel::ProcessGroups& groups, Deadline deadline);

struct ClipOptions {
  // Unset: BULKHEAD_COLLECTIVE_TIMEOUT from the call.
  std::optional<Deadline> deadline;
};

// For the plain optimizer, after parallel::syncGradients: the global norm of
// the gradients of `params` (every rank of the world passes its parameters;
// missing gradients count as zero). When maxNorm > 0 and the norm exceeds it,
// every gradient is scaled by clipScale(norm, maxNorm). Returns the norm
// before clipping. A norm that is not finite (an inf or NaN gradient on any
// rank; every rank returns it alike) scales nothing: skip the optimizer step
// then, as the distributed optimizer does by itself, or the update writes
// NaN into the weights and moments. Collective over the world.
double clipGradNorm(const std::vector<parallel::Parameter>& params, const parallel::ProcessGroups& groups,
                    double maxNorm, ClipOptions options = {});

}  // namespace bulkhead::optim
