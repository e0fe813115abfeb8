#include "launch/bootstrap.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <map>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::launch {
namespace {

const std::string kArrivals = "bootstrap/arrivals";
// "ok" once the last rank to arrive has checked every arrival, or the first
// contradiction any rank found, after kProblemPrefix.
const std::string kRoster = "bootstrap/roster";
const std::string kRosterOk = "ok";
const std::string kProblemPrefix = "problem: ";

struct Arrival {
  int rank = -1;
  int size = 0;
  std::string process;  // host:pid:nonce, unique per process
};

std::string describe(const Arrival& a) {
  return fmt::format("{} (pid {})", a.process.substr(0, a.process.find(':')),
                     a.process.substr(a.process.find(':') + 1, a.process.rfind(':') - a.process.find(':') - 1));
}

std::string arrivalKey(int64_t slot) { return fmt::format("bootstrap/arrival/{}", slot); }

Arrival parseArrival(const std::string& value) {
  Arrival a;
  std::istringstream in(value);
  in >> a.rank >> a.size >> a.process;
  return a;
}

// Where the store is: MASTER_ADDR:MASTER_PORT (127.0.0.1 when every rank
// shares one node; BULKHEAD_STORE_HOST overrides).
std::pair<std::string, int> storeAddress(const WorldInfo& world) {
  // Loopback when every rank shares this node, as with MPI.
  std::string host = env::kStoreHost.text();
  if (host.empty() && (world.size == 1 || world.localSize == world.size)) host = "127.0.0.1";
  if (host.empty()) host = world.masterAddr;
  if (host.empty())
    throw ConfigError(
        "MASTER_ADDR is not set: ranks started without MPI meet at rank 0's store; export MASTER_ADDR "
        "(rank 0's host) and MASTER_PORT on every rank",
        {.rank = world.rank, .expected = "MASTER_ADDR set"});
  if (world.masterPort <= 0)
    throw ConfigError(
        "MASTER_PORT is not set: ranks started without MPI meet at rank 0's store on that port; export "
        "the same free MASTER_PORT on every rank",
        {.rank = world.rank, .expected = "MASTER_PORT set"});
  return {host, world.masterPort};
}

ConfigError sizeMismatch(const Arrival& a, const WorldInfo& world) {
  return ConfigError(fmt::format("rank {} on {} started with WORLD_SIZE={}, but rank {} has {}: every rank "
                                 "must be started with the same world size; fix the launch command",
                                 a.rank, describe(a), a.size, world.rank, world.size),
                     {.rank = world.rank, .group = "world", .expected = fmt::format("WORLD_SIZE={}", world.size)});
}

// Raises on a contradiction among these arrivals (another world size, a rank
// claimed by two processes); returns the ranks seen.
std::set<int> checkArrivals(const std::vector<std::optional<std::string>>& values, const WorldInfo& world) {
  std::map<int, std::vector<Arrival>> byRank;
  for (const auto& value : values) {
    if (!value) continue;
    const Arrival a = parseArrival(*value);
    if (a.size != world.size) throw sizeMismatch(a, world);
    auto& claims = byRank[a.rank];
    if (std::none_of(claims.begin(), claims.end(), [&](const Arrival& b) { return b.process == a.process; }))
      claims.push_back(a);
  }
  std::set<int> seen;
  for (const auto& [rank, claims] : byRank) {
    if (claims.size() > 1) {
      std::vector<std::string> who;
      for (const auto& c : claims) who.push_back(describe(c));
      throw ConfigError(fmt::format("two processes claim rank {}: {}; every process needs its own RANK in [0, {})",
                                    rank, fmt::join(who, " and "), world.size),
                        {.rank = world.rank, .group = "world", .expected = "one process per rank"});
    }
    seen.insert(rank);
  }
  return seen;
}

std::vector<std::string> arrivalKeys(int64_t count) {
  std::vector<std::string> keys;
  for (int64_t i = 1; i <= count; ++i) keys.push_back(arrivalKey(i));
  return keys;
}

// Every arrival so far, read once (the last arrival's check, and the report
// of a roster that never came): raises on a contradiction; the ranks seen.
std::set<int> readArrivals(Store& store, const WorldInfo& world, Deadline deadline) {
  const int64_t count = parseStoreInteger(store.tryGet(kArrivals, deadline).value_or("0")).value_or(0);
  return checkArrivals(store.multiGet(arrivalKeys(count), deadline), world);
}

// The first contradiction, for every rank to report: the first writer wins.
void publishProblem(Store& store, const Error& problem) {
  try {
    store.compareSet(kRoster, "", kProblemPrefix + problem.message(), Deadline::afterSeconds(1));
  } catch (const Error&) {
  }
}

// The roster never came by the deadline: which ranks are missing (or the
// contradiction a full read finds instead).
[[noreturn]] void reportMissing(Store& store, const WorldInfo& world, Deadline roundTrips) {
  const std::set<int> seen = readArrivals(store, world, roundTrips);
  std::vector<int> missing;
  for (int r = 0; r < world.size; ++r)
    if (!seen.count(r)) missing.push_back(r);
  const std::string where = store.describe();
  if (missing.empty())  // all arrived, but the last of them never published the roster (it died checking)
    throw TimeoutError(fmt::format("every rank joined the store at {}, but the roster was never published within the "
                                   "init deadline: the last rank to join failed while checking it",
                                   where),
                       {.rank = world.rank, .group = "world", .expected = "the roster"});
  throw TimeoutError(fmt::format("rank{} {} did not join the store at {} within the init deadline ({} of {} ranks "
                                 "joined): they never started, crashed, cannot reach it, or have another {}",
                                 missing.size() > 1 ? "s" : "", fmt::join(missing, ", "), where, seen.size(),
                                 world.size, env::kStoreToken.name()),
                     {.rank = world.rank, .group = "world", .expected = fmt::format("{} ranks", world.size)});
}

// Round trips may outlast the deadline by a second, so that its expiry is
// reported as the missing ranks, not as a store timeout.
Deadline withGrace(Deadline deadline) {
  return deadline.isNever() ? deadline : Deadline::at(deadline.when() + std::chrono::seconds(1));
}

}  // namespace

