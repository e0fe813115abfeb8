#include "runtime/env.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>

#include "runtime/errors.h"

namespace bulkhead::env {

const Knob kLogLevel{"BULKHEAD_LOG_LEVEL", "info", "log level: error, warn, info, debug or trace"};
const Knob kBackend{
    "BULKHEAD_BACKEND", "auto",
    "communication backend: auto (nccl where a GPU and NCCL are present; else mpi when MPI started the job, "
    "else gloo), mpi, gloo or nccl"};
const Knob kBootstrap{"BULKHEAD_BOOTSTRAP", "auto",
                      "how ranks find each other: mpi (mpirun, srun with PMIx), store (rank 0 hosts the store at "
                      "MASTER_ADDR:MASTER_PORT; needs BULKHEAD_STORE_TOKEN), or auto (mpi when an MPI launcher "
                      "started the job, else store)"};
const Knob kInitTimeout{"BULKHEAD_INIT_TIMEOUT", "120",
                        "seconds for world init, communicator bootstrap, splits and warm-up"};
const Knob kCollectiveTimeout{"BULKHEAD_COLLECTIVE_TIMEOUT", "300",
                              "seconds a collective or point-to-point operation may take before TimeoutError"};
const Knob kCheckpointTimeout{"BULKHEAD_CHECKPOINT_TIMEOUT", "600", "seconds for a checkpoint save or load"};
const Knob kCheckpointThreads{"BULKHEAD_CHECKPOINT_THREADS", "4",
                              "threads per rank that checksum, copy and read checkpoint chunks"};
const Knob kCheckpointNice{"BULKHEAD_CHECKPOINT_NICE", "10",
                           "niceness (0-19) added to the training loop's for a save's background threads, so "
                           "they leave the host's cores to the training loop; 0: the same priority"};
const Knob kCheckpointFault{
    "BULKHEAD_CHECKPOINT_FAULT", "",
    "tests only: rank=R[,step=S],action=exit|stop|kill|stall:S|write-error|commit-exit while saving"};
const Knob kShutdownTimeout{"BULKHEAD_SHUTDOWN_TIMEOUT", "30", "seconds for the final barrier and finalize"};
const Knob kAbortGrace{"BULKHEAD_ABORT_GRACE", "1",
                       "seconds an abort may take (ncclCommAbort runs on a helper thread and is abandoned after it), "
                       "and that a process whose MPI collective timed out waits before exiting, so peers report too"};
const Knob kLedgerCapacity{"BULKHEAD_LEDGER_CAPACITY", "1024",
                           "collectives each communicator remembers in its ledger (ring buffer)"};
const Knob kStoreToken{"BULKHEAD_STORE_TOKEN", "",
                       "the rendezvous store's per-job token; empty: rank 0 generates one and shares it through MPI. "
                       "Required, the same on every rank, when ranks start without MPI (BULKHEAD_BOOTSTRAP=store)"};
const Knob kStoreMaxMessage{"BULKHEAD_STORE_MAX_MESSAGE", "16777216",
                            "bytes one rendezvous store message (a request or a reply) may hold"};
const Knob kStoreHost{"BULKHEAD_STORE_HOST", "",
                      "address of rank 0's rendezvous store; empty: 127.0.0.1 when every rank shares one node, else "
                      "MASTER_ADDR, else rank 0's host name"};
const Knob kStoreAddr{
    "BULKHEAD_STORE_ADDR", "",
    "host:port of a store that runs outside the job (bulkhead-store): every rank connects there and "
    "none hosts one, so losing any rank never loses the store; needs BULKHEAD_STORE_TOKEN and a run id"};
const Knob kRunId{"BULKHEAD_RUN_ID", "",
                  "this run's name in an outside store (BULKHEAD_STORE_ADDR), the same on every rank and new for "
                  "each run; empty: SLURM_JOB_ID (with SLURM_RESTART_COUNT), else TORCHELASTIC_RUN_ID"};
const Knob kHeartbeat{"BULKHEAD_HEARTBEAT", "0.5",
                      "seconds between publications of each rank's ledger heads and heartbeat through the store"};
const Knob kNodeRelay{"BULKHEAD_NODE_RELAY", "1",
                      "relay the heartbeats of a node's ranks through its local rank 0, one store request per node"};
const Knob kStrict{"BULKHEAD_STRICT", "0",
                   "check every collective's fingerprint across its group through the store before issuing it"};
const Knob kPeerAllReduce{"BULKHEAD_PEER_ALL_REDUCE", "",
                          "process groups (by kind: tp,expert-tp,... or all) whose sums of at most "
                          "BULKHEAD_PEER_ALL_REDUCE_BYTES go through the "
                          "GPUs' peer memory within a node instead of NCCL; empty: none"};
const Knob kPeerAllReduceBytes{"BULKHEAD_PEER_ALL_REDUCE_BYTES", "1048576",
                               "the largest all-reduce in bytes that goes through peer memory"};
const Knob kGroupedProducts{"BULKHEAD_GROUPED_PRODUCTS", "hopper",
                            "the experts' bf16 grouped products on Hopper GPUs: hopper (Bulkhead's kernels) or aten "
                            "(at::_grouped_mm)"};
const Knob kLedgerDump{"BULKHEAD_LEDGER_DUMP", "",
                       "directory for per-rank ledger JSON and Chrome traces, written on a timeout and at shutdown"};
const Knob kFault{"BULKHEAD_FAULT", "",
                  "tests only: rank=R,group=G[,op=OP],seq=N,action=skip|mismatch-op|mismatch-size|delay:S|exit|stop|"
                  "kill"};

const std::vector<const Knob*>& all() {
  static const std::vector<const Knob*> knobs = {&kLogLevel,
                                                 &kBackend,
                                                 &kBootstrap,
                                                 &kInitTimeout,
                                                 &kCollectiveTimeout,
                                                 &kCheckpointTimeout,
                                                 &kCheckpointThreads,
                                                 &kCheckpointNice,
                                                 &kShutdownTimeout,
                                                 &kAbortGrace,
                                                 &kLedgerCapacity,
                                                 &kStoreToken,
                                                 &kStoreMaxMessage,
                                                 &kStoreHost,
                                                 &kStoreAddr,
                                                 &kRunId,
                                                 &kHeartbeat,
                                                 &kNodeRelay,
                                                 &kStrict,
                                                 &kPeerAllReduce,
                                                 &kPeerAllReduceBytes,
                                                 &kGroupedProducts,
                                                 &kLedgerDump,
                                                 &kFault,
                                                 &kCheckpointFault};
  return knobs;
}

namespace {

std::mutex cacheMutex;
std::map<std::string, std::optional<std::string>> cache;  // name -> value in the environment, if set

std::optional<std::string> lookup(const char* name) {
  std::lock_guard<std::mutex> lock(cacheMutex);
  auto it = cache.find(name);
  if (it == cache.end()) {
    const char* raw = std::getenv(name);
    it = cache.emplace(name, raw ? std::optional<std::string>(raw) : std::nullopt).first;
  }
  return it->second;
}

[[noreturn]] void reject(const Knob& knob, const std::string& value, const char* wanted) {
  throw ConfigError(fmt::format("{}='{}' is not {}; unset it to use the default ({}) or set a valid value", knob.name(),
                                value, wanted, knob.defaultValue()),
                    {.expected = wanted});
}

}  // namespace

void forgetCachedValues() {
  std::lock_guard<std::mutex> lock(cacheMutex);
  cache.clear();
}

bool Knob::isSet() const { return lookup(name_).has_value(); }

std::string Knob::text() const { return lookup(name_).value_or(defaultValue_); }

double Knob::seconds() const {
  std::string value = text();
  char* end = nullptr;
  double parsed = std::strtod(value.c_str(), &end);
  if (value.empty() || end != value.c_str() + value.size() || !std::isfinite(parsed) || parsed <= 0)
    reject(*this, value, "a positive number of seconds");
  return parsed;
}

int64_t Knob::integer() const {
  std::string value = text();
  char* end = nullptr;
  long long parsed = std::strtoll(value.c_str(), &end, 10);
  if (value.empty() || end != value.c_str() + value.size()) reject(*this, value, "an integer");
  return parsed;
}

bool Knob::flag() const {
  std::string value = text();
  std::transform(value.begin(), value.end(), value.begin(), [](unsigned char c) { return std::tolower(c); });
  if (value == "1" || value == "true" || value == "yes" || value == "on") return true;
  if (value == "0" || value == "false" || value == "no" || value == "off" || value.empty()) return false;
  reject(*this, text(), "a flag (1/0, true/false, yes/no, on/off)");
}

}  // namespace bulkhead::env
