#include "checkpoint/checkpointer.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <utility>

#include "checkpoint/checksum.h"
#include "checkpoint/dtype.h"
#include "checkpoint/fs.h"
#include "checkpoint/hdf5.h"
#include "checkpoint/manifest.h"
#include "checkpoint/save_job.h"
#include "runtime/cpu_share.h"
#include "runtime/diagnosis/fatal_exit.h"
#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::checkpoint {
namespace {

std::string drawNonce() {
  std::random_device device;
  uint64_t bits = (uint64_t{device()} << 32) ^ device();
  bits ^= static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  bits ^= static_cast<uint64_t>(::getpid()) << 17;
  return hex64(Hash64().add(bits).value());
}

at::Tensor bytesTensor(const std::string& bytes) {
  at::Tensor tensor = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
  if (!bytes.empty()) std::memcpy(tensor.data_ptr(), bytes.data(), bytes.size());
  return tensor;
}

// What a rank writes: replica 0 of its slices, then its own state (and rank
// 0 the user blob), each with its chunk plan; `total` bytes of staging.
struct Planned {
  std::vector<at::Tensor> tensors;
  std::vector<StagedSlice> slices;
  int64_t total = 0;
};

Planned plan(const StateDict& state, int rank, int64_t chunkBytes) {
  validate(state, rank);
  Planned planned;
  std::unordered_map<std::string, int> names;
  auto add = [&](const std::string& key, const at::Tensor& tensor, const std::vector<int64_t>& global,
                 const std::vector<int64_t>& offsets) {
    StagedSlice slice;
    slice.key = key;
    slice.dtype = tensor.scalar_type();
    slice.globalShape = global;
    slice.offsets = offsets;
    slice.shape = tensor.sizes().vec();
    slice.dataset = h5::datasetName(key);
    if (names[slice.dataset]++ > 0) slice.dataset.append("@").append(formatDims(offsets));
    slice.plan = ChunkPlan::make(slice.shape, dtypeSize(slice.dtype), chunkBytes);
    planned.total += slice.plan.count * slice.plan.stagedBytes();
    planned.slices.push_back(std::move(slice));
    planned.tensors.push_back(tensor);
  };
  for (const auto& tensor : state.tensors)
    if (tensor.shard.replicaId == 0) add(tensor.key, tensor.local, tensor.shard.globalShape, tensor.shard.offsets);
  auto addBytes = [&](const std::string& key, const std::string& bytes) {
    int64_t size = static_cast<int64_t>(bytes.size());
    add(key, bytesTensor(bytes), {size}, {0});
  };
  for (const auto& [name, bytes] : state.rng) addBytes(rngKey(rank, name), bytes);
  addBytes(dataPositionKey(rank), state.dataPosition);
  if (rank == 0)
    for (const auto& [name, bytes] : state.user) addBytes(userKey(name), bytes);
  return planned;
}

}  // namespace

// ---- SaveHandle ----

int64_t SaveHandle::step() const { return state_ ? state_->step : -1; }

bool SaveHandle::isCompleted() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done;
}

SaveResult SaveHandle::wait(Deadline deadline) const {
  if (!state_) return {};
  auto started = Deadline::Clock::now();
  std::unique_lock<std::mutex> lock(state_->mutex);
  auto done = [&] { return state_->done; };
  if (deadline.isNever())
    state_->changed.wait(lock, done);
  else if (!state_->changed.wait_until(lock, deadline.when(), done))
    throw TimeoutError(fmt::format("the save of step {} was still running after {:.1f} s of waiting; it goes on in "
                                   "the background, bounded by its own deadline",
                                   state_->step, secondsSince(started)),
                       {.expected = "the save to end before the deadline given to wait()"});
  return state_->result;
}

// ---- Checkpointer ----

Checkpointer::Checkpointer(CheckpointOptions options, std::shared_ptr<Store> store, int rank, int worldSize,
                           std::string prefix, std::string job)
    : options_(std::move(options)),
      store_(std::move(store)),
      rank_(rank),
      worldSize_(worldSize),
      prefix_(std::move(prefix)),
      job_(std::move(job)),
      buffer_(std::make_shared<HostBuffer>()) {}

namespace {

// A save's background threads run beside the training loop; where the
// launcher binds a rank to one core (Open MPI's default for 2 ranks or fewer),
// they share it with the training loop and slow every step while a save
// writes. BULKHEAD_CHECKPOINT_NICE lessens that; several cores per rank end
// it, so a rank that may run on one core is told so.
void warnIfCramped() {
  static std::once_flag warned;
  std::call_once(warned, [] {
    const CpuShare share = cpuShare();
    if (!share.crampedToOne()) return;
    log::warn("checkpoint",
              "this rank may run on one core ({} of the host's {} CPUs; its launcher's binding), so "
              "a save's background writing shares it with the training loop and slows its steps; give each rank "
              "several cores: mpirun --map-by slot:PE=4 (or --bind-to none), srun --cpus-per-task=4",
              share.allowed, share.online);
  });
}

}  // namespace

