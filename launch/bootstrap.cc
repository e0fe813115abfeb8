#include "launch/bootstrap.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <map>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "runtime/backoff.h"
#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::launch {
namespace {

const std::string kArrivals = "bootstrap/arrivals";
// The first contradiction a rank finds, for every other rank to report too.
const std::string kProblem = "bootstrap/problem";

struct Arrival {
  int rank = -1;
  int size = 0;
  std::string process;  // host:pid:nonce, unique per process
};

std::string processId() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::random_device entropy;
  return fmt::format("{}:{}:{:08x}", host, ::getpid(), entropy());
}

std::string describe(const Arrival& a) {
  return fmt::format("{} (pid {})", a.process.substr(0, a.process.find(':')),
                     a.process.substr(a.process.find(':') + 1, a.process.rfind(':') - a.process.find(':') - 1));
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

bool isNumeric(const std::string& host) {
  return host.find_first_not_of("0123456789.:abcdefABCDEF") == std::string::npos &&
         host.find_first_of(".:") != std::string::npos;
}

// Reads every arrival so far and raises on a contradiction; returns the ranks
// seen.
std::set<int> checkRoster(Store& store, const WorldInfo& world, const Arrival& me, Deadline deadline) {
  const int64_t count = parseStoreInteger(store.tryGet(kArrivals, deadline).value_or("0")).value_or(0);
  std::vector<std::string> keys{kProblem};
  for (int64_t i = 1; i <= count; ++i) keys.push_back(fmt::format("bootstrap/arrival/{}", i));
  std::vector<std::optional<std::string>> values = store.multiGet(keys, deadline);
  if (values[0])
    throw ConfigError(*values[0], {.rank = world.rank, .group = "world", .expected = "a consistent launch"});
  std::map<int, std::vector<Arrival>> byRank;
  for (const auto& value : std::vector<std::optional<std::string>>(values.begin() + 1, values.end())) {
    if (!value) continue;
    Arrival a;
    std::istringstream in(*value);
    in >> a.rank >> a.size >> a.process;
    if (a.size != world.size)
      throw ConfigError(fmt::format("rank {} on {} started with WORLD_SIZE={}, but rank {} has {}: every rank "
                                    "must be started with the same world size; fix the launch command",
                                    a.rank, describe(a), a.size, world.rank, world.size),
                        {.rank = world.rank, .group = "world", .expected = fmt::format("WORLD_SIZE={}", world.size)});
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

}  // namespace

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

Rendezvous joinStore(const WorldInfo& world, Deadline deadline) {
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
    rendezvous.server = std::make_unique<TcpStoreServer>(TcpStoreOptions{
        .host = isNumeric(host) ? host : "0.0.0.0", .port = static_cast<uint16_t>(port), .token = token, .rank = 0});
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

  Arrival me{world.rank, world.size, processId()};
  const int64_t slot = client->add(kArrivals, 1, deadline);
  client->set(fmt::format("bootstrap/arrival/{}", slot), fmt::format("{} {} {}", me.rank, me.size, me.process),
              deadline);
  // Round trips may outlast the deadline by a second, so that its expiry is
  // reported as the missing ranks, not as a store timeout.
  const Deadline roundTrips = deadline.isNever() ? deadline : Deadline::at(deadline.when() + std::chrono::seconds(1));
  Backoff backoff(std::chrono::milliseconds(50));
  for (;;) {
    std::set<int> seen;
    try {
      seen = checkRoster(*client, world, me, roundTrips);
    } catch (const ConfigError& e) {
      // Published for the ranks that have not seen it; rank 0 serves a moment
      // longer so that they can read it.
      try {
        client->compareSet(kProblem, "", e.message(), Deadline::afterSeconds(1));
        if (world.rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
      } catch (const Error&) {
      }
      throw;
    }
    if (static_cast<int>(seen.size()) == world.size) break;
    if (deadline.expired()) {
      std::vector<int> missing;
      for (int r = 0; r < world.size; ++r)
        if (!seen.count(r)) missing.push_back(r);
      // Rank 0 serves a moment longer, so that the others report this too
      // rather than a store that went away.
      if (world.rank == 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
      throw TimeoutError(fmt::format("rank{} {} did not join the store at {}:{} within the init deadline ({} of {} "
                                     "ranks joined): they never started, crashed, cannot reach {}:{}, or have "
                                     "another {}",
                                     missing.size() > 1 ? "s" : "", fmt::join(missing, ", "), host, port, seen.size(),
                                     world.size, host, port, env::kStoreToken.name()),
                         {.rank = world.rank, .group = "world", .expected = fmt::format("{} ranks", world.size)});
    }
    backoff.pause(deadline);
  }
  if (world.rank == 0) log::debug("launch", "rendezvous store at {}:{}: all {} ranks joined", host, port, world.size);
  return rendezvous;
}

}  // namespace bulkhead::launch
