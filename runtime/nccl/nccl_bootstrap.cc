// The NCCL backend's bounded calls (readiness, abort, a blocking call on a
// helper thread), its splits and its bootstrap from a unique id.
#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <pthread.h>

#include <cstring>

#include "runtime/backoff.h"
#include "runtime/env.h"
#include "runtime/log.h"
#include "runtime/nccl/nccl_communicator.h"

namespace bulkhead::nccl {
namespace {

ncclConfig_t configWithBlocking(int blocking) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = blocking;
  return config;
}

}  // namespace

bool waitReady(ncclComm_t comm, Deadline deadline, const ErrorContext& context) {
  Backoff backoff(std::chrono::microseconds(500));
  for (;;) {
    ncclResult_t state = ncclInProgress;
    check(ncclCommGetAsyncError(comm, &state), "ncclCommGetAsyncError", context);
    if (state == ncclSuccess) return true;
    check(state, "NCCL (asynchronous)", context);
    if (deadline.expired()) return false;
    backoff.pause(deadline);
  }
}

bool abortBounded(ncclComm_t comm, double graceSeconds) {
  struct State {
    std::mutex mutex;
    std::condition_variable done;
    bool returned = false;
  };
  auto state = std::make_shared<State>();
  std::thread([comm, state] {
    pthread_setname_np(pthread_self(), "bulkhead-abort");  // named in the last resort's report
    ncclCommAbort(comm);
    std::lock_guard<std::mutex> lock(state->mutex);
    state->returned = true;
    state->done.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mutex);
  auto grace = std::chrono::duration<double>(graceSeconds < 0 ? env::kAbortGrace.seconds() : graceSeconds);
  return state->done.wait_for(lock, grace, [&] { return state->returned; });
}

std::optional<ncclResult_t> runBounded(std::function<ncclResult_t()> call, Deadline deadline) {
  struct State {
    std::mutex mutex;
    std::condition_variable done;
    std::optional<ncclResult_t> result;
  };
  auto state = std::make_shared<State>();
  std::thread([state, call = std::move(call)] {
    ncclResult_t rc = call();
    std::lock_guard<std::mutex> lock(state->mutex);
    state->result = rc;
    state->done.notify_all();
  }).detach();
  std::unique_lock<std::mutex> lock(state->mutex);
  state->done.wait_until(lock, deadline.when(), [&] { return state->result.has_value(); });
  return state->result;
}

ncclComm_t splitBounded(ncclComm_t parent, int color, int key, Deadline deadline, const ErrorContext& context,
                        const std::string& what) {
  auto child = std::make_shared<ncclComm_t>(nullptr);
  int device = 0;
  check(cudaGetDevice(&device), "cudaGetDevice", context);
  auto rc = runBounded(
      [parent, color, key, child, device] {
        cudaSetDevice(device);
        ncclConfig_t config = configWithBlocking(1);
        return ncclCommSplit(parent, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, child.get(), &config);
      },
      deadline);
  bool ready = rc.has_value();
  if (ready) {
    check(*rc, "ncclCommSplit", context);
    // A non-blocking parent hands back the split in progress.
    ready = waitReady(parent, deadline, context) && (*child == nullptr || waitReady(*child, deadline, context));
  }
  if (!ready) {
    abortBounded(parent);  // also stops a child still bootstrapping
    throw TimeoutError(fmt::format("creating {} did not finish in the init deadline: a rank of the new group did not "
                                   "join (crashed, stalled, or out of GPU memory). Raise {} if bootstrap is only slow.",
                                   what, env::kInitTimeout.name()),
                       context);
  }
  return *child;
}

ncclComm_t bootstrapBounded(Communicator& bootstrap, Deadline deadline, const ErrorContext& context,
                            const std::string& what) {
  ncclUniqueId id;
  at::Tensor idBytes = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
  if (bootstrap.rank() == 0) {
    check(ncclGetUniqueId(&id), "ncclGetUniqueId", context);
    std::memcpy(idBytes.data_ptr(), &id, sizeof(id));
  }
  bootstrap.broadcast(idBytes, 0, {.deadline = deadline})->wait();
  std::memcpy(&id, idBytes.data_ptr(), sizeof(id));
  return initBounded(id, bootstrap.rank(), bootstrap.size(), deadline, context, what);
}

ncclComm_t initBounded(const ncclUniqueId& id, int rank, int size, Deadline deadline, const ErrorContext& context,
                       const std::string& what) {
  auto started = Deadline::Clock::now();
  ncclComm_t boot = nullptr;
  ncclConfig_t config = configWithBlocking(0);
  check(ncclCommInitRankConfig(&boot, size, id, rank, &config), "ncclCommInitRankConfig", context);
  if (!waitReady(boot, deadline, context)) {
    abortBounded(boot);
    throw TimeoutError(fmt::format("NCCL bootstrap of {} ({} ranks) did not finish in {:.1f} s: some rank "
                                   "did not join init (crashed, stalled, or out of GPU memory). Check every rank's "
                                   "log, or raise {} if bootstrap is only slow.",
                                   what, size, std::chrono::duration<double>(deadline.when() - started).count(),
                                   env::kInitTimeout.name()),
                       context);
  }
  // Bootstrap is non-blocking so that it can be bounded; the communicator
  // handed back is a blocking child of it (see splitBounded).
  ncclComm_t comm = splitBounded(boot, 0, rank, deadline, context, what + " communicator");
  auto finalized = runBounded([boot] { return ncclCommFinalize(boot); }, deadline);
  if (finalized && waitReady(boot, deadline, context)) {
    // A destroy waits for every local peer to close its connections: one
    // that stops here is left running past the deadline (the new
    // communicator's first operation then names that peer).
    if (!runBounded([boot] { return ncclCommDestroy(boot); }, deadline))
      log::warn("comm", "destroying the bootstrap communicator of {} did not finish within the init deadline", what);
  } else {
    abortBounded(boot);
  }
  return comm;
}

namespace {

// The GPU of this rank's world, made current; ConfigError without one.
int worldDevice(const WorldOptions& options, const ErrorContext& context) {
  if (!available())
    throw ConfigError(
        "the nccl backend needs a GPU and a libtorch built with CUDA; use the mpi or gloo backend "
        "(BULKHEAD_BACKEND=mpi or gloo) on CPUs",
        context);
  int device = options.device >= 0 ? options.device : options.localRank % deviceCount();
  check(cudaSetDevice(device), "cudaSetDevice", context);
  return device;
}

}  // namespace

CommunicatorPtr initWorld(Communicator& bootstrap, WorldOptions options) {
  ErrorContext context{.rank = bootstrap.members().at(bootstrap.rank()), .group = "world"};
  int device = worldDevice(options, context);
  Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kInitTimeout.seconds()));
  ncclComm_t comm = bootstrapBounded(bootstrap, deadline, context, "the world");
  auto world = std::make_shared<NcclCommunicator>(comm, device, "world", bootstrap.members());
  world->attachPeerMemory("world", deadline);
  return world;
}

CommunicatorPtr initWorld(Store& store, int rank, int size, WorldOptions options) {
  ErrorContext context{.rank = rank, .group = "world"};
  int device = worldDevice(options, context);
  Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kInitTimeout.seconds()));
  // Rank 0's unique id travels through the store.
  const std::string key = "nccl/world/unique_id";
  ncclUniqueId id;
  if (rank == 0) {
    check(ncclGetUniqueId(&id), "ncclGetUniqueId", context);
    store.set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id)), deadline);
  } else {
    std::string bytes = store.get(key, deadline);
    if (bytes.size() != sizeof(id))
      throw CommError(
          fmt::format("the NCCL unique id in the store ('{}') has {} bytes, not {}", key, bytes.size(), sizeof(id)),
          context);
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  ncclComm_t comm = initBounded(id, rank, size, deadline, context, "the world");
  std::vector<int> members(size);
  for (int r = 0; r < size; ++r) members[r] = r;
  auto world = std::make_shared<NcclCommunicator>(comm, device, "world", std::move(members));
  world->attachPeerMemory("world", deadline);
  return world;
}

}  // namespace bulkhead::nccl
