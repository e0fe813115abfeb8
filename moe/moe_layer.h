#pragma once
// A Mixture-of-Experts feed-forward layer with expert parallelism (design
// section 7): router -> dispatch over the ep group -> grouped SwiGLU experts
// -> combine -> weighted sum, plus optional shared experts that see every
// token.
//
// Contract:
// - Construction is local (no communication). Every rank of the world builds
//   the layer with the same options; router and shared-expert weights start
//   equal on every rank, expert weights depend only on their global id (see
//   experts.h), so any ep/etp layout computes the same function.
// - forward() runs the same collectives on every rank of the ep group (and of
//   the etp group) whatever tokens it holds, including none; so does backward.
// - Tokens are replicated across the tp group. Expert tensor parallelism must
//   then span exactly that group (etp == tp, same ranks): a ConfigError says
//   so otherwise.
// - Parameters are named "<name>.router.weight", "<name>.experts.w13|w2"
//   (w13: W1 and W3 stacked, see experts.h) and "<name>.shared.w13|w2"
//   (w13 [2, F_s, H]: W1, then W3); expert ones are Expert parameters whose
//   gradients sum over the expert-dp group, the others Dense.
// - The caller adds auxLoss and zLoss to its loss (coefficients applied).
//   Both are means over this rank's tokens (see globalAuxLoss for the counts).
// - The shared expert needs nothing from the router, so on a GPU it runs on
//   a stream of its own (overlapSharedExpert), beside the router, the
//   dispatch's exchanges and the host's wait for the counts; the output
//   waits for it before the sum. Its backward runs on that stream too
//   (autograd runs each backward op on its forward op's stream), launched
//   after the routed backward. Only the order of independent work changes,
//   not what is computed.

#include <ATen/core/Tensor.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "moe/dispatcher.h"
#include "moe/experts.h"
#include "moe/router.h"
#include "moe/static_exchange.h"
#include "parallel/parameter.h"
#include "parallel/process_groups.h"

namespace bulkhead::moe {

struct MoEOptions {
  std::string name = "moe";
  int hidden = 64;
  int ffnHidden = 128;   // per expert, global (before etp)
  RouterOptions router;  // numExperts, topK, losses, capacity, bias
  // Dispatch a token once per destination rank (else once per selected
  // expert). Where nothing travels (the dropless device path at ep 1) both
  // give the once-per-rank sums.
  bool oncePerRank = true;
  // Aux loss from slot counts summed over the dp x cp group (one small
  // all-reduce per step) instead of this rank's alone. P_i stays this rank's
  // mean, so the data-parallel mean of the loss is the global batch's, whatever
  // the layout, when the replicas hold equal numbers of tokens.
  bool globalAuxLoss = false;
  int sharedExpertHidden = 0;       // 0: no shared expert
  bool overlapSharedExpert = true;  // on a GPU: the shared expert on a stream of its own
  double initStd = 0.02;            // 0: zeros, drawn from nothing (weights loaded next)
  uint64_t seed = 1234;
  bool groupedMm = true;
  // Fixed shapes (moe/static_dispatch.h): every expert gets exactly its
  // capacity of rows and nothing is read back to the host, so a CUDA graph can
  // capture the layer. Needs a capacity factor (ConfigError otherwise). At
  // ep > 1 every expert's capacity of rows travels, padding included, in
  // all-to-alls of equal splits (moe/static_exchange.h): every rank of the
  // ep group then needs the same number of tokens. Without it, a dropless
  // layer (capacity 0) at ep 1 on a GPU with grouped products (bf16, at most
  // 512 experts) keeps its counts on the device, with no exchange
  // (moe/static_dispatch.h, droplessDispatch), and can be captured; elsewhere
  // the dispatcher reads its counts on the host, and a forward under
  // CUDA-graph capture is a ConfigError.
  bool staticShapes = false;
  // Static shapes' expert rows: false (the default), every expert's capacity
  // of rows, zero-padded, through batched GEMMs that add each weight gradient
  // to the weight's .grad inside the GEMM (moe/batched_linear.h); true, where
  // grouped products apply, the kept rows packed for at::_grouped_mm, which
  // multiplies T x k rows instead of E x capacity but leaves autograd to add
  // the weight gradients to held ones in a pass of their own. At ep 1 only:
  // at ep > 1 the rows travel padded.
  bool packedStaticRows = false;
  // Each collective of the layer, forward and backward (dispatch, combine,
  // expert-tp, the aux-loss counts); unset: BULKHEAD_COLLECTIVE_TIMEOUT.
  std::optional<std::chrono::milliseconds> timeout;
};

// What the last forward saw on this rank.
struct MoEStats {
  std::vector<int64_t> tokensPerExpert;  // slots this rank's router selected per global expert (before dropping)
  double imbalance = 0;                  // max / mean of tokensPerExpert (1 = balanced; 0 without tokens)
  int64_t droppedSlots = 0;
  double auxLoss = 0, zLoss = 0;
};

struct MoEOutput {
  at::Tensor output;   // same shape as the input
  at::Tensor auxLoss;  // scalars, coefficients applied
  at::Tensor zLoss;
};

class MoELayer {
 public:
  MoELayer(MoEOptions options, const parallel::ProcessGroups& groups, const at::TensorOptions& tensorOptions);

