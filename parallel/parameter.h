#pragma once
// How a rank's tensor relates to a global, layout-independent tensor: the
// vocabulary shared by the layers (which create parameters), the optimizer
// (which shards their state) and checkpoints (which store slices under global
// names and load them into any other layout). Design section 8.
//
// Contract:
// - A global tensor is named by a key that does not depend on the layout
//   ("layers.3.moe.experts.w13"; expert weights are indexed by global expert
//   id), and has one global shape.
// - A rank holds a rectangular slice of it: `offsets[d]` is where the slice
//   starts in dimension d, and the slice's extent is the local tensor's shape.
// - Ranks that hold an identical slice are replicas; replica 0 writes it to a
//   checkpoint, the others only read.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace bulkhead::parallel {

struct ShardInfo {
  std::vector<int64_t> globalShape;
  std::vector<int64_t> offsets;  // one per dimension of globalShape
  int replicaId = 0;             // 0: this rank writes the slice

  // The whole tensor, held by one rank (or replicated, with replicaId set).
  static ShardInfo whole(at::IntArrayRef shape, int replicaId = 0) {
    return {shape.vec(), std::vector<int64_t>(shape.size(), 0), replicaId};
  }
};

// A rank's slice of a global tensor. For saving, `local` is read; for loading,
// `local` is the destination and is filled in place.
struct ShardedTensor {
  std::string key;
  at::Tensor local;
  ShardInfo shard;
};

// Which group a parameter's gradient is reduced over and its optimizer state
// sharded across: dense parameters over dp, expert parameters over expert dp.
enum class ParamGroup { Dense, Expert };

// A trainable parameter as the optimizer, gradient clipping and checkpoints
// see it.
struct Parameter {
  std::string name;   // the global key
  at::Tensor tensor;  // this rank's slice (requires grad); .grad() after backward
  ShardInfo shard;    // where the slice sits; replicaId counts dp/edp replicas
  ParamGroup group = ParamGroup::Dense;
  // True when every rank of the tp group (etp for expert parameters) holds the
  // same values (a norm weight, a router): gradient norms count it once.
  bool tpReplicated = false;
  // True for a copy of a parameter another pipeline stage owns (the tied
  // embedding on the last stage): its gradient is summed with the owner's
  // before the step, and gradient norms and checkpoints count it once (its
  // replicaId is not 0).
  bool pipelineCopy = false;
};

}  // namespace bulkhead::parallel
