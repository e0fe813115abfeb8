#pragma once
// The tensor-parallel group a layer splits its weights over, and the four
// autograd-aware collectives the tensor-parallel layers are built from
// (Megatron-LM's "regions"). Device-agnostic: CPU tensors under the mpi
// backend, CUDA tensors under nccl; tensors must live on the group's device.
//
// Contract:
// - Every rank of the tp group calls the same functions in the same order,
//   forward and backward (autograd runs the backward collectives in reverse
//   order on every rank alike).
// - Each collective runs under its own deadline: TpGroup::timeout from the
//   call, or BULKHEAD_COLLECTIVE_TIMEOUT when unset; a TimeoutError or
//   CommError from the communicator propagates unchanged.
// - A group of one rank issues no collectives: each function is the identity.
// - No double backward: where a backward's gradient comes from a collective
//   (copyTo, scatterTo), create_graph raises ConfigError on every rank alike.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <optional>

#include "parallel/parameter.h"
#include "runtime/communicator.h"
#include "runtime/deadline.h"

namespace bulkhead::parallel {

class ProcessGroups;

struct TpGroup {
  CommunicatorPtr comm;  // the tp group (expert tp for expert layers)
  // This rank's index among the data-parallel replicas of its slices: the
  // dp x cp rank for dense layers, the expert-dp rank for expert layers.
  int dpReplica = 0;
  // Per collective; unset: BULKHEAD_COLLECTIVE_TIMEOUT counted from the call.
  std::optional<std::chrono::milliseconds> timeout;
  // The group of the parameters a layer on this TpGroup creates.
  ParamGroup paramGroup = ParamGroup::Dense;

  // tp() and the dp x cp rank; expertTp() and the expert-dp rank.
  static TpGroup dense(const ProcessGroups& groups, std::optional<std::chrono::milliseconds> timeout = {});
  static TpGroup expert(const ProcessGroups& groups, std::optional<std::chrono::milliseconds> timeout = {});

  int rank() const { return comm->rank(); }
  int size() const { return comm->size(); }
  Deadline deadline() const;
  // The ShardInfo::replicaId of a slice this rank holds: the dp replica, and
  // for a slice every tp rank holds (tpReplicated) also the tp rank, so that
  // exactly one rank in the world has replica 0.
  int replicaId(bool tpReplicated) const { return tpReplicated ? dpReplica * size() + rank() : dpReplica; }
};

// The deadline of one collective: `timeout` from now, or
// BULKHEAD_COLLECTIVE_TIMEOUT from now when unset.
Deadline collectiveDeadline(std::optional<std::chrono::milliseconds> timeout);

// Called first in a custom backward whose gradients carry no graph (a
// collective's, a kernel's, a closed form's): ConfigError where autograd asks
// for one (create_graph), on every rank alike, instead of leaving the
// second-order terms silently out. Shared by the tp layers and the MoE layer.
void refuseDoubleBackward(const char* what);

// Forward: identity. Backward: all-reduce (sum) of the gradient over tp.
// Where a replicated activation enters a tp-split computation.
at::Tensor copyToTensorParallel(const at::Tensor& input, const TpGroup& group);
// Forward: all-reduce (sum) over tp. Backward: identity.
// Where partial results of a tp-split computation are combined.
at::Tensor reduceFromTensorParallel(const at::Tensor& input, const TpGroup& group);
// Forward: all-gather along the last dimension (rank r's block at r). Backward:
// this rank's block of the gradient. Every rank's input has the same shape.
at::Tensor gatherFromTensorParallel(const at::Tensor& input, const TpGroup& group);
// Forward: this rank's block of the last dimension (which tp must divide).
// Backward: all-gather of the gradient along the last dimension.
at::Tensor scatterToTensorParallel(const at::Tensor& input, const TpGroup& group);

}  // namespace bulkhead::parallel