std::string processId() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::random_device entropy;
  return fmt::format("{}:{}:{:08x}", host, ::getpid(), entropy());
}

const char* toString(Bootstrap bootstrap) { return bootstrap == Bootstrap::Mpi ? "mpi" : "store"; }

Bootstrap resolveBootstrap(const std::optional<WorldInfo>& found, const EnvLookup& lookup) {
  std::string wanted = lookup(env::kBootstrap.name()).value_or("auto");
  if (wanted.empty()) wanted = "auto";
  if (wanted != "auto" && wanted != "mpi" && wanted != "store")
    throw ConfigError(fmt::format("{}='{}' is not a bootstrap; use auto, mpi or store", env::kBootstrap.name(), wanted),
                      {.expected = "auto, mpi or store"});
  if (wanted == "mpi") return Bootstrap::Mpi;
  if (wanted == "store") {
    if (!found)
      throw ConfigError(fmt::format("{}=store needs the launcher's RANK and WORLD_SIZE (or SLURM_PROCID and "
                                    "SLURM_NTASKS), and MASTER_ADDR and MASTER_PORT",
                                    env::kBootstrap.name()),
                        {.expected = "a launcher's environment"});
    return Bootstrap::Store;
  }
  if (!found || found->source == WorldSource::OpenMpi || lookup("PMIX_RANK")) return Bootstrap::Mpi;
  return Bootstrap::Store;
}

namespace {

// An arrival's record, its check against the first arrival and, for the last
// to arrive, the check of every arrival and the roster.
void checkIn(Store& store, const WorldInfo& world, const Arrival& me, int64_t slot, Deadline deadline) {
  store.set(arrivalKey(slot), fmt::format("{} {} {}", me.rank, me.size, me.process), deadline);
  // This rank's world size against the first arrival's: one read, so that
  // the rank on the other side of a mismatch finds it, whoever is last.
  if (slot > 1) {
    const Arrival first = parseArrival(store.get(arrivalKey(1), deadline));
    if (first.size != world.size) throw sizeMismatch(first, world);
  }
  if (slot < world.size) return;
  if (slot > world.size)
    throw ConfigError(fmt::format("{} processes have joined a world of {} (WORLD_SIZE={}); this one, rank {}, is "
                                  "one too many: a rank was started twice, or an earlier run used this run's id "
                                  "(with a store outside the job, give each run a new {})",
                                  slot, world.size, world.size, world.rank, env::kRunId.name()),
                      {.rank = world.rank, .group = "world", .expected = fmt::format("{} processes", world.size)});
  // The last to arrive checks every arrival once, for everyone.
  const std::vector<std::string> keys = arrivalKeys(slot);
  store.wait(keys, deadline);
  const std::set<int> seen = checkArrivals(store.multiGet(keys, withGrace(deadline)), world);
  if (static_cast<int>(seen.size()) == world.size) store.compareSet(kRoster, "", kRosterOk, withGrace(deadline));
}

}  // namespace

