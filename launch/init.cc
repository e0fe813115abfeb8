#include "launch/init.h"

#include <fmt/format.h>
#include <signal.h>

#include <csignal>
#include <exception>
#include <string>
#include <thread>

#include "launch/recovery.h"
#include "runtime/diagnosis/fatal_exit.h"
#include "runtime/diagnosis/node_relay.h"
#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/gloo/gloo_backend.h"
#include "runtime/host_staged.h"
#include "runtime/log.h"
#include "runtime/mpi/mpi_backend.h"
#include "runtime/nccl/nccl_backend.h"
#include "runtime/store/prefix_store.h"

namespace bulkhead {

const char* toString(Backend backend) {
  switch (backend) {
    case Backend::Auto:
      return "auto";
    case Backend::Mpi:
      return "mpi";
    case Backend::Nccl:
      return "nccl";
    case Backend::Gloo:
      return "gloo";
  }
  return "?";
}

Backend parseBackend(std::string_view text) {
  if (text == "auto") return Backend::Auto;
  if (text == "mpi") return Backend::Mpi;
  if (text == "nccl") return Backend::Nccl;
  if (text == "gloo") return Backend::Gloo;
  throw ConfigError(fmt::format("{}='{}' is not a backend; use auto, mpi, gloo or nccl", env::kBackend.name(), text),
                    {.expected = "auto, mpi, gloo or nccl"});
}

namespace {

// The ranks of this node that train at once: its processes, less the spares
// when the job has one node (a spare takes a lost rank's GPU).
int trainingLocalRanks(const std::optional<launch::WorldInfo>& found, int spares) {
  if (!found || found->localSize <= 0) return 1;
  return found->localSize == found->size ? found->localSize - spares : found->localSize;
}

// NCCL needs a GPU of its own for every rank of a node.
bool enoughGpus(const std::optional<launch::WorldInfo>& found, int spares) {
  return nccl::available() && trainingLocalRanks(found, spares) <= nccl::deviceCount();
}

Backend resolve(Backend wanted, const std::optional<launch::WorldInfo>& found, launch::Bootstrap bootstrap,
                int spares) {
  if (wanted == Backend::Auto) {
    if (enoughGpus(found, spares)) return Backend::Nccl;
    return bootstrap == launch::Bootstrap::Mpi ? Backend::Mpi : Backend::Gloo;
  }
  if (wanted == Backend::Mpi && bootstrap == launch::Bootstrap::Store)
    throw ConfigError(fmt::format("the mpi backend needs a job started by mpirun or srun with PMIx, but this one "
                                  "starts through the store ({} launcher); use BULKHEAD_BACKEND=gloo (or auto)",
                                  found ? launch::toString(found->source) : "no"),
                      {.rank = found ? found->rank : -1, .expected = "an MPI launcher for the mpi backend"});
  if (wanted == Backend::Nccl && nccl::available() && !enoughGpus(found, spares))
    throw ConfigError(fmt::format("{} ranks share this node's {} GPUs, but the nccl backend needs one GPU per rank; "
                                  "start at most {} ranks per node, or use BULKHEAD_BACKEND=mpi",
                                  trainingLocalRanks(found, spares), nccl::deviceCount(), nccl::deviceCount()),
                      {.rank = found->rank, .expected = "one GPU per rank"});
  return wanted;  // nccl without a GPU fails in nccl::initWorld with a ConfigError that says why
}

}  // namespace

Runtime::Runtime(launch::WorldInfo info, Backend backend, launch::Rendezvous rendezvous, int spares, int launcherRank)
    : info_(std::move(info)),
      backend_(backend),
      rendezvous_(std::move(rendezvous)),
      store_(rendezvous_.store),
      spares_(spares),
      launcherRank_(launcherRank) {}

Runtime::~Runtime() {
  try {
    // Let go of by an error on its way out (to guardedMain, which logs it next): the other ranks are still in
    // their step and would never join a final barrier, so none is attempted. The worlds are let go of at once,
    // and the error reaches the log and the exit code without waiting on any peer.
    if (std::uncaught_exceptions() > 0 && !down_ && world_ && !spare_) {
      down_ = true;
      log::error("launch", "rank {} leaves on an error (logged next), without the final barrier", info_.rank);
      endAfterFatalError();
      return;
    }
    shutdown();
  } catch (const std::exception& e) {
    log::error("launch", "shutdown failed: {}", e.what());
  }
}

const CommunicatorPtr& Runtime::requireWorld(const CommunicatorPtr& comm) const {
  if (!comm)
    throw ConfigError(spare_ ? "this process is a spare: it has no world until it takes a rank's place (Recovery::"
                               "awaitTurn, launch/recovery.h)"
                             : "this runtime has no world: it was shut down, or a recovery did not complete",
                      {.rank = info_.rank, .group = "world", .expected = "a member of the training world"});
  return comm;
}

void Runtime::shutdown(std::optional<Deadline> deadline) {
  if (down_) return;
  down_ = true;
  if (spare_ || !world_) {  // a spare whose turn never came, or a generation that never started
    if (monitor_) monitor_->stop();
    return;
  }
  if (fatal::ending()) return endAfterFatalError();
  Deadline until = deadline.value_or(fatal::shutdownDeadline());
  monitor_->stop();  // heartbeats end (and dumps are written) while the store still serves
  // Without MPI the final barrier is the CPU world's: every rank is done with
  // the store after it, so rank 0 may stop serving.
  if (std::string_view(cpuWorld_->backend()) != "mpi" && !cpuWorld_->isAborted()) {
    try {
      cpuWorld_->barrier({.deadline = until})->wait();
      releaseSpares();
    } catch (const Error& e) {
      log::error("launch", "the final world barrier failed: {}", e.what());
    }
  }
  world_.reset();
  cpuWorld_.reset();
  mpi::finalize(until);  // with MPI, a final barrier: every rank is done with the store after it
  if (rendezvous_.server) rendezvous_.server->stop(Deadline::afterSeconds(2));
}

void Runtime::releaseSpares() {
  if (spares_ == 0 || info_.rank != 0) return;
  for (int spare = info_.size; spare < info_.size + spares_; ++spare) {
    try {  // a spare already given a turn keeps it
      jobStore()->compareSet(launch::spareTurnKey(spare), "", launch::kSpareDone, Deadline::afterSeconds(2));
    } catch (const Error& e) {
      log::warn("launch", "could not tell spare {} that the job is over ({}); it ends once the ranks stop beating",
                spare, e.what());
    }
  }
}

void Runtime::endAfterFatalError() {
  // No final barrier: a peer may be the rank that stopped; the worlds abort
  // as they are let go of (a communicator of an ending process waits on no
  // peer). The store's host serves a little longer (the abort grace), so that
  // the other ranks, whose deadlines run out at about the same time, can
  // still read the heartbeats their diagnosis names the culprit from.
  fatal::Waiting waiting("the runtime's shutdown after a fatal error");
  const Deadline until = fatal::shutdownDeadline();
  monitor_->stop();
  world_.reset();
  cpuWorld_.reset();
  if (rendezvous_.server) {
    std::this_thread::sleep_until(fatal::lingerDeadline().earliest(until).when());
    rendezvous_.server->stop(Deadline::afterSeconds(1).earliest(until));
  }
}

void Runtime::abortGeneration(const std::string& reason) {
  for (const auto& comm : {world_, cpuWorld_})
    if (comm && !comm->isAborted()) comm->abort(reason);
}

namespace {

// The address this rank's Gloo device listens on: loopback when every rank
// shares this node, else GLOO_SOCKET_IFNAME's interface or the host's name.
std::string glooHost(const launch::WorldInfo& info, int spares) {
  const int launched = info.size + spares;
  bool oneNode = launched == 1 || (info.localSize > 0 && (info.localSize == info.size || info.localSize == launched));
  return oneNode ? "127.0.0.1" : "";
}

// With MPI: the MPI world, checked against the launcher's variables.
CommunicatorPtr mpiWorld(const std::optional<launch::WorldInfo>& found, launch::WorldInfo& info, Deadline deadline) {
  CommunicatorPtr world = mpi::initWorld({.deadline = deadline});
  if (!found) {
    info.size = world->size();
    info.rank = world->rank();
  }
  if (info.rank != world->rank() || info.size != world->size())
    throw ConfigError(fmt::format("the {} launcher says rank {} of {}, but MPI sees rank {} of {}; the mpi bootstrap "
                                  "needs a job started by mpirun or srun with PMIx (set {}=store for other launchers)",
                                  launch::toString(info.source), info.rank, info.size, world->rank(), world->size(),
                                  env::kBootstrap.name()),
                      {.rank = world->rank(), .group = "world", .expected = "the launcher and MPI to agree"});
  return world;
}

}  // namespace

void Runtime::startGeneration(int generation, int rank, Deadline deadline) {
  // Generation 0 under MPI: the MPI world, made before the rendezvous, is the CPU world.
  CommunicatorPtr mpiCpu =
      generation == 0 && cpuWorld_ && std::string_view(cpuWorld_->backend()) == "mpi" ? cpuWorld_ : nullptr;
  if (monitor_) monitor_->stop();
  world_.reset();
  cpuWorld_.reset();
  // A spare takes the lost rank's GPU: on one node, the one of that rank's index.
  if (spare_ && info_.localSize == info_.size) info_.localRank = rank;
  generation_ = generation;
  spare_ = false;
  info_.rank = rank;
  log::setRank(rank, info_.size);
  store_ = launch::generationStore(rendezvous_.store, generation);
  MonitorOptions monitorOptions = MonitorOptions::fromEnvironment();
  if (rendezvous_.outside) monitorOptions.storeHostRank = -1;  // no rank hosts the store
  monitor_ = std::make_shared<Monitor>(store_, rank, monitorOptions);
  // The node relay needs every process of a node in the world: not with spares.
  if (spares_ == 0)
    monitor_->relayThrough(
        joinNodeRelay(*store_, {.localRank = info_.localRank, .localSize = info_.localSize, .worldRank = rank},
                      deadline),
        info_.localRank);
  auto glooWorld = [&] {
    return gloo::initWorld(store_, rank, info_.size, {.deadline = deadline, .host = glooHost(info_, spares_)});
  };
  if (!mpiCpu && backend_ == Backend::Nccl) {
    // NCCL's unique id through the store; the CPU world is Gloo's, or (a build
    // without Gloo) CPU tensors staged through the NCCL world.
    world_ = nccl::initWorld(*store_, rank, info_.size, {.deadline = deadline, .localRank = info_.localRank});
    monitor_->watch(world_);
    cpuWorld_ = gloo::available() ? glooWorld() : stagedOnHost(world_);
    if (gloo::available()) monitor_->watch(cpuWorld_);
    return;
  }
  // Gloo carries the CPU world when it is the backend or MPI did not start the job.
  cpuWorld_ = mpiCpu && backend_ != Backend::Gloo ? mpiCpu : glooWorld();
  monitor_->watch(cpuWorld_);
  world_ = cpuWorld_;
  if (backend_ == Backend::Nccl) {
    world_ = nccl::initWorld(*cpuWorld_, {.deadline = deadline, .localRank = info_.localRank});
    monitor_->watch(world_);
  }
}

namespace {

// Spares wait for a rank that is lost, so the job must survive losing any
// process: no MPI launcher, and the store outside every rank.
void checkSpares(int spares, launch::Bootstrap bootstrap, const launch::WorldInfo& info) {
  if (spares == 0) return;
  const ErrorContext context{.rank = info.rank,
                             .expected = "spares in a job started without MPI, with a store outside"};
  if (spares < 0 || spares >= info.size)
    throw ConfigError(
        fmt::format("{} spares in a job of {} processes: leave at least one process to train", spares, info.size),
        context);
  if (bootstrap == launch::Bootstrap::Mpi)
    throw ConfigError(
        "spares need a job started without MPI (an MPI launcher ends every process when one dies): "
        "start the processes with RANK, WORLD_SIZE and BULKHEAD_BOOTSTRAP=store (bulkhead-run, "
        "torchrun, srun without PMIx or a shell loop)",
        context);
  if (env::kStoreAddr.text().empty())
    throw ConfigError(fmt::format("spares need the store outside the job, so that losing any process never loses it: "
                                  "start bulkhead-store and export {}=host:port (with its token and a run id)",
                                  env::kStoreAddr.name()),
                      context);
}

// A peer that is gone (killed, or replaced while this process was stopped)
// closes its sockets; a write into one must fail as an error the backend
// reports (EPIPE), not end this process with SIGPIPE. Bulkhead's own sockets
// send with MSG_NOSIGNAL; Gloo's transport does not. A handler the program
// installed itself is left as it is.
void ignoreBrokenPipes() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);
}

}  // namespace

