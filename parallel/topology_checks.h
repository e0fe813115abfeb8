#pragma once
// Topology checks for GPU jobs: warnings, with advice, about tensor- and
// expert-parallel groups placed where their traffic (every layer, on the
// critical path) will be slow. Pure functions of the layout and what the
// caller knows about the machine, so they run and are tested on CPUs; the
// process-group manager logs their result on rank 0.
//
// Placement model: block placement, node of rank r = r / ranksPerNode (what
// mpirun and srun do by default).

#include <functional>
#include <string>
#include <vector>

#include "parallel/layout.h"

namespace bulkhead::parallel {

// Whether two world ranks on one node reach each other over NVLink (directly
// or through NVSwitch). Supplied by the GPU side.
using NvlinkPredicate = std::function<bool(int rankA, int rankB)>;

struct TopologyOptions {
  // Ranks per node (Runtime::info().localSize); <= 0: unknown, skip the node checks.
  int ranksPerNode = -1;
  // Empty: skip the NVLink check.
  NvlinkPredicate nvlink;
};

// Warnings for the groups of one kind (each a list of world ranks):
// - a size that is not a power of two;
// - a group that spans more than one node, or takes part of a node it shares
//   with another group of the kind while also reaching past it;
// - two members on one node without an NVLink path.
// At most one warning per condition and kind (naming the first offending group
// and how many others share the problem), so a large job's log stays readable.
std::vector<std::string> checkGroupTopology(GroupKind kind, const std::vector<std::vector<int>>& groups,
                                            const TopologyOptions& options);

// The checks above for the kinds whose traffic is latency-critical: tp and ep.
std::vector<std::string> checkTopology(const Layout& layout, const TopologyOptions& options);

}  // namespace bulkhead::parallel
