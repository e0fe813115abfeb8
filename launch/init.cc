#include "launch/init.h"

#include <fmt/format.h>

#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"
#include "runtime/mpi/mpi_backend.h"
#include "runtime/nccl/nccl_backend.h"

namespace bulkhead {

const char* toString(Backend backend) {
  switch (backend) {
    case Backend::Auto: return "auto";
    case Backend::Mpi: return "mpi";
    case Backend::Nccl: return "nccl";
  }
  return "?";
}

Backend parseBackend(std::string_view text) {
  if (text == "auto") return Backend::Auto;
  if (text == "mpi") return Backend::Mpi;
  if (text == "nccl") return Backend::Nccl;
  throw ConfigError(fmt::format("{}='{}' is not a backend; use auto, mpi or nccl", env::kBackend.name(), text),
                    {.expected = "auto, mpi or nccl"});
}

namespace {

// NCCL needs a GPU of its own for every rank of a node.
bool enoughGpus(const std::optional<launch::WorldInfo>& found) {
  int localRanks = found && found->localSize > 0 ? found->localSize : 1;
  return nccl::available() && localRanks <= nccl::deviceCount();
}

Backend resolve(Backend wanted, const std::optional<launch::WorldInfo>& found) {
  if (wanted == Backend::Auto) return enoughGpus(found) ? Backend::Nccl : Backend::Mpi;
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
  Deadline until = deadline.value_or(Deadline::afterSeconds(env::kShutdownTimeout.seconds()));
  monitor_->stop();  // heartbeats end (and dumps are written) while the store still serves
  world_.reset();
  cpuWorld_.reset();
  mpi::finalize(until);  // a final barrier: every rank is done with the store after it
  if (rendezvous_.server) rendezvous_.server->stop(Deadline::afterSeconds(2));
}

std::unique_ptr<Runtime> init(InitOptions options) {
  Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kInitTimeout.seconds()));
  std::optional<launch::WorldInfo> found = launch::findWorld();
  Backend backend = resolve(options.backend.value_or(parseBackend(env::kBackend.text())), found);

  CommunicatorPtr world = mpi::initWorld({.deadline = deadline});
  launch::WorldInfo info = found.value_or(launch::WorldInfo{.source = launch::WorldSource::Generic});
  if (!found) {
    info.size = world->size();
    info.rank = world->rank();
  }
  if (info.rank != world->rank() || info.size != world->size())
    throw ConfigError(fmt::format("the {} launcher says rank {} of {}, but MPI sees rank {} of {}; the mpi backend "
                                  "needs a job started by mpirun or srun (with PMIx)",
                                  launch::toString(info.source), info.rank, info.size, world->rank(), world->size()),
                      {.rank = world->rank(), .group = "world", .expected = "the launcher and MPI to agree"});
  log::setRank(info.rank, info.size);
  if (!found) log::info("launch", "no launcher variables found: running as a single process");
  log::debug("launch", "world of {} ranks from {}, backend {}", info.size, launch::toString(info.source),
             toString(backend));
  launch::Rendezvous rendezvous = launch::startRendezvous(*world, info, deadline);
  auto monitor = std::make_shared<Monitor>(rendezvous.store, info.rank);
  monitor->watch(world);
  CommunicatorPtr backendWorld = world;
  if (backend == Backend::Nccl) {
    backendWorld = nccl::initWorld(*world, {.deadline = deadline, .localRank = info.localRank});
    monitor->watch(backendWorld);
  }
  return std::make_unique<Runtime>(std::move(info), backend, std::move(backendWorld), std::move(world),
                                   std::move(rendezvous), std::move(monitor));
}

int guardedMain(const std::function<int()>& body) {
  try {
    return body();
  } catch (const Error& e) {
    log::error("launch", "{}", e.what());
    return e.exitCode();
  } catch (const std::exception& e) {
    log::error("launch", "unexpected error: {}", e.what());
    return 1;
  }
}

}  // namespace bulkhead