std::unique_ptr<Checkpointer> Checkpointer::create(CheckpointOptions options, std::shared_ptr<Store> store, int rank,
                                                   int worldSize) {
  auto bad = [&](const std::string& what) {
    return ConfigError(fmt::format("checkpoint options: {}", what), {.rank = rank, .expected = "valid options"});
  };
  if (options.dir.empty()) throw bad("dir is empty; give the folder the checkpoints go to");
  if (!store) throw bad("no store; pass the runtime's rendezvous store (runtime->store())");
  if (worldSize < 1 || rank < 0 || rank >= worldSize) throw bad(fmt::format("rank {} of {}", rank, worldSize));
  if (options.keep < 0) throw bad(fmt::format("keep is {}; 0 keeps every checkpoint", options.keep));
  if (options.chunkBytes < 4096 || options.chunkBytes > (int64_t{1} << 31))
    throw bad(fmt::format("chunkBytes {} is outside [4 KiB, 2 GiB]", options.chunkBytes));
  if (options.timeoutSeconds && !(*options.timeoutSeconds > 0))
    throw bad(fmt::format("timeoutSeconds {} is not positive", *options.timeoutSeconds));
  if (options.threads && *options.threads < 1) throw bad(fmt::format("threads {} is below 1", *options.threads));
  const int64_t nice = options.backgroundNice ? *options.backgroundNice : env::kCheckpointNice.integer();
  if (nice < 0 || nice > 19)
    throw bad(fmt::format("backgroundNice {} is outside [0, 19] (BULKHEAD_CHECKPOINT_NICE)", nice));
  options.backgroundNice = static_cast<int>(nice);
  double timeout = options.timeoutSeconds.value_or(env::kCheckpointTimeout.seconds());
  Deadline deadline = Deadline::afterSeconds(timeout);
  fs::makeDirectories(options.dir, rank);
  // Checkpointers are created collectively, so the n-th one for a folder and
  // a store has the same n on every rank: it names their keys in the store.
  // Counted per store (its description names its key space), so that a
  // process that joins a job later (a spare, in a recovery generation's
  // store) counts as the ranks that were there before it.
  static std::mutex mutex;
  static std::map<std::pair<std::string, std::string>, int> created;
  int instance;
  {
    std::lock_guard<std::mutex> lock(mutex);
    instance = created[{store->describe(), options.dir}]++;
  }
  if (rank == 0) warnIfCramped();
  std::string prefix = fmt::format("ckpt/{}/{}/", hex64(Hash64().add(options.dir).value()), instance);
  std::string job;
  if (rank == 0) {
    job = drawNonce();
    store->set(prefix + "job", job, deadline);
  } else {
    job = store->get(prefix + "job", deadline);
  }
  return std::unique_ptr<Checkpointer>(
      new Checkpointer(std::move(options), std::move(store), rank, worldSize, std::move(prefix), std::move(job)));
}

namespace {

// Joins a save's thread once its work is over (result out, old checkpoints
// removed); past the deadline it is left behind, with a log line.
void joinWhenFinished(const SaveHandle& handle, std::thread& worker, Deadline deadline) {
  if (!worker.joinable()) return;
  auto& state = *handle.state();
  std::unique_lock<std::mutex> lock(state.mutex);
  auto finished = [&] { return state.finished; };
  bool over = deadline.isNever() ? (state.changed.wait(lock, finished), true)
                                 : state.changed.wait_until(lock, deadline.when(), finished);
  lock.unlock();
  if (over) {
    worker.join();
  } else {
    log::error("checkpoint",
               "the thread of the save of step {} was still removing old checkpoints at the deadline; "
               "leaving it behind",
               state.step);
    worker.detach();
  }
}

}  // namespace

Checkpointer::~Checkpointer() {
  if (!current_.valid()) return;
  auto& state = *current_.state();
  double grace = commitGraceSeconds(timeoutSeconds());
  Deadline until = Deadline::at(state.deadline.when() + std::chrono::duration_cast<Deadline::Clock::duration>(
                                                            std::chrono::duration<double>(3 * grace + 1)));
  // A process that is ending after a fatal error gives the save no more than
  // the abort grace: its commit cannot finish without the rank that stopped,
  // and `latest` keeps naming the last committed step.
  if (fatal::ending()) until = until.earliest(fatal::lingerDeadline());
  try {
    current_.wait(until);
  } catch (const std::exception& e) {
    log::error("checkpoint", "{}; leaving the save thread behind", e.what());
    if (worker_.joinable()) worker_.detach();
  }
  if (finishing_.valid()) joinWhenFinished(finishing_, finishingWorker_, until);
  joinWhenFinished(current_, worker_, until);
}

double Checkpointer::timeoutSeconds() const {
  return options_.timeoutSeconds.value_or(env::kCheckpointTimeout.seconds());
}

int Checkpointer::threads() const {
  return options_.threads.value_or(static_cast<int>(std::max<int64_t>(1, env::kCheckpointThreads.integer())));
}

