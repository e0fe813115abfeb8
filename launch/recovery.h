#pragma once
// Recovery inside the job (docs/design.md#recovery-inside-the-job): a rank
// dies or stops, a spare process takes its place, and training goes on from
// the last step every rank has a snapshot of, without the job exiting.
//
//   auto runtime = bulkhead::init({.spares = 1});
//   bulkhead::launch::Recovery recovery(*runtime);
//   std::optional<Recovered> resumed;
//   if (runtime->isSpare() && !(resumed = recovery.awaitTurn())) return 0;  // the job ended without it
//   for (;;) {
//     try {
//       Trainer trainer(*runtime);                       // groups, model, optimizer: built anew each time
//       if (resumed) recovery.restore(trainer.state());  // the snapshot of resumed->step
//       for (int64_t step = resumed ? resumed->step : 0; step < steps; ++step) {
//         trainer.step(step);
//         recovery.afterStep(step + 1, trainer.state());
//       }
//       break;
//     } catch (const bulkhead::Error&) {
//       resumed = recovery.recover(std::current_exception());  // rethrows what it cannot recover from
//     }
//   }
//
// How it goes, with K spares (InitOptions::spares; a store outside the job):
//  - After each step (every `snapshotEvery`), afterStep copies the rank's
//    state to host memory and swaps copies with its buddies (snapshot.h); on
//    a GPU through a device buffer, the download running behind the next steps.
//  - A communication error (TimeoutError, DesyncError, CommError) reaches the
//    trainer on every rank within its deadline. recover() aborts the
//    generation's communicators (the fatal bound of runtime/diagnosis/fatal_exit.h is
//    deferred meanwhile) and joins the next generation's rendezvous in the
//    store: the first to arrive leads. It waits for every rank, or until each
//    missing one has been silent (no heartbeat) for the monitor's dead-after
//    time, then gives each missing rank a live spare and picks the latest step
//    whose state survives for every rank (its own copy, or its holder's).
//  - Every member, spares included, builds the new generation's worlds under
//    BULKHEAD_INIT_TIMEOUT (keys under "gen/<g>/"), and returns Recovered. The
//    trainer rebuilds its groups and model on them and calls restore(): a
//    rank that lost its state receives it from its holder.
//  - A process left out (stopped, then continued) learns it was replaced and
//    raises CommError saying so. Too few live spares, or a step whose state no
//    live rank holds, ends the job with an error that names what was lost. A
//    generation whose rendezvous or rebuild fails (a rank lost during
//    recovery) is followed by the next, up to three in one recover().

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "launch/init.h"
#include "launch/snapshot.h"

namespace bulkhead::launch {

// Store keys shared with init (the job's whole store).
inline constexpr const char* kSparePrefix = "spare/";  // a spare's heartbeats: "spare/state/<launcher rank>"
inline constexpr const char* kSpareDone = "done";
// "" while the spare waits; "gen <g>" once a recovery gave it a turn; "done" at the job's end.
std::string spareTurnKey(int launcherRank);
// A generation's view of the job's store: the whole store for generation 0, keys under "gen/<g>/" after.
std::shared_ptr<Store> generationStore(const std::shared_ptr<Store>& job, int generation);

struct RecoveryOptions {
  // A snapshot after every this many steps (afterStep).
  int64_t snapshotEvery = 1;
  // GPU state through a device buffer, downloaded behind the training
  // (SnapshotOptions::stageOnDevice); false saves that GPU memory, and each
  // snapshot then holds its step up for the copy to the host.
  bool stageOnDevice = true;
};

// What a recovery or a spare's turn did.
struct Recovered {
  int generation = 0;
  int64_t step = 0;           // completed steps every rank resumes from
  std::vector<int> replaced;  // ranks whose process changed, given to spares
  double seconds = 0;         // from recover()'s start (or the spare's turn) to the new worlds
};

class Recovery {
 public:
  explicit Recovery(Runtime& runtime, RecoveryOptions options = {});
  ~Recovery();
  Recovery(const Recovery&) = delete;
  Recovery& operator=(const Recovery&) = delete;

  // Whether this job recovers at all (it has spares).
  bool enabled() const { return runtime_.spares() > 0; }

  // A spare: waits until a recovery gives it a rank (then the runtime has that
  // rank's worlds; restore() next) or the job ends (nullopt: its ranks
  // finished, or stopped beating for long).
  std::optional<Recovered> awaitTurn();

  // A snapshot of `state` after `completedSteps` steps, due or not (the
  // trainer takes one before its first step). Collective over the CPU world
  // (and, with GPU state, the world).
  void snapshot(int64_t completedSteps, const NamedTensors& state);
  // Whether a snapshot is due after `completedSteps` steps (never without spares).
  bool due(int64_t completedSteps) const { return enabled() && completedSteps % options_.snapshotEvery == 0; }
  // After `completedSteps` steps: a snapshot of `state` when due. Collective
  // over the CPU world (a fault in it reaches recover() like any other).
  void afterStep(int64_t completedSteps, const NamedTensors& state);

  // Called with the error a step raised: recovers and returns, or rethrows
  // `cause` (not a communication error, or no spares), or raises the error
  // that ended the recovery.
  Recovered recover(const std::exception_ptr& cause);

  // After recover() or awaitTurn(), on the state of the rebuilt model:
  // fills it with the snapshot of Recovered::step (this rank's own, or sent by
  // its holder) and takes that snapshot again in the new world. Collective.
  void restore(const NamedTensors& state);

  const Snapshots& snapshots() const { return snapshots_; }
  // What this process's snapshots have cost so far (Snapshots::cost).
  SnapshotCost snapshotCost() { return snapshots_.cost(); }

 private:
  struct Plan;
  // The leader's part: who takes each rank, and the step to resume from.
  Plan lead(int generation, int from, Deadline deadline);
  Recovered joinGeneration(int generation, int from, Deadline deadline);
  Recovered start(const Plan& plan, int generation, std::chrono::steady_clock::time_point since, Deadline deadline);
  // The world a snapshot's GPU part travels over: the runtime's world on a GPU, else none.
  Communicator* deviceWorld() const;

  Runtime& runtime_;
  RecoveryOptions options_;
  std::string process_;  // host:pid:nonce, this process's name in a plan
  Snapshots snapshots_;
  std::shared_ptr<Plan> plan_;  // the last one joined, for restore()
  int attempted_ = 0;           // the latest generation this process took part in
};

}  // namespace bulkhead::launch