int64_t arriveAtRoster(Store& store, const WorldInfo& world, Deadline deadline) {
  const Arrival me{world.rank, world.size, processId()};
  const int64_t slot = store.add(kArrivals, 1, deadline);
  try {
    try {
      checkIn(store, world, me, slot, deadline);
    } catch (const TimeoutError&) {
      reportMissing(store, world, withGrace(deadline));  // a rank took a slot and never wrote it, or never came
    }
  } catch (const ConfigError& e) {
    publishProblem(store, e);
    throw;
  }
  return slot;
}

void awaitRoster(Store& store, const WorldInfo& world, Deadline deadline) {
  std::string roster;
  try {
    roster = store.get(kRoster, deadline);
  } catch (const TimeoutError&) {
    reportMissing(store, world, withGrace(deadline));
  }
  if (roster == kRosterOk) return;
  throw ConfigError(roster.rfind(kProblemPrefix, 0) == 0 ? roster.substr(kProblemPrefix.size()) : roster,
                    {.rank = world.rank, .group = "world", .expected = "a consistent launch"});
}

namespace {

// Rank 0 hosts the store at MASTER_ADDR:MASTER_PORT; every rank connects to it.
Rendezvous hostOrReachRankZero(const WorldInfo& world, Deadline deadline) {
  const std::string token = env::kStoreToken.text();
  if (token.empty())
    throw ConfigError(fmt::format("{} is not set: ranks started without MPI share the store's token through the "
                                  "environment; export the same secret on every rank (for example {}=$(openssl rand "
                                  "-hex 16), set once for the job)",
                                  env::kStoreToken.name(), env::kStoreToken.name()),
                      {.rank = world.rank, .expected = fmt::format("{} set on every rank", env::kStoreToken.name())});
  auto [host, port] = storeAddress(world);
  Rendezvous rendezvous;
  if (world.rank == 0) {
    rendezvous.server =
        std::make_unique<TcpStoreServer>(TcpStoreOptions{.host = isNumericAddress(host) ? host : "0.0.0.0",
                                                         .port = static_cast<uint16_t>(port),
                                                         .token = token,
                                                         .rank = 0});
  }
  auto client = std::make_shared<TcpStoreClient>(
      TcpStoreOptions{.host = host, .port = static_cast<uint16_t>(port), .token = token, .rank = world.rank});
  try {
    client->connect(deadline);
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("rank 0 hosts the store at {}:{} and did not answer within the init deadline: it "
                                   "never started, crashed, or {}:{} is not reachable from here ({})",
                                   host, port, host, port, e.what()),
                       {.rank = world.rank, .group = "world", .expected = "rank 0's store"});
  }
  rendezvous.store = client;
  return rendezvous;
}

}  // namespace

Rendezvous joinStore(const WorldInfo& world, Deadline deadline) {
  std::optional<Rendezvous> outside = joinOutsideStore(world, deadline);
  Rendezvous rendezvous = outside ? std::move(*outside) : hostOrReachRankZero(world, deadline);
  try {
    arriveAtRoster(*rendezvous.store, world, deadline);
    awaitRoster(*rendezvous.store, world, deadline);
  } catch (const Error&) {
    // The store's host serves a moment longer, so that the others read the
    // problem or report the missing ranks rather than a store that went away.
    if (rendezvous.server) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    throw;
  }
  if (world.rank == 0)
    log::debug("launch", "rendezvous store {}: all {} ranks joined", rendezvous.store->describe(), world.size);
  return rendezvous;
}

}  // namespace bulkhead::launch