void Checkpointer::settlePrevious(Deadline deadline) {
  if (!current_.valid()) return;
  SaveResult result = current_.wait(deadline);
  if (worker_.joinable()) {
    // Its thread may still be removing old checkpoints: it goes on beside the
    // next save (whose commit leaves those folders alone); the one before is
    // joined now.
    if (finishing_.valid()) joinWhenFinished(finishing_, finishingWorker_, deadline);
    finishing_ = current_;
    finishingWorker_ = std::move(worker_);
  }
  if (result.ok && current_.state().get() == supersedingSave_) {  // the later steps went aside in that commit
    newerThanResumed_.clear();
    supersedingSave_ = nullptr;
  }
  auto& state = *current_.state();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (result.ok || options_.continueOnFailure || state.raised) return;
  state.raised = true;
  commit::Failure{result.errorKind, result.error}.raise(rank_);
}

void Checkpointer::reserve(const StateDict& state) {
  settlePrevious(Deadline::afterSeconds(timeoutSeconds()));
  Planned planned = plan(state, rank_, options_.chunkBytes);
  uint8_t* before = buffer_->data();
  uint8_t* base = buffer_->reserve(static_cast<size_t>(planned.total), Stager::anyCuda(planned.tensors), rank_);
  // Touch fresh pageable memory now, so the first save does not pay its page faults.
  if (base != before && !buffer_->pinned()) std::memset(base, 0, buffer_->capacity());
}

SaveResult Checkpointer::wait(Deadline deadline) {
  if (!current_.valid()) return {};
  settlePrevious(deadline);
  if (finishing_.valid()) joinWhenFinished(finishing_, finishingWorker_, deadline);
  return current_.wait(deadline);
}

SaveHandle Checkpointer::save(int64_t step, const StateDict& state) {
  auto called = Deadline::Clock::now();
  double timeout = timeoutSeconds();
  Deadline deadline = Deadline::afterSeconds(timeout);
  if (step < 0) throw ConfigError(fmt::format("save of step {}: steps are non-negative", step), {.rank = rank_});
  settlePrevious(deadline);

  auto handleState = std::make_shared<SaveHandle::State>();
  handleState->step = step;
  handleState->deadline = deadline;
  SaveJob job;
  job.step = step;
  job.dir = options_.dir;
  job.job = job_;
  job.prefix = fmt::format("{}save/{}/", prefix_, saves_++);
  job.rank = rank_;
  job.worldSize = worldSize_;
  job.threads = threads();
  job.nice = *options_.backgroundNice;
  job.keep = options_.keep;
  job.timeoutSeconds = timeout;
  job.deadline = deadline;
  job.started = called;
  job.store = store_;
  job.buffer = buffer_;
  job.layout = state.layout;
  job.state = handleState;
  job.resumedFrom = resumedFrom_;
  job.supersedes = newerThanResumed_;
  if (!job.supersedes.empty()) supersedingSave_ = handleState.get();
  std::optional<commit::Failure> rejected;  // a ConfigError: raised here too
  try {
    validate(state, rank_);
    Planned planned = plan(state, rank_, options_.chunkBytes);
    job.slices = std::move(planned.slices);
    // Contiguous copies first (CUDA: queued on the current stream before the staging copies wait for it).
    for (auto& tensor : planned.tensors) tensor = tensor.contiguous();
    std::vector<at::Tensor>& tensors = planned.tensors;
    int64_t total = planned.total;
    uint8_t* base = buffer_->reserve(static_cast<size_t>(total), Stager::anyCuda(tensors), rank_);
    Stager stager(job.threads);
    int64_t offset = 0;
    for (size_t i = 0; i < tensors.size(); ++i) {
      StagedSlice& slice = job.slices[i];
      const ChunkPlan& plan = slice.plan;
      slice.staged = base + offset;
      for (int64_t c = 0; c < plan.count; ++c) {
        uint8_t* chunk = slice.staged + c * plan.stagedBytes();
        int64_t valid = plan.validElements(c) * plan.elementSize;
        stager.copy(tensors[i], plan.firstElement(c) * plan.elementSize, valid, chunk);
        if (valid < plan.chunkBytes()) std::memset(chunk + valid, 0, plan.chunkBytes() - valid);
      }
      offset += plan.count * plan.stagedBytes();
    }
    stager.finish(deadline, rank_);
  } catch (const std::exception& error) {
    // Published by the background part, so no rank waits for this one until the deadline.
    job.early = commit::Failure::of(error);
    if (dynamic_cast<const ConfigError*>(&error)) {
      rejected = job.early;
      handleState->raised = true;
    }
  }
  job.blockingSeconds = secondsSince(called);
  worker_ = std::thread([job = std::move(job)]() mutable { job.run(); });
  current_ = SaveHandle(handleState);
  if (rejected) rejected->raise(rank_);
  return current_;
}

}  // namespace bulkhead::checkpoint
