#pragma once
// The routed experts of one ep rank: SwiGLU MLPs, y = (silu(x W1^T) * x W3^T) W2^T,
// computed for all local experts at once as grouped matrix products: one for
// the gate and up projections together (W1 and W3 stacked as w13), one for W2.
//
// Contract:
// - Weights are stacked per local expert: w13 [E_local, 2, F_local, H] (W1
//   then W3), w2 [E_local, H, F_local], F_local = ffnHidden / etp. Their
//   global tensors are [E, 2, F, H] and [E, H, F], indexed by global expert
//   id; this rank's slice starts at expert firstExpert and at column
//   etpRank * F_local of F.
// - Initial values depend only on (seed, global expert id, matrix), so every
//   layout starts from the same global weights (initSeed).
// - With etp > 1 every rank of the expert-tp group must pass identical
//   inputs; the partial products of w2 are summed over that group.
// - Grouped products: at::_grouped_mm on CUDA where this libtorch has it
//   (bf16, hidden and F_local multiples of 8: rows of whole 16-byte units),
//   otherwise one matrix product per expert. On Hopper GPUs, Bulkhead's own
//   kernels replace at::_grouped_mm where they apply (moe/grouped_products.h). The choice is made from the
//   options, so a shape _grouped_mm refuses fails on no rank (a rank with no
//   rows multiplies nothing either way). Experts with no rows still take part,
//   so every weight gets a gradient (zeros).
// - Padded groups (forwardPadded, every expert the same number of rows): one
//   strided batched GEMM per projection on every device; the weight gradients
//   go into w13.grad() and w2.grad() in place (moe/batched_linear.h).

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "parallel/parameter.h"
#include "runtime/communicator.h"

namespace bulkhead::moe {

struct ExpertOptions {
  int numExperts = 8;  // global
  int hidden = 64;
  int ffnHidden = 128;    // global, before etp sharding
  double initStd = 0.02;  // 0: zeros of this rank's share only (weights loaded next)
  uint64_t seed = 1234;
  bool groupedMm = true;  // use at::_grouped_mm where available and the shapes fit (see above)
  std::optional<std::chrono::milliseconds> timeout;  // expert-tp collectives
};

class GroupedExperts {
 public:
  // expertTp: the etp group (size 1 without expert tensor parallelism).
  GroupedExperts(ExpertOptions options, int firstExpert, int localExperts, CommunicatorPtr expertTp,
                 const at::TensorOptions& tensorOptions);

  // tokens [N, H] ordered by local expert; counts: rows per local expert on
  // the host; groupEnds: their running sum as int32 on the tokens' device.
  // counts may be empty where groupedFor(tokens): the device ends suffice.
  at::Tensor forward(const at::Tensor& tokens, const std::vector<int64_t>& counts, const at::Tensor& groupEnds) const;
  // tokens [E_local * C, H], C rows per local expert (padded groups): one
  // strided batched GEMM per projection, each weight gradient added to the
  // weight's .grad inside its GEMM (moe/batched_linear.h). keptRows (optional,
  // int32 [E_local] on the tokens' device): each expert's rows after its first
  // keptRows[e] are zero, and the activation between the products skips them.
  at::Tensor forwardPadded(const at::Tensor& tokens, const at::Tensor& keptRows = {}) const;
  // Whether rows like `tokens` go through at::_grouped_mm (which takes the
  // group ends on the device and needs no counts on the host).
  bool groupedFor(const at::Tensor& tokens) const;

  // Names are prefix + ".w13" and ".w2"; replicaId is the caller's (expert-dp rank).
  std::vector<parallel::Parameter> parameters(const std::string& prefix, int replicaId) const;

  const at::Tensor& w13() const { return w13_; }
  const at::Tensor& w2() const { return w2_; }

 private:
  template <typename Products>
  at::Tensor overExpertTp(const at::Tensor& tokens, Products products) const;

  ExpertOptions options_;
  bool groupedMm_;  // options_.groupedMm where the shapes fit at::_grouped_mm
  int firstExpert_;
  CommunicatorPtr expertTp_;
  at::Tensor w13_, w2_;
};

// rows [N, K] grouped by `counts`, weights [G, Out, K] -> [N, Out]: each
// group's rows times its weight transposed. groupEnds: the running sum of
// counts as int32 on the rows' device (what at::_grouped_mm takes), shared by
// the calls of one step; undefined where no grouped matrix product applies.
// counts may be empty when groupEnds is defined (the last end is then N).
at::Tensor groupedLinear(const at::Tensor& rows, const at::Tensor& weights, const std::vector<int64_t>& counts,
                         const at::Tensor& groupEnds);

// The seed of one initial matrix's generator: (layer seed, kind, id) mixed by
// splitmix64, so that the matrices of a layer draw from unrelated streams
// (the CPU generator keeps 32 bits of a seed: two matrices coincide with odds
// of one in 2^32 per pair). Kinds: 1-3 expert W1, W2, W3 with id the global
// expert; 101 the router gate, 102 the shared expert's w13 and 104 its w2,
// id 0 (103 was its w3 before W1 and W3 were stacked).
uint64_t initSeed(uint64_t seed, uint64_t kind, uint64_t id);

// groupEnds for groupedLinear: `groupEnds` where at::_grouped_mm serves these
// rows (libtorch has it, CUDA bf16 rows, some rows, `allowed`), else undefined.
at::Tensor groupEndsFor(const at::Tensor& rows, const at::Tensor& groupEnds, bool allowed);

}  // namespace bulkhead::moe
