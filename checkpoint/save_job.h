#pragma once
// Internal to checkpoint/: the part of a save that runs on the background
// thread (write, report, commit or follow), and the state a SaveHandle
// watches. See checkpointer.h for the protocol.

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpointer.h"
#include "checkpoint/commit.h"
#include "checkpoint/rank_file.h"
#include "checkpoint/staging.h"

namespace bulkhead::checkpoint {

struct SaveHandle::State {
  int64_t step = -1;
  Deadline deadline = Deadline::never();  // the save's own
  std::mutex mutex;
  std::condition_variable changed;
  bool done = false;      // `result` is final
  bool finished = false;  // the background thread's work is over (old checkpoints removed too)
  bool raised = false;    // a failure already raised to the caller (continueOnFailure false)
  SaveResult result;
};

struct SaveJob {
  int64_t step = 0;
  std::string dir;
  std::string job;
  std::string prefix;  // store keys of this save
  int rank = 0;
  int worldSize = 1;
  int threads = 1;
  int nice = 0;  // of the background thread and the threads it starts
  int keep = 0;
  double timeoutSeconds = 0;
  Deadline deadline = Deadline::never();
  Deadline::Clock::time_point started;
  std::shared_ptr<Store> store;
  std::shared_ptr<HostBuffer> buffer;  // the staged slices live here until the job ends
  std::vector<StagedSlice> slices;
  std::optional<LayoutRecord> layout;
  std::shared_ptr<SaveHandle::State> state;
  // Rank 0: the step the run resumed from, and the step folders newer than it
  // that this commit moves aside (checkpointer.h, Save, 3).
  int64_t resumedFrom = -1;
  std::vector<int64_t> supersedes;
  double blockingSeconds = 0;
  // Set when save() failed before the background part (staging): the job
  // only publishes it, so no rank waits for this one until the deadline.
  std::optional<commit::Failure> early;
  // Rank 0: old checkpoints retired by the commit, removed once the result is
  // out, so that neither this save nor the next one waits for the removal.
  std::vector<std::string> doomed;

  // Runs the whole background part and settles `state`; never throws.
  void run();

 private:
  std::optional<commit::Failure> writeOwn(commit::Exchange& exchange, SaveResult& result);
  void coordinate(commit::Exchange& exchange, SaveResult& result);
  void follow(commit::Exchange& exchange, SaveResult& result);
  // The first commit after a resume, before its rename, under the folder
  // lock: `latest` names the resumed step again, then every later step
  // folder moves aside. Wherever the commit stops, `latest` names a complete
  // checkpoint of this run: the resumed step, or the step committed.
  void returnToResumedStep(Deadline lockDeadline) const;
  // Renames step folder `newer` to a superseded name of its own (nothing if it is gone).
  void moveAside(int64_t newer) const;
  Deadline graceDeadline(int multiple) const;
};

// How long past the save deadline the others wait for rank 0's verdict.
double commitGraceSeconds(double timeoutSeconds);

}  // namespace bulkhead::checkpoint
