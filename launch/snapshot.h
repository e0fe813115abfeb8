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
// the tensors' names, dtypes, devices and shapes, and the payload's size),
// then the host tensors, then the GPU tensors, each 64-byte aligned and in the
// order given within its part. The order and shapes must be the same each
// time on a rank, and the same on the process that takes its place (the same
// model at the same rank); a signature that differs is a ConfigError naming
// both.
//
// GPU tensors do not hold the training up while they travel to the host: take()
// copies them into a device buffer in the stream's order (a copy within the
// GPU's memory), exchanges that buffer with the buddies over the device world
// (NCCL: GPU to GPU), and downloads the own and the ward's buffers on a stream
// of its own while the next steps run. A copy counts once it has landed on the
// host; settle() waits for that. The price is one more copy of the state in
// GPU memory (two with buddies); with `stageOnDevice` false, or where that
// memory cannot be had, take() copies to the host in place and waits.

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/cuda/stream_timer.h"

namespace bulkhead::launch {

// How long a snapshot's download to the host may take to land: when a copy is reused, a buffer replaced,
// or a recovery reports its steps.
constexpr double kSnapshotLandingSeconds = 10;

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

// The rank that holds `rank`'s copy, and the rank whose copy `rank` holds.
int holderOf(int rank, int size, int localSize);
int wardOf(int rank, int size, int localSize);

// The packed form of `state`: its size, the end of its host part, and its signature.
struct PackedLayout {
  int64_t bytes = 0;       // header included
  int64_t hostBytes = 0;   // the header and the host tensors: [0, hostBytes); GPU tensors after
  uint64_t signature = 0;  // of the names, dtypes, devices and shapes, in order
  std::vector<int64_t> offsets;
};
PackedLayout packedLayout(const NamedTensors& state);

// What the snapshots have cost a rank.
struct SnapshotCost {
  int64_t taken = 0;         // snapshots taken
  double hostSeconds = 0;    // the host's time in take()
  double setupSeconds = 0;   // of it, allocating the host copies (at the first snapshot of a world, once)
  int64_t timed = 0;         // snapshots whose time on the training stream is known (GPU state, a CUDA build)
  double streamSeconds = 0;  // theirs: the wait for the last download, the device copy and the swap
};

struct SnapshotOptions {
  // GPU tensors through a device buffer, downloaded behind the training (above).
  bool stageOnDevice = true;
};

class Snapshots {
 public:
  explicit Snapshots(SnapshotOptions options = {});
  ~Snapshots();
  Snapshots(const Snapshots&) = delete;
  Snapshots& operator=(const Snapshots&) = delete;

  // Takes `state` as the snapshot after `step` completed steps, then sends it
  // to the holder and receives the ward's, under the deadline: the host part
  // over `cpuWorld`, the GPU part over `deviceWorld` where one is given (a
  // world whose tensors live on the GPU, with the same ranks), else over
  // `cpuWorld` too. A failed exchange keeps this rank's own copy and drops the
  // ward's half-received one.
  void take(Communicator& cpuWorld, int localSize, int64_t step, const NamedTensors& state, Deadline deadline,
            Communicator* deviceWorld = nullptr);

  // Waits until every copy on its way to the host has landed; one that has
  // not by the deadline is dropped (its step no longer counts).
  void settle(Deadline deadline);

  // The steps this rank's own copies and its ward's hold, once landed (-1: none).
  std::vector<int64_t> ownSteps() const;
  std::vector<int64_t> wardSteps() const;
  // The packed own copy or ward copy of `step`, once landed; an undefined tensor if none.
  at::Tensor own(int64_t step) const;
  at::Tensor ward(int64_t step) const;

  // What the snapshots have cost so far, with the stream times measured since the last call.
  SnapshotCost cost();

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
    at::Tensor bytes;                     // uint8 on the host (pinned where part of it comes from a GPU)
    std::shared_ptr<c10::Event> landing;  // its download, while one may be in flight
    bool landed() const;
  };
  // A device buffer a copy's GPU part goes through; `read` once its download is done.
  struct Staging {
    at::Tensor bytes;
    std::shared_ptr<c10::Event> read;
  };
  // The copy to overwrite: an empty one, else the older.
  static Copy& older(Copy (&copies)[2]);
  // Waits for a copy's download; false (and the copy dropped) past the deadline.
  static bool settleCopy(Copy& copy, Deadline deadline);
  // Allocates both copies that have no buffer yet, so that the second snapshot does not pay for a pinned
  // allocation of its own (about a second for a few GB) inside the training.
  static void reserve(Copy (&copies)[2], int64_t bytes, bool pinned);

  // Once per world: the ward's sizes, and which pairs send their GPU parts GPU to GPU.
  void learnWard(Communicator& cpuWorld, Communicator* deviceWorld, int localSize, const PackedLayout& layout,
                 c10::Device device, Deadline deadline);
  bool stage(Staging& staging, int64_t bytes, c10::Device device);
  // Copies the state into `own`: host tensors in place, GPU ones through the
  // staging buffer where `staged` (downloaded later), else in place.
  void pack(Copy& own, const PackedLayout& layout, int64_t step, const NamedTensors& state, bool staged);
  // Downloads `from` into `to` from byte `offset` on, behind the current stream's work.
  void download(Staging& from, Copy& to, int64_t offset);
  void exchange(Communicator& cpuWorld, Communicator* deviceWorld, int localSize, Copy& own, const PackedLayout& layout,
                int64_t step, Deadline deadline);

  void foldTimers();

  SnapshotOptions options_;
  SnapshotCost cost_;
  std::deque<StreamTimer> timers_;  // the training stream's spans in snapshots, until measured
  Copy own_[2];
  Copy ward_[2];
  Staging ownStaging_, wardStaging_;
  std::optional<c10::Stream> stream_;  // the downloads'
  bool stagingFailed_ = false;         // the device memory could not be had: in place from then on
  bool announced_ = false;             // the snapshots' size logged
  int64_t wardBytes_ = -1;             // learned from the ward once per world
  int64_t wardHostBytes_ = -1;
  bool sendStaged_ = false, receiveStaged_ = false;  // to the holder, from the ward: over the device world
};

}  // namespace bulkhead::launch