std::unique_ptr<Runtime> init(InitOptions options) {
  ignoreBrokenPipes();
  Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kInitTimeout.seconds()));
  std::optional<launch::WorldInfo> found = launch::findWorld();
  launch::Bootstrap bootstrap = launch::resolveBootstrap(found);
  Backend backend =
      resolve(options.backend.value_or(parseBackend(env::kBackend.text())), found, bootstrap, options.spares);
  launch::WorldInfo info = found.value_or(launch::WorldInfo{.source = launch::WorldSource::Generic});
  if (found) log::setRank(info.rank, info.size);
  checkSpares(options.spares, bootstrap, info);

  CommunicatorPtr mpiCpu;
  launch::Rendezvous rendezvous;
  if (bootstrap == launch::Bootstrap::Mpi) {
    mpiCpu = mpiWorld(found, info, deadline);
    log::setRank(info.rank, info.size);
    if (!found) log::info("launch", "no launcher variables found: running as a single process");
    std::optional<launch::Rendezvous> outside = launch::joinOutsideStore(info, deadline);
    rendezvous = outside ? std::move(*outside) : launch::startRendezvous(*mpiCpu, info, deadline);
  } else {
    rendezvous = launch::joinStore(info, deadline);  // every process, spares included
  }
  log::debug("launch", "world of {} ranks from {}, bootstrap {}, backend {}{}", info.size - options.spares,
             launch::toString(info.source), launch::toString(bootstrap), toString(backend),
             options.spares > 0 ? fmt::format(", {} spares", options.spares) : "");
  const int launcherRank = info.rank, launched = info.size;
  info.size -= options.spares;
  if (info.localSize == launched) info.localSize = info.size;  // one node: the spares share it
  auto runtime = std::make_unique<Runtime>(info, backend, std::move(rendezvous), options.spares, launcherRank);
  if (launcherRank >= info.size) {
    // A spare beats under "spare/" until its turn comes (launch/recovery.h).
    runtime->spare_ = true;
    MonitorOptions monitorOptions = MonitorOptions::fromEnvironment();
    monitorOptions.storeHostRank = -1;
    runtime->monitor_ = std::make_shared<Monitor>(
        std::make_shared<PrefixStore>(runtime->jobStore(), launch::kSparePrefix), launcherRank, monitorOptions);
    log::info("launch", "spare {} of {}: waiting to take the place of a lost rank", launcherRank - info.size + 1,
              options.spares);
    return runtime;
  }
  runtime->cpuWorld_ = std::move(mpiCpu);
  runtime->startGeneration(0, info.rank, deadline);
  return runtime;
}

namespace {

// After a fatal error the process ends here, once every rank had its abort
// grace to raise and log its own diagnosis (under mpirun the first rank to
// exit ends the others).
[[noreturn]] void endProcess(int code) {
  std::this_thread::sleep_until(fatal::lingerDeadline().earliest(fatal::shutdownDeadline()).when());
  log::error("launch", "ending the process with code {} after a fatal error", code);
  fatal::exitNow(code);
}

}  // namespace

int guardedMain(const std::function<int()>& body) {
  fatal::endProcessOnFatalError();
  int code = 0;
  try {
    code = body();
  } catch (const Error& e) {
    log::error("launch", "{}", e.what());
    code = e.exitCode();
  } catch (const std::exception& e) {
    log::error("launch", "unexpected error: {}", e.what());
    code = 1;
  }
  // The first fatal error is the job's cause, whatever it led to later here
  // (an aborted communicator's CommError, a failed save).
  if (fatal::raised()) endProcess(fatal::exitCode());
  return code;
}

}  // namespace bulkhead
