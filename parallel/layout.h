#pragma once
// The parallel layout: which world ranks form each tensor-, context-, data-,
// pipeline- and expert-parallel group (docs/design.md#process-groups). Pure arithmetic, no
// communication: every rank computes the same answer from the world size and
// the options, so the process-group manager can split communicators without
// agreeing on anything first.
//
// Mapping (Megatron-LM's RankGenerator semantics):
// - Dense grid: axes tp, cp, dp, pp, taken in the order string with "ep"
//   removed (default "tp-cp-dp-pp"), leftmost fastest. dp = world / (tp*cp*pp).
// - Expert grid: axes etp, ep, edp, pp, taken in the order string with tp
//   replaced by etp, cp removed and dp replaced by edp (default
//   "etp-ep-edp-pp"), leftmost fastest. edp = world / (etp*ep*pp).
// - Both grids share the pp axis: the pipeline groups of the two grids are the
//   same lists of ranks, and a layout where they would differ is a ConfigError.
// - A group of a kind holds the ranks that agree on every coordinate the kind
//   does not name, ordered by rank (which is the grid rank among them).

#include <string>
#include <utility>
#include <vector>

namespace bulkhead::parallel {

namespace detail {
// One grid, an implementation detail of Layout: four axes in slot order
// (dense: tp, cp, dp, pp; expert: etp, ep, edp, pp), each with its size, its
// stride in the world rank, and its position in the order (0 = fastest).
struct Grid {
  int size[4];
  int stride[4];
  int position[4];
};
}  // namespace detail

struct LayoutOptions {
  int tp = 1, cp = 1, pp = 1, ep = 1, etp = 1;  // dp and expert dp (edp) are derived
  std::string order = "tp-cp-ep-dp-pp";         // leftmost varies fastest; names each of tp, cp, ep, dp, pp once
  int optimizerInstances = 1;                   // distributed-optimizer instances (splits expert dp)
};

enum class GroupKind {
  Tp,
  Cp,
  Pp,
  Dp,
  DpCp,
  TpCp,
  ModelParallel,  // tp-pp
  TpDpCp,
  Ep,
  ExpertTp,
  ExpertDp,
  ExpertModelParallel,    // etp-ep-pp on the expert grid
  Embedding,              // first and last stage of each pp group
  ExpertDpIntraInstance,  // each expert-dp group cut into optimizerInstances contiguous chunks
  ExpertDpInterInstance   // the ranks at one position across those chunks
};

// "tp","cp","pp","dp","dp-cp","tp-cp","mp","tp-dp-cp","ep","expert-tp",
// "expert-dp","tp-ep-pp","embedding","expert-dp-intra","expert-dp-inter".
const char* toString(GroupKind kind);
// Every kind, in the one order in which every rank creates its groups.
const std::vector<GroupKind>& allGroupKinds();

// A rank's place on both grids: tp, cp, dp, pp on the dense grid; etp, ep, edp
// (and the shared pp) on the expert grid.
struct Coordinates {
  int tp, cp, dp, pp;
  int etp, ep, edp;
  bool operator==(const Coordinates&) const = default;
};

class Layout {
 public:
  // Validates and builds the mapping. ConfigError, naming the conflicting
  // sizes, when: the world or any size is < 1; the order string is malformed;
  // tp x cp x pp or etp x ep x pp does not divide the world; optimizerInstances
  // does not divide edp; the two grids would give different pp groups (only
  // possible when pp is not last in the order).
  static Layout create(int worldSize, const LayoutOptions& options);

  int worldSize() const { return worldSize_; }
  int tp() const { return options_.tp; }
  int cp() const { return options_.cp; }
  int pp() const { return options_.pp; }
  int dp() const { return dp_; }
  int ep() const { return options_.ep; }
  int etp() const { return options_.etp; }
  int edp() const { return edp_; }
  const LayoutOptions& options() const { return options_; }

  // ConfigError when rank is outside [0, worldSize).
  Coordinates coordinates(int rank) const;

  // All groups of one kind, each a list of world ranks in group-rank order,
  // the groups themselves in a fixed order (the same on every rank). For
  // every kind except Embedding they partition the world.
  std::vector<std::vector<int>> groups(GroupKind kind) const;

  // The group of `rank` (empty if rank is in none: only Embedding, for the
  // middle pipeline stages), and its index among groups(kind) (-1 if none):
  // the color for a communicator split. ConfigError for a rank out of range.
  std::vector<int> groupOf(GroupKind kind, int rank) const;
  int groupIndex(GroupKind kind, int rank) const;

  // A few lines that show the mesh: sizes, the order of each grid and, for
  // worlds of at most 64 ranks, each rank's coordinates.
  std::string describe() const;

 private:
  using Grid = detail::Grid;
  Layout(int worldSize, LayoutOptions options, int dp, int edp, Grid dense, Grid expert)
      : worldSize_(worldSize), options_(std::move(options)), dp_(dp), edp_(edp), dense_(dense), expert_(expert) {}
  void checkRank(int rank) const;

  int worldSize_;
  LayoutOptions options_;
  int dp_;
  int edp_;
  Grid dense_;
  Grid expert_;
};

}  // namespace bulkhead::parallel
