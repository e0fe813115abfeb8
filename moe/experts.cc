#include "moe/experts.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#if __has_include(<ATen/ops/_grouped_mm.h>)
#include <ATen/ops/_grouped_mm.h>
#define BULKHEAD_HAVE_GROUPED_MM 1
#else
#define BULKHEAD_HAVE_GROUPED_MM 0
#endif

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <utility>
#include <vector>

#include "moe/batched_linear.h"
#include "moe/grouped_products.h"
#include "moe/swiglu.h"
#include "parallel/tensor_parallel.h"
#include "runtime/cpu_share.h"
#include "runtime/errors.h"
#include "runtime/log.h"
#include "runtime/parallel_for.h"

namespace bulkhead::moe {
namespace {

// Global expert `expert`'s full matrix number `matrix`, from a generator of
// its own: the same values whatever the layout. Drawn into `buffer` (float64,
// grown as needed), which a thread reuses from one draw to the next: no fresh
// pages for the kernel to clear at every matrix.
at::Tensor expertMatrix(const ExpertOptions& options, int expert, int matrix, int64_t rows, int64_t columns,
                        at::Tensor& buffer) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(initSeed(options.seed, matrix, expert));
  if (!buffer.defined() || buffer.numel() < rows * columns) buffer = at::empty({rows * columns}, at::kDouble);
  return buffer.narrow(0, 0, rows * columns).view({rows, columns}).normal_(0.0, options.initStd, generator);
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Draws this rank's experts into w13 and w2 (their expert-tp columns from `column`), as many experts at a
// time as the rank has CPUs, each helper thread into a float64 buffer of its own. Weights on the host are
// written in place by the helpers; for weights on a GPU the helpers round the slices to the weights' dtype
// on the host (as copy_ rounds a host tensor bound for a GPU) and the caller's thread copies them over,
// on its device and stream.
void drawExperts(const ExpertOptions& options, int firstExpert, int64_t column, at::Tensor& w13, at::Tensor& w2) {
  const int64_t localExperts = w13.size(0), ffnLocal = w13.size(2), hidden = options.hidden, ffn = options.ffnHidden;
  const bool onHost = w13.is_cpu();
  const int threads = cpuShare().allowed;
  std::vector<at::Tensor> buffers(static_cast<size_t>(threads));
  for (int64_t wave = 0; wave < localExperts; wave += threads) {
    const int64_t count = std::min<int64_t>(threads, localExperts - wave);
    std::vector<std::array<at::Tensor, 3>> drawn(static_cast<size_t>(count));
    parallelForWorkers(count, threads, [&](int worker, int64_t i) {
      at::Tensor& buffer = buffers[static_cast<size_t>(worker)];
      const int64_t local = wave + i;
      const int expert = firstExpert + static_cast<int>(local);
      const std::array<at::Tensor, 3> into{w13[local][0], w13[local][1], w2[local]};
      auto place = [&](int k, const at::Tensor& slice) {
        if (onHost)
          into[static_cast<size_t>(k)].copy_(slice);
        else
          drawn[static_cast<size_t>(i)][static_cast<size_t>(k)] = slice.to(w13.scalar_type(), false, /*copy=*/true);
      };
      place(0, expertMatrix(options, expert, 1, ffn, hidden, buffer).narrow(0, column, ffnLocal));
      place(1, expertMatrix(options, expert, 3, ffn, hidden, buffer).narrow(0, column, ffnLocal));
      place(2, expertMatrix(options, expert, 2, hidden, ffn, buffer).narrow(1, column, ffnLocal));
    });
    for (int64_t i = 0; i < count && !onHost; ++i) {
      const auto& [gate, up, down] = drawn[static_cast<size_t>(i)];
      w13[wave + i][0].copy_(gate);
      w13[wave + i][1].copy_(up);
      w2[wave + i].copy_(down);
    }
  }
}

}  // namespace

uint64_t initSeed(uint64_t seed, uint64_t kind, uint64_t id) {
  return splitmix64(splitmix64(splitmix64(seed) ^ kind) ^ id);
}

GroupedExperts::GroupedExperts(ExpertOptions options, int firstExpert, int localExperts, CommunicatorPtr expertTp,
                               const at::TensorOptions& tensorOptions)
    : options_(options), groupedMm_(options.groupedMm), firstExpert_(firstExpert), expertTp_(std::move(expertTp)) {
  const int etp = expertTp_->size();
  if (options_.ffnHidden % etp != 0) {
    throw ConfigError(
        fmt::format("experts: ffn hidden size {} does not divide over the {} ranks of {}", options_.ffnHidden, etp,
                    expertTp_->name()),
        {.rank = expertTp_->rank(), .group = expertTp_->name(), .expected = "ffnHidden a multiple of etp"});
  }
  const int64_t hidden = options_.hidden, ffn = options_.ffnHidden, ffnLocal = ffn / etp;
  if (groupedMm_ && (hidden % 8 != 0 || ffnLocal % 8 != 0)) {
    groupedMm_ = false;
    if (tensorOptions.device().is_cuda() && tensorOptions.dtype() == at::kBFloat16 && expertTp_->rank() == 0) {
      log::info("moe",
                "experts: hidden {} and ffn hidden per etp rank {} are not both multiples of 8; one matrix "
                "product per expert instead of at::_grouped_mm",
                hidden, ffnLocal);
    }
  }
  // Each expert's slices converted into place as they are drawn: the host holds one expert's float64
  // matrices and rounded slices a thread beside this rank's share, not every local expert's. Each expert
  // comes from generators of its own, so the values do not depend on the threads. initStd 0 (weights
  // loaded next): zeros, nothing drawn.
  const bool draw = options_.initStd != 0;
  auto allocate = [&](at::IntArrayRef shape) {
    return draw ? at::empty(shape, tensorOptions) : at::zeros(shape, tensorOptions);
  };
  const int64_t column = expertTp_->rank() * ffnLocal;
  w13_ = allocate({localExperts, 2, ffnLocal, hidden});
  w2_ = allocate({localExperts, hidden, ffnLocal});
  if (draw) drawExperts(options_, firstExpert, column, w13_, w2_);
  w13_.set_requires_grad(true);
  w2_.set_requires_grad(true);
}

template <typename Products>
at::Tensor GroupedExperts::overExpertTp(const at::Tensor& tokens, Products products) const {
  const parallel::TpGroup etp{
      .comm = expertTp_, .timeout = options_.timeout, .paramGroup = parallel::ParamGroup::Expert};
  return parallel::reduceFromTensorParallel(products(parallel::copyToTensorParallel(tokens, etp)), etp);
}

at::Tensor GroupedExperts::forward(const at::Tensor& tokens, const std::vector<int64_t>& counts,
                                   const at::Tensor& groupEnds) const {
  return overExpertTp(tokens, [&](const at::Tensor& x) {
    const at::Tensor ends = groupEndsFor(x, groupEnds, groupedMm_);
    // One product for both projections: one gradient to x, none to sum.
    at::Tensor gateUp = groupedLinear(x, w13_.flatten(1, 2), counts, ends);
    return groupedLinear(swiglu(gateUp), w2_, counts, ends);
  });
}

at::Tensor GroupedExperts::forwardPadded(const at::Tensor& tokens, const at::Tensor& keptRows) const {
  return overExpertTp(
      tokens, [&](const at::Tensor& x) { return batchedLinear(swiglu(batchedLinear(x, w13_), keptRows), w2_); });
}

std::vector<parallel::Parameter> GroupedExperts::parameters(const std::string& prefix, int replicaId) const {
  const int64_t experts = options_.numExperts, hidden = options_.hidden, ffn = options_.ffnHidden;
  const int64_t column = expertTp_->rank() * w13_.size(2);
  auto make = [&](const char* name, const at::Tensor& tensor, std::vector<int64_t> global,
                  std::vector<int64_t> offsets) {
    return parallel::Parameter{.name = prefix + name,
                               .tensor = tensor,
                               .shard = {std::move(global), std::move(offsets), replicaId},
                               .group = parallel::ParamGroup::Expert,
                               .tpReplicated = false};
  };
  return {make(".w13", w13_, {experts, 2, ffn, hidden}, {firstExpert_, 0, column, 0}),
          make(".w2", w2_, {experts, hidden, ffn}, {firstExpert_, 0, column})};
}

namespace {

bool groupedMmApplies(const at::Tensor& rows, bool allowed) {
#if BULKHEAD_HAVE_GROUPED_MM
  return allowed && rows.is_cuda() && rows.scalar_type() == at::kBFloat16 && rows.size(0) > 0;
#else
  (void)rows, (void)allowed;
  return false;
#endif
}

}  // namespace

at::Tensor groupEndsFor(const at::Tensor& rows, const at::Tensor& groupEnds, bool allowed) {
  return groupedMmApplies(rows, allowed) ? groupEnds : at::Tensor();
}

bool GroupedExperts::groupedFor(const at::Tensor& tokens) const { return groupedMmApplies(tokens, groupedMm_); }

namespace {

#if BULKHEAD_HAVE_GROUPED_MM
// Bulkhead's Hopper kernels where they serve these tensors, else ATen's.
at::Tensor groupedProducts(const at::Tensor& rows, const at::Tensor& weights, const at::Tensor& groupEnds) {
  if (hopperProductsApply(rows, weights, groupEnds)) return hopperGroupedLinear(rows, weights, groupEnds);
  return at::_grouped_mm(rows, weights.transpose(-2, -1), groupEnds);
}
#endif

}  // namespace

at::Tensor groupedLinear(const at::Tensor& rows, const at::Tensor& weights, const std::vector<int64_t>& counts,
                         const at::Tensor& groupEnds) {
#if BULKHEAD_HAVE_GROUPED_MM
  if (counts.empty() && groupEnds.defined()) return groupedProducts(rows, weights, groupEnds);
#endif
  const int64_t total = std::accumulate(counts.begin(), counts.end(), int64_t{0});
  if (total != rows.size(0) || static_cast<int64_t>(counts.size()) != weights.size(0)) {
    throw ConfigError(fmt::format("grouped linear: {} rows in {} groups of sizes summing to {}, for {} weights",
                                  rows.size(0), counts.size(), total, weights.size(0)),
                      {.expected = "one count per weight, summing to the number of rows"});
  }
#if BULKHEAD_HAVE_GROUPED_MM
  if (groupEnds.defined()) return groupedProducts(rows, weights, groupEnds);
#endif
  std::vector<at::Tensor> parts = rows.split_with_sizes(counts);
  for (size_t group = 0; group < parts.size(); ++group) parts[group] = at::mm(parts[group], weights[group].t());
  if (parts.empty()) return at::empty({0, weights.size(1)}, rows.options());
  return at::cat(parts);
}

}  // namespace bulkhead::moe
