#pragma once
// Runtime init: discovers the world, starts the backend and returns the world
// communicator; shutdown is bounded like everything else.
//
//   int main() {
//     return bulkhead::guardedMain([] {
//       auto runtime = bulkhead::init();
//       auto& world = runtime->world();
//       ...
//       return 0;
//     });
//   }

#include <functional>
#include <memory>
#include <optional>

#include "launch/bootstrap.h"
#include "launch/rendezvous.h"
#include "launch/world.h"
#include "runtime/communicator.h"
#include "runtime/diagnosis/monitor.h"

namespace bulkhead {

// auto: nccl when this build has it and every rank of a node has a GPU; else
// mpi when an MPI launcher started the job, else gloo (see launch/bootstrap.h).
enum class Backend { Auto, Mpi, Nccl, Gloo };
const char* toString(Backend backend);
// "auto", "mpi", "nccl", "gloo"; anything else is a ConfigError.
Backend parseBackend(std::string_view text);

struct InitOptions {
  std::optional<Backend> backend;    // unset: BULKHEAD_BACKEND
  std::optional<Deadline> deadline;  // unset: BULKHEAD_INIT_TIMEOUT from the call
  // Processes started with the job beyond its training world, waiting to take
  // a lost rank's place (launch/recovery.h): the launcher's last `spares`
  // ranks, the same number on every process. Needs a job started without MPI
  // (an MPI launcher ends the whole job when one process dies) and a store
  // outside the job (BULKHEAD_STORE_ADDR), so that losing any process never
  // loses the store; a ConfigError says so otherwise.
  int spares = 0;
};

class Runtime {
 public:
  // `rendezvous` holds the job's store; a member's worlds come from
  // startGeneration(0, ...), which init() calls.
  Runtime(launch::WorldInfo info, Backend backend, launch::Rendezvous rendezvous, int spares, int launcherRank);
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  // Shuts down with BULKHEAD_SHUTDOWN_TIMEOUT if shutdown() was not called. Let go of while an exception
  // unwinds (an error on its way to guardedMain), it attempts no final barrier, which peers still in their
  // step would never join: it aborts its worlds and returns at once.
  ~Runtime();

  // This generation's rank and the training world's size (spares excluded).
  const launch::WorldInfo& info() const { return info_; }
  Backend backend() const { return backend_; }
  // The world of this generation; a ConfigError on a spare, which has none
  // until its turn comes (launch/recovery.h).
  Communicator& world() { return *requireWorld(world_); }
  const CommunicatorPtr& worldPtr() const { return requireWorld(world_); }
  // CPU tensors, whatever the backend: bootstrap and out-of-band coordination.
  Communicator& cpuWorld() { return *requireWorld(cpuWorld_); }
  const CommunicatorPtr& cpuWorldPtr() const { return requireWorld(cpuWorld_); }
  // This generation's view of the job's store (the whole store in generation
  // 0, keys under "gen/<g>/" after a recovery) and the monitor that publishes
  // every communicator's ledger through it.
  const std::shared_ptr<Store>& store() const { return store_; }
  const std::shared_ptr<Monitor>& monitor() const { return monitor_; }
  // The device of the backend's tensors: cuda:<n> for nccl, cpu for mpi and gloo.
  c10::Device device() const { return requireWorld(world_)->device(); }

  // Recovery inside the job (launch/recovery.h).
  // A spare waits for a rank to replace and has no world yet.
  bool isSpare() const { return spare_; }
  int spares() const { return spares_; }
  // The rank the launcher gave this process (a spare's lies past the world).
  int launcherRank() const { return launcherRank_; }
  // 0 at start; each recovery starts the next.
  int generation() const { return generation_; }
  // The job's whole store, for the keys that outlive a generation.
  const std::shared_ptr<Store>& jobStore() const { return rendezvous_.store; }
  // Aborts this generation's worlds (their children fail from now on); the
  // monitor keeps beating, so that peers see this process alive.
  void abortGeneration(const std::string& reason);
  // Lets go of the current worlds and monitor and builds `generation`'s, as
  // `rank`, under the deadline (collective over the new world's members).
  void startGeneration(int generation, int rank, Deadline deadline);

  // A final world barrier under the deadline (every rank is then done with
  // the store), then the backend's finalize.
  // With MPI, a process whose collective timed out exits here with code 3
  // (see runtime/mpi/mpi_backend.h).
  // After a fatal error (runtime/diagnosis/fatal_exit.h) it waits on no peer: the
  // communicators are aborted, and rank 0's store serves one abort grace
  // longer so that the others can still diagnose.
  // Rank 0 then tells the spares that the job is over.
  void shutdown(std::optional<Deadline> deadline = std::nullopt);

 private:
  void endAfterFatalError();
  void releaseSpares();
  const CommunicatorPtr& requireWorld(const CommunicatorPtr& comm) const;

  launch::WorldInfo info_;
  Backend backend_;
  CommunicatorPtr world_;
  CommunicatorPtr cpuWorld_;
  launch::Rendezvous rendezvous_;
  std::shared_ptr<Store> store_;
  std::shared_ptr<Monitor> monitor_;
  int spares_ = 0;
  int launcherRank_ = 0;
  int generation_ = 0;
  bool spare_ = false;
  bool down_ = false;
  friend std::unique_ptr<Runtime> init(InitOptions options);
};

std::unique_ptr<Runtime> init(InitOptions options = {});

// Runs a program's body and turns a Bulkhead error into a logged message and
// the error's exit code (2 config, 3 timeout, 4 desync, 5 comm, 6 io,
// 7 checkpoint); any other exception exits with 1.
// It turns on the bounded exit (runtime/diagnosis/fatal_exit.h): after a fatal
// communication error it does not return but ends the process with that
// error's code, an abort grace after the error (so that every rank logs its
// own diagnosis first) and within BULKHEAD_SHUTDOWN_TIMEOUT +
// BULKHEAD_ABORT_GRACE + 2 s of it whatever is blocked.
int guardedMain(const std::function<int()>& body);

}  // namespace bulkhead
