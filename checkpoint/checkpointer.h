#pragma once
// Sharded checkpoints (docs/design.md#checkpoints-layout-and-commit): every rank writes its own slices
// into one HDF5 file, a coordinator commits the step atomically, and any
// layout loads any checkpoint.
//
//   auto ckpt = checkpoint::Checkpointer::create({.dir = "/ckpt"}, runtime->store(), rank, world);
//   checkpoint::StateDict state;  // slices under global keys + rng, data position, layout, user
//   state.add("layers.0.experts.w2", local, {.globalShape = {64, 1024, 768}, .offsets = {16 * ep, 0, 0}});
//   ckpt->save(step, state);      // returns once the tensors are copied to host memory
//   ...                           // training goes on while a background thread writes
//   auto result = ckpt->load(state);  // fills state's tensors in place, returns the rest
//
// Save, in order (every rank calls save with the same step, in the same order):
// 1. On the caller's thread: the previous save is waited for; the slices this
//    rank writes (replica 0) are copied into a reused host buffer (pinned, on
//    a side stream, for CUDA tensors); save() returns.
// 2. On a background thread: the rank's file is written into
//    DIR/step_N.tmp.<job>/, checksummed per chunk and fsynced, and its index
//    (key, offsets, shape, dtype, digest) reported through the store.
// 3. Rank 0 waits for every report until the deadline, checks that every key
//    is covered exactly once, writes and fsyncs the manifest, claims the
//    commit in the store (compare-and-set, so a rank that gave up first
//    prevails), renames the folder to DIR/step_N/, replaces `latest`
//    atomically and removes checkpoints beyond the newest `keep`.
//    A step folder that exists already is never replaced (the save fails),
//    with one exception, a resumed run: after loading step S (with
//    LoadOptions::resume, the default), this
//    checkpointer's first successful commit is preceded, under the folder
//    lock, by `latest` naming S again and by every step folder that was newer
//    than S at the load (the run it resumes went past S, or died between a
//    commit's rename and its `latest` update) moving aside to
//    DIR/step_N.superseded.<job>/ (logged). So a run gone back to S saves its
//    own steps, `latest` always names a complete checkpoint of it (S, or its
//    newest commit), and nothing is deleted (the user removes those folders).
// 4. The other ranks wait for rank 0's verdict until the deadline plus a
//    grace; a rank that sees none declares the save failed in the store.
// Coordination uses only the rendezvous store, never a training communicator.
// A save that fails or times out leaves the previous checkpoint and `latest`
// untouched; it is logged, reported by SaveHandle::wait, and (unless
// continueOnFailure is false) training goes on.
//
// Load (collective): rank 0 resolves the step (`latest` or the one asked for)
// and shares it through the store; each rank reads the manifest and, for
// every slice it holds, exactly the chunks of saved slices that overlap it,
// verifying their checksums. Every rank learns whether every other rank
// succeeded: a failure anywhere raises on all ranks.
//
// Errors: ConfigError for a bad state dict or options; IoError for a failed
// write (disk full, permissions); CheckpointError for a missing, partial,
// corrupt or incompatible checkpoint; TimeoutError when a deadline passes.
// Each names the file, key and rank where it applies, and what to do.

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/state_dict.h"
#include "runtime/deadline.h"
#include "runtime/store/store.h"

namespace bulkhead::checkpoint {

class HostBuffer;  // staging.h

struct CheckpointOptions {
  std::string dir;                        // the checkpoint folder, on storage every rank reaches
  int keep = 3;                           // committed checkpoints kept; 0 keeps all
  std::optional<double> timeoutSeconds;   // each save and load; unset: BULKHEAD_CHECKPOINT_TIMEOUT
  bool continueOnFailure = true;          // false: a failed save raises from the next save() or wait()
  int64_t chunkBytes = int64_t{8} << 20;  // target size of an HDF5 chunk
  std::optional<int> threads;             // unset: BULKHEAD_CHECKPOINT_THREADS
  std::optional<int> backgroundNice;      // niceness of a save's background part; unset: BULKHEAD_CHECKPOINT_NICE
};

struct SaveResult {
  int64_t step = -1;
  bool ok = false;
  std::string path;            // the committed folder, when ok
  std::string errorKind;       // "IoError", "TimeoutError", "CheckpointError", ... when not ok
  std::string error;           // what() of the error that failed the save, when not ok
  double blockingSeconds = 0;  // inside save(): waiting for the previous save, staging
  double totalSeconds = 0;     // from save() to the verdict
  int64_t bytes = 0;           // this rank's file
};

class SaveHandle {
 public:
  struct State;  // checkpointer.cc
  SaveHandle() = default;
  explicit SaveHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}

