#include "launch/init.h"

#include <fmt/format.h>

#include <thread>

#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/fatal_exit.h"
#include "runtime/gloo/gloo_backend.h"
#include "runtime/host_staged.h"
#include "runtime/log.h"
#include "runtime/mpi/mpi_backend.h"
#include "runtime/nccl/nccl_backend.h"
#include "runtime/node_relay.h"

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

// NCCL needs a GPU of its own for every rank of a node.
bool enoughGpus(const std::optional<launch::WorldInfo>& found) {
  int localRanks = found && found->localSize > 0 ? found->localSize : 1;
  return nccl::available() && localRanks <= nccl::deviceCount();
}

Backend resolve(Backend wanted, const std::optional<launch::WorldInfo>& found, launch::Bootstrap bootstrap) {
  if (wanted == Backend::Auto) {
    if (enoughGpus(found)) return Backend::Nccl;
    return bootstrap == launch::Bootstrap::Mpi ? Backend::Mpi : Backend::Gloo;
  }
  if (wanted == Backend::Mpi && bootstrap == launch::Bootstrap::Store)
    throw ConfigError(fmt::format("the mpi backend needs a job started by mpirun or srun with PMIx, but this one "
                                  "starts through the store ({} launcher); use BULKHEAD_BACKEND=gloo (or auto)",
                                  found ? launch::toString(found->source) : "no"),
                      {.rank = found ? found->rank : -1, .expected = "an MPI launcher for the mpi backend"});
  if (wanted == Backend::Nccl && nccl::available() && !enoughGpus(found))
    throw ConfigError(fmt::format("{} ranks share this node's {} GPUs, but the nccl backend needs one GPU per rank; "
                                  "start at most {} ranks per node, or use BULKHEAD_BACKEND=mpi",
                                  found->localSize, nccl::deviceCount(), nccl::deviceCount()),
                      {.rank = found->rank, .expected = "one GPU per rank"});
  return wanted;  // nccl without a GPU fails in nccl::initWorld with a ConfigError that says why
}

}  // namespace

Runtime::Runtime(launch::WorldInfo info, Backend backend, CommunicatorPtr world, CommunicatorPtr cpuWorld,
                 launch::Rendezvous rendezvous, std::shared_ptr<Monitor> monitor)
    : info_(std::move(info)),
      backend_(backend),
      world_(std::move(world)),
      cpuWorld_(std::move(cpuWorld)),
      rendezvous_(std::move(rendezvous)),
      monitor_(std::move(monitor)) {}

Runtime::~Runtime() {
  try {
    shutdown();
  } catch (const std::exception& e) {
    log::error("launch", "shutdown failed: {}", e.what());
  }
}

void Runtime::shutdown(std::optional<Deadline> deadline) {
  if (down_) return;
  down_ = true;
  if (fatal::ending()) return endAfterFatalError();
  Deadline until = deadline.value_or(fatal::shutdownDeadline());
  monitor_->stop();  // heartbeats end (and dumps are written) while the store still serves
  // Without MPI the final barrier is the CPU world's: every rank is done with
  // the store after it, so rank 0 may stop serving.
  if (std::string_view(cpuWorld_->backend()) != "mpi" && !cpuWorld_->isAborted()) {
    try {
      cpuWorld_->barrier({.deadline = until})->wait();
    } catch (const Error& e) {
      log::error("launch", "the final world barrier failed: {}", e.what());
    }
  }
  world_.reset();
  cpuWorld_.reset();
  mpi::finalize(until);  // with MPI, a final barrier: every rank is done with the store after it
  if (rendezvous_.server) rendezvous_.server->stop(Deadline::afterSeconds(2));
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

namespace {

// The address this rank's Gloo device listens on: loopback when every rank
// shares this node, else GLOO_SOCKET_IFNAME's interface or the host's name.
std::string glooHost(const launch::WorldInfo& info) {
  bool oneNode = info.size == 1 || (info.localSize > 0 && info.localSize == info.size);
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

std::unique_ptr<Runtime> init(InitOptions options) {
  Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kInitTimeout.seconds()));
  std::optional<launch::WorldInfo> found = launch::findWorld();
  launch::Bootstrap bootstrap = launch::resolveBootstrap(found);
  Backend backend = resolve(options.backend.value_or(parseBackend(env::kBackend.text())), found, bootstrap);
  launch::WorldInfo info = found.value_or(launch::WorldInfo{.source = launch::WorldSource::Generic});
  if (found) log::setRank(info.rank, info.size);

  CommunicatorPtr cpuWorld;
  launch::Rendezvous rendezvous;
  if (bootstrap == launch::Bootstrap::Mpi) {
    cpuWorld = mpiWorld(found, info, deadline);
    log::setRank(info.rank, info.size);
    if (!found) log::info("launch", "no launcher variables found: running as a single process");
    std::optional<launch::Rendezvous> outside = launch::joinOutsideStore(info, deadline);
    rendezvous = outside ? std::move(*outside) : launch::startRendezvous(*cpuWorld, info, deadline);
  } else {
    rendezvous = launch::joinStore(info, deadline);
  }
  log::debug("launch", "world of {} ranks from {}, bootstrap {}, backend {}", info.size, launch::toString(info.source),
             launch::toString(bootstrap), toString(backend));
  MonitorOptions monitorOptions = MonitorOptions::fromEnvironment();
  if (rendezvous.outside) monitorOptions.storeHostRank = -1;  // no rank hosts the store
  auto monitor = std::make_shared<Monitor>(rendezvous.store, info.rank, monitorOptions);
  monitor->relayThrough(
      joinNodeRelay(*rendezvous.store,
                    {.localRank = info.localRank, .localSize = info.localSize, .worldRank = info.rank}, deadline),
      info.localRank);
  auto glooWorld = [&] {
    return gloo::initWorld(rendezvous.store, info.rank, info.size, {.deadline = deadline, .host = glooHost(info)});
  };
  CommunicatorPtr backendWorld;
  if (bootstrap == launch::Bootstrap::Store && backend == Backend::Nccl) {
    // NCCL's unique id through the store; the CPU world is Gloo's, or (a build
    // without Gloo) CPU tensors staged through the NCCL world.
    backendWorld =
        nccl::initWorld(*rendezvous.store, info.rank, info.size, {.deadline = deadline, .localRank = info.localRank});
    monitor->watch(backendWorld);
    cpuWorld = gloo::available() ? glooWorld() : stagedOnHost(backendWorld);
    if (gloo::available()) monitor->watch(cpuWorld);
  } else {
    // Gloo carries the CPU world when it is the backend or MPI did not start the job.
    if (backend == Backend::Gloo || bootstrap == launch::Bootstrap::Store) cpuWorld = glooWorld();
    monitor->watch(cpuWorld);
    backendWorld = cpuWorld;
    if (backend == Backend::Nccl) {
      backendWorld = nccl::initWorld(*cpuWorld, {.deadline = deadline, .localRank = info.localRank});
      monitor->watch(backendWorld);
    }
  }
  return std::make_unique<Runtime>(std::move(info), backend, std::move(backendWorld), std::move(cpuWorld),
                                   std::move(rendezvous), std::move(monitor));
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
