#pragma once
// The process-group manager (docs/design.md#process-groups). Given the world communicator
// and a Layout, it creates every communicator of this rank right after the
// layout is known, then warms each with the operations it will carry, so no
// connection is set up later (at peak memory, in the middle of a step).
//
// Contract:
// - create() is collective over the world: every rank calls it with the same
//   layout. It runs one world->split per GroupKind, in allGroupKinds() order
//   (the same on every rank), colored by layout.groupIndex(kind, rank) and
//   keyed by the world rank, so group g of a kind is named "<kind>[g]" and its
//   members, in order, are layout.groupOf(kind, rank).
// - Warm-up traffic, at options.warmupBytes per rank, on tensors of the
//   world's device: all-reduce on every group except ep (all-to-all, equal
//   splits) and pp (send/recv with both pipeline neighbours). Groups of one
//   rank are created but carry no traffic.
// - Every split and every operation runs under one deadline (options.deadline,
//   or BULKHEAD_INIT_TIMEOUT counted from the call). A TimeoutError or
//   CommError is rethrown as the same type, its message naming the group
//   kind, the group, its members and the step that failed, with the
//   communicator's own message (which names the unresponsive ranks) kept.
// - A layout whose world size differs from the communicator's is a
//   ConfigError, raised before any communication.
// - On GPUs, topology warnings (parallel/topology_checks.h) are logged on rank 0.

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "parallel/layout.h"
#include "parallel/topology_checks.h"
#include "runtime/communicator.h"

namespace bulkhead::parallel {

struct ProcessGroupOptions {
  // Unset: BULKHEAD_INIT_TIMEOUT from the call. Covers every split and warm-up.
  std::optional<Deadline> deadline;
  int64_t warmupBytes = int64_t{1} << 20;  // per rank and per operation
  bool warmup = true;
  // Ranks per node, for the topology checks on GPUs; <= 0 skips the node checks
  // (pass Runtime::info().localSize).
  int localSize = -1;
  // Whether two world ranks on one node reach each other directly (NVLink or
  // PCIe peer-to-peer). Empty: on GPUs, CUDA's peer access between the GPUs of
  // block-placed local ranks (rank % localSize); elsewhere the check is skipped.
  NvlinkPredicate nvlink;
};

// What the manager built for one kind, as this rank sees it.
struct GroupReport {
  GroupKind kind;
  std::string name;          // "tp[3]", or "-" when this rank is in no group of the kind
  std::vector<int> members;  // world ranks of this rank's group (empty: none)
  double createMs = 0;       // the split
  double warmMs = 0;         // the warm-up traffic (0 for groups of one rank)
};

class ProcessGroups {
 public:
  static ProcessGroups create(CommunicatorPtr world, const Layout& layout, ProcessGroupOptions options = {});
  // Builds the layout from the world's size first: a layout that does not fit
  // it is a ConfigError on every rank, before any communication.
  static ProcessGroups create(CommunicatorPtr world, const LayoutOptions& layoutOptions,
                              ProcessGroupOptions options = {});

  const CommunicatorPtr& tp() const { return get(GroupKind::Tp); }
  const CommunicatorPtr& cp() const { return get(GroupKind::Cp); }
  const CommunicatorPtr& pp() const { return get(GroupKind::Pp); }
  const CommunicatorPtr& dp() const { return get(GroupKind::Dp); }
  const CommunicatorPtr& dpCp() const { return get(GroupKind::DpCp); }
  const CommunicatorPtr& tpCp() const { return get(GroupKind::TpCp); }
  const CommunicatorPtr& modelParallel() const { return get(GroupKind::ModelParallel); }
  const CommunicatorPtr& tpDpCp() const { return get(GroupKind::TpDpCp); }
  const CommunicatorPtr& ep() const { return get(GroupKind::Ep); }
  const CommunicatorPtr& expertTp() const { return get(GroupKind::ExpertTp); }
  const CommunicatorPtr& expertDp() const { return get(GroupKind::ExpertDp); }
  const CommunicatorPtr& expertModelParallel() const { return get(GroupKind::ExpertModelParallel); }
  // nullptr on the middle pipeline stages, which are in no embedding group.
  const CommunicatorPtr& embedding() const { return get(GroupKind::Embedding); }
  const CommunicatorPtr& expertDpIntraInstance() const { return get(GroupKind::ExpertDpIntraInstance); }
  const CommunicatorPtr& expertDpInterInstance() const { return get(GroupKind::ExpertDpInterInstance); }
  const CommunicatorPtr& get(GroupKind kind) const;

  const Layout& layout() const { return layout_; }
  const CommunicatorPtr& world() const { return world_; }
  // World ranks of the previous and next pipeline stage of this rank (-1 at
  // the first and last stage; both -1 when pp is 1).
  std::pair<int, int> pipelinePeers() const;

  // One row per kind, in allGroupKinds() order.
  const std::vector<GroupReport>& report() const { return report_; }
  // The report as a table (one header line, one line per kind).
  std::string formatReport() const;

 private:
  ProcessGroups(CommunicatorPtr world, Layout layout) : world_(std::move(world)), layout_(std::move(layout)) {}

  CommunicatorPtr world_;
  Layout layout_;
  std::vector<CommunicatorPtr> groups_;  // indexed by GroupKind
  std::vector<GroupReport> report_;
};

}  // namespace bulkhead::parallel