  int64_t step() const;
  bool valid() const { return state_ != nullptr; }
  bool isCompleted() const;
  // The outcome once the save ended; TimeoutError when `deadline` passes
  // first (the save itself goes on, bounded by its own deadline).
  SaveResult wait(Deadline deadline) const;
  const std::shared_ptr<State>& state() const { return state_; }

 private:
  std::shared_ptr<State> state_;
};

struct LoadOptions {
  std::optional<int64_t> step;       // unset: the step `latest` names
  std::optional<Deadline> deadline;  // unset: the checkpointer's timeout from the call
  bool allowMissing = false;         // keys absent from the checkpoint are listed instead of raising
  // The run goes on from this step (see Save, 3). false for a load that only
  // reads it (evaluation, comparison): later steps are then left as they are.
  bool resume = true;
};

struct LoadResult {
  int64_t step = -1;
  std::string path;
  // What the rank of this number saved (empty when the saved world was smaller).
  std::map<std::string, std::string> rng;
  std::string dataPosition;
  bool rankStateFound = false;
  std::map<std::string, std::string> user;
  std::optional<LayoutRecord> layout;
  int savedWorldSize = 0;
  std::vector<std::string> missingKeys;  // with allowMissing
  int64_t bytesRead = 0;                 // by this rank
  double seconds = 0;
};

class Checkpointer {
 public:
  // Collective: every rank calls it with the same dir string (rank 0 draws
  // the job nonce that names this job's temporary folders and shares it
  // through the store; the runtime's store: runtime->store()). The store is
  // shared, not borrowed: a save's background thread may outlive a caller's
  // scope. ConfigError for bad options; IoError when the folder cannot be
  // created; TimeoutError when rank 0's nonce does not arrive in time.
  static std::unique_ptr<Checkpointer> create(CheckpointOptions options, std::shared_ptr<Store> store, int rank,
                                              int worldSize);
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;
  // Waits for the save in flight (bounded by its deadline plus a grace) and
  // logs its failure; never throws.
  ~Checkpointer();

  // Collective. Returns once this rank's slices are in host memory.
  SaveHandle save(int64_t step, const StateDict& state);
  // Allocates (page-locked for CUDA tensors) and touches the host memory that
  // saving `state` needs, so the first save() does not pay for it; local, optional.
  void reserve(const StateDict& state);
  // Waits for the last save, and for the removal of the old checkpoints its
  // commit retired (the next save() does not: that removal goes on beside it).
  // With continueOnFailure false, a failed save raises its error here
  // (IoError, TimeoutError or CheckpointError).
  SaveResult wait(Deadline deadline);
  // Collective. Fills the targets' tensors in place (any layout; CPU or CUDA).
  LoadResult load(StateDict& targets, LoadOptions options = {});

  const CheckpointOptions& options() const { return options_; }
  const std::string& job() const { return job_; }
  int rank() const { return rank_; }
  int worldSize() const { return worldSize_; }

 private:
  Checkpointer(CheckpointOptions options, std::shared_ptr<Store> store, int rank, int worldSize, std::string prefix,
               std::string job);
  void settlePrevious(Deadline deadline);
  // Rank 0, after a load that resumes: the step loaded and the committed steps newer than it.
  void rememberNewerSteps(int64_t loaded);
  double timeoutSeconds() const;
  int threads() const;

  CheckpointOptions options_;
  std::shared_ptr<Store> store_;
  int rank_;
  int worldSize_;
  std::string prefix_;  // store keys of this checkpointer
  std::string job_;     // nonce in temporary folder names and in every file
  int64_t saves_ = 0;
  int64_t loads_ = 0;
  std::shared_ptr<HostBuffer> buffer_;  // reused by every save
  // Rank 0, after a load: the step loaded and the committed steps newer than
  // it, which the next commit moves aside (see Save, 3).
  int64_t resumedFrom_ = -1;
  std::vector<int64_t> newerThanResumed_;
  const SaveHandle::State* supersedingSave_ = nullptr;  // the last save that carried them
  SaveHandle current_;                                  // the last save
  std::thread worker_;                                  // its background part
  // The save before it, whose thread may still be removing old checkpoints
  // after its result was out.
  SaveHandle finishing_;
  std::thread finishingWorker_;
};

}  // namespace bulkhead::checkpoint