  // tokens: [..., hidden]; flattened to [T, hidden] inside.
  // routingKeys: [...] int64, one per token, its identity for the router's
  // selection noise (RouterOptions::selectionNoise): give the same token the
  // same key in every layout (its index in the global batch and the step, say)
  // and the noise, hence the training run, does not depend on the layout.
  // Undefined: keys from this layer's forward count and the token's index here.
  MoEOutput forward(const at::Tensor& tokens, const at::Tensor& routingKeys = {});

  std::vector<parallel::Parameter> parameters() const;
  // Reads the last forward's counters from the device (one sync), on demand.
  MoEStats stats() const;
  const MoEOptions& options() const { return options_; }
  const GroupedExperts& experts() const { return experts_; }
  const Router& router() const { return router_; }
  Router& router() { return router_; }

  // Aux-loss-free balancing: sums the loads of every forward since the last
  // update (all micro-batches of a step) over the dp x cp group (bounded by
  // `deadline`, by default the layer's collective timeout) and moves the
  // router bias. No-op unless enabled.
  void updateExpertBias(std::optional<Deadline> deadline = std::nullopt);

  // The stream the shared expert runs on beside the routed path, once a
  // forward on a GPU has chosen it (for profiling, and for tests that delay it).
  std::optional<c10::Stream> sharedExpertStream() const { return sharedStream_; }

 private:
  // silu(x W1^T) * x W3^T, then W2: one product for gate and up, as the routed experts do.
  at::Tensor sharedExpert(const at::Tensor& tokens) const;
  // Where the shared expert runs beside the routed path: none on the CPU or when not asked to.
  std::optional<c10::Stream> sharedExpertStreamFor(c10::Device device);
  // The routed experts' output combined per token: the dispatcher's way, or
  // with static shapes the fixed-capacity way; the routing's losses are added
  // while the experts run. `capturing`: the forward runs under CUDA-graph capture.
  at::Tensor routed(const at::Tensor& tokens, Routing& routing, bool capturing);
  // Dropless with every expert here and grouped products on these tokens: no host read, no exchange.
  bool droplessOnDevice(const at::Tensor& tokens) const;
  [[noreturn]] void throwHostCounts() const;
  // The keys select() gets: undefined when no noise applies, else the caller's
  // or the default ones; counts the forward.
  at::Tensor noiseKeys(const at::Tensor& tokens, const at::Tensor& routingKeys);

  MoEOptions options_;
  CommunicatorPtr dpCp_;  // every dense replica of this layer but the tp ones
  int worldRank_;
  int tp_;
  int denseReplica_;  // dense weights: every rank holds a copy, replica 0 writes it
  int expertDpRank_;
  at::Tensor gate_;
  Router router_;
  TokenDispatcher dispatcher_;
  GroupedExperts experts_;
  StaticExchange staticExchange_;            // static shapes at ep > 1: the capacity-padded exchange
  at::Tensor sharedW13_, sharedW2_;          // [2, F_s, H] (W1 then W3), [H, F_s]
  std::optional<c10::Stream> sharedStream_;  // where the shared expert runs on a GPU
  at::Tensor lastLoads_, lastAux_, lastZ_;
  at::Tensor pendingLoads_;  // with expertBias: loads since the last updateExpertBias
  int64_t lastDropped_ = 0;
  int64_t forwards_ = 0;            // forwards run: the default routing keys' high bits
  at::Tensor lastDroppedOnDevice_;  // static shapes: the count, read by stats()
};

}  // namespace bulkhead::moe
