#pragma once
// Peer snapshots for recovery inside the job (docs/design.md#recovery-inside-the-job).
//
// A rank keeps its state (model and optimizer shards, any tensors the trainer
// names) in host memory after a step: its own last two snapshots, and the
// last two of one other rank, its ward, which it holds for it. Rank r's holder
// is r + localSize (mod size) when the world spans more than one node, so the
// copy lives on another node (where the nodes hold equal numbers of ranks),
// else r + 1 (mod size). Two copies of each, so
// that a fault during an exchange still leaves one step every rank has.
//
// A snapshot is packed into one byte buffer: a header (step, a signature of
// the tensors' names, dtypes and shapes, and the payload's size), then every
// tensor, 64-byte aligned, in the order given. The order and shapes must be
// the same each time on a rank, and the same on the process that takes its
// place (the same model at the same rank); a signature that differs is a
// ConfigError naming both.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "runtime/communicator.h"

namespace bulkhead::launch {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// The rank that holds `rank`'s copy, and the rank whose copy `rank` holds.
int holderOf(int rank, int size, int localSize);
int wardOf(int rank, int size, int localSize);

// The packed form of `state`: its size and signature.
struct PackedLayout {
  int64_t bytes = 0;       // header included
  uint64_t signature = 0;  // of the names, dtypes and shapes, in order
  std::vector<int64_t> offsets;
};
PackedLayout packedLayout(const NamedTensors& state);

class Snapshots {
 public:
  // Copies `state` into host memory as the snapshot after `step` completed
  // steps, then, over `cpuWorld` (its CPU world: rank r's holder and ward as
  // above), sends it to the holder and receives the ward's, under the
  // deadline. A failed exchange keeps this rank's own copy and drops the
  // ward's half-received one.
  void take(Communicator& cpuWorld, int localSize, int64_t step, const NamedTensors& state, Deadline deadline);

  // The steps this rank's own copies and its ward's hold (-1: none).
  std::vector<int64_t> ownSteps() const;
  std::vector<int64_t> wardSteps() const;
  // The packed own copy or ward copy of `step`; an undefined tensor if none.
  at::Tensor own(int64_t step) const;
  at::Tensor ward(int64_t step) const;

  // Drops the copies of steps after `step` (a recovery went back to it).
  void forgetAfter(int64_t step);
  // A new world (after a recovery): the ward's size is learned again.
  void newWorld() { wardBytes_ = -1; }

  // Copies a packed snapshot into `state` (any device): ConfigError when it
  // was packed from other tensors (another model or layout at this rank).
  static void unpack(const at::Tensor& packed, const NamedTensors& state, int rank);
  // The step a packed snapshot holds.
  static int64_t stepOf(const at::Tensor& packed);

 private:
  struct Copy {
    int64_t step = -1;
    at::Tensor bytes;  // uint8 on the host (pinned where the state is on a GPU)
  };
  // The copy to overwrite: an empty one, else the older.
  static Copy& older(Copy (&copies)[2]);

  Copy own_[2];
  Copy ward_[2];
  int64_t wardBytes_ = -1;  // learned from the ward once per world
};

}  // namespace bulkhead::launch
