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
#include "runtime/monitor.h"

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
};

class Runtime {
 public:
  // `world` runs the backend's operations; `cpuWorld` is the CPU world beside
  // it (MPI's, or Gloo's in a job started without MPI; the same communicator
  // when the backend is mpi or gloo).
  Runtime(launch::WorldInfo info, Backend backend, CommunicatorPtr world, CommunicatorPtr cpuWorld,
          launch::Rendezvous rendezvous, std::shared_ptr<Monitor> monitor);
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;
  // Shuts down with BULKHEAD_SHUTDOWN_TIMEOUT if shutdown() was not called.
  ~Runtime();

  const launch::WorldInfo& info() const { return info_; }
  Backend backend() const { return backend_; }
  Communicator& world() { return *world_; }
  const CommunicatorPtr& worldPtr() const { return world_; }
  // CPU tensors, whatever the backend: bootstrap and out-of-band coordination.
  Communicator& cpuWorld() { return *cpuWorld_; }
  const CommunicatorPtr& cpuWorldPtr() const { return cpuWorld_; }
  // The job's rendezvous store (hosted by rank 0) and the monitor that
  // publishes every communicator's ledger through it.
  const std::shared_ptr<Store>& store() const { return rendezvous_.store; }
  const std::shared_ptr<Monitor>& monitor() const { return monitor_; }
  // The device of the backend's tensors: cuda:<n> for nccl, cpu for mpi and gloo.
  c10::Device device() const { return world_->device(); }

  // A final world barrier under the deadline (every rank is then done with
  // the store), then the backend's finalize.
  // With MPI, a process whose collective timed out exits here with code 3
  // (see runtime/mpi/mpi_backend.h).
  // After a fatal error (runtime/fatal_exit.h) it waits on no peer: the
  // communicators are aborted, and rank 0's store serves one abort grace
  // longer so that the others can still diagnose.
  void shutdown(std::optional<Deadline> deadline = std::nullopt);

 private:
  void endAfterFatalError();

  launch::WorldInfo info_;
  Backend backend_;
  CommunicatorPtr world_;
  CommunicatorPtr cpuWorld_;
  launch::Rendezvous rendezvous_;
  std::shared_ptr<Monitor> monitor_;
  bool down_ = false;
};

std::unique_ptr<Runtime> init(InitOptions options = {});

// Runs a program's body and turns a Bulkhead error into a logged message and
// the error's exit code (2 config, 3 timeout, 4 desync, 5 comm, 6 io,
// 7 checkpoint); any other exception exits with 1.
// It turns on the bounded exit (runtime/fatal_exit.h): after a fatal
// communication error it does not return but ends the process with that
// error's code, an abort grace after the error (so that every rank logs its
// own diagnosis first) and within BULKHEAD_SHUTDOWN_TIMEOUT +
// BULKHEAD_ABORT_GRACE + 2 s of it whatever is blocked.
int guardedMain(const std::function<int()>& body);

}  // namespace bulkhead
