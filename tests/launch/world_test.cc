#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "launch/bootstrap.h"
#include "launch/world.h"
#include "runtime/errors.h"
#include "runtime/store/tcp_store.h"
#include "tests/support/catch_compat.h"
#include "tests/support/text.h"

using namespace bulkhead;
using namespace bulkhead::launch;

namespace {
EnvLookup fake(std::map<std::string, std::string> vars) {
  return [vars](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(std::string(name));
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

std::string messageOf(const std::map<std::string, std::string>& vars) {
  try {
    discoverWorld(fake(vars));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "no error";
}

using bulkhead::testing::contains;
}  // namespace

TEST_CASE("Open MPI's variables give rank, size and local rank") {
  WorldInfo world = discoverWorld(fake({{"OMPI_COMM_WORLD_RANK", "5"},
                                        {"OMPI_COMM_WORLD_SIZE", "8"},
                                        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                        {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  CHECK(world.source == WorldSource::OpenMpi);
  CHECK(world.rank == 5);
  CHECK(world.size == 8);
  CHECK(world.localRank == 1);
  CHECK(world.localSize == 4);
  CHECK(world.masterAddr.empty());
}

TEST_CASE("Slurm's variables give rank, size and local rank") {
  WorldInfo world = discoverWorld(fake({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "3"}}));
  CHECK(world.source == WorldSource::Slurm);
  CHECK(world.rank == 3);
  CHECK(world.size == 16);
  CHECK(world.localRank == 3);
}

TEST_CASE("generic variables give rank, size and the rendezvous address") {
  WorldInfo world = discoverWorld(fake({{"RANK", "2"},
                                        {"WORLD_SIZE", "4"},
                                        {"LOCAL_RANK", "0"},
                                        {"MASTER_ADDR", "10.1.2.3"},
                                        {"MASTER_PORT", "29500"}}));
  CHECK(world.source == WorldSource::Generic);
  CHECK(world.rank == 2);
  CHECK(world.size == 4);
  CHECK(world.masterAddr == "10.1.2.3");
  CHECK(world.masterPort == 29500);
}

TEST_CASE("Open MPI comes before Slurm: mpirun inside an allocation is an Open MPI job") {
  WorldInfo world = discoverWorld(fake(
      {{"OMPI_COMM_WORLD_RANK", "6"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}}));
  CHECK(world.source == WorldSource::OpenMpi);
  CHECK(world.rank == 6);
}

TEST_CASE("no launcher at all is a ConfigError that says how to launch") {
  CHECK_FALSE(findWorld(fake({})).has_value());
  std::string text = messageOf({});
  CHECK(contains(text, "no launcher found"));
  CHECK(contains(text, "mpirun"));
  CHECK(contains(text, "RANK"));
}

TEST_CASE("values that conflict are a ConfigError naming both sides") {
  SECTION("RANK disagrees with Open MPI") {
    std::string text = messageOf({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"RANK", "3"}});
    CHECK(contains(text, "RANK=1"));
    CHECK(contains(text, "set to 3"));
  }
  SECTION("WORLD_SIZE disagrees with Slurm") {
    std::string text = messageOf({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"WORLD_SIZE", "8"}});
    CHECK(contains(text, "WORLD_SIZE=4"));
  }
  SECTION("rank not below size") {
    std::string text = messageOf({{"RANK", "4"}, {"WORLD_SIZE", "4"}});
    CHECK(contains(text, "RANK=4 is not below WORLD_SIZE=4"));
  }
  SECTION("local rank not below local size") {
    CHECK(contains(messageOf({{"OMPI_COMM_WORLD_RANK", "0"},
                              {"OMPI_COMM_WORLD_SIZE", "4"},
                              {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                              {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                   "local rank 2"));
  }
}

TEST_CASE("malformed or partial launcher variables are ConfigErrors") {
  CHECK(contains(messageOf({{"RANK", "two"}, {"WORLD_SIZE", "4"}}), "RANK='two'"));
  CHECK(contains(messageOf({{"RANK", "-1"}, {"WORLD_SIZE", "4"}}), "RANK='-1'"));
  CHECK(contains(messageOf({{"OMPI_COMM_WORLD_RANK", "0"}}), "OMPI_COMM_WORLD_SIZE"));
  CHECK(contains(messageOf({{"SLURM_PROCID", "0"}}), "SLURM_NTASKS"));
  CHECK(contains(messageOf({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), "WORLD_SIZE=0"));
  CHECK(contains(messageOf({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}), "MASTER_PORT"));
}

TEST_CASE("the bootstrap is mpi under an MPI launcher or none, and the store under any other") {
  auto pick = [](std::map<std::string, std::string> vars) {
    EnvLookup env = fake(vars);
    return resolveBootstrap(findWorld(env), env);
  };
  CHECK(pick({}) == Bootstrap::Mpi);  // a single process
  CHECK(pick({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}}) == Bootstrap::Mpi);
  CHECK(pick({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}, {"PMIX_RANK", "2"}}) == Bootstrap::Mpi);
  // srun --mpi=none, torchrun, Kubernetes
  CHECK(pick({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "2"}}) == Bootstrap::Store);
  CHECK(pick({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"MASTER_ADDR", "node1"}, {"MASTER_PORT", "29500"}}) ==
        Bootstrap::Store);
  CHECK(pick({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"BULKHEAD_BOOTSTRAP", "mpi"}}) == Bootstrap::Mpi);
  CHECK(pick({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"BULKHEAD_BOOTSTRAP", "store"}}) ==
        Bootstrap::Store);
}

TEST_CASE("a bootstrap that cannot be is a ConfigError that says why") {
  auto error = [](std::map<std::string, std::string> vars) -> std::string {
    EnvLookup env = fake(vars);
    try {
      resolveBootstrap(findWorld(env), env);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  CHECK(contains(error({{"BULKHEAD_BOOTSTRAP", "tcp"}}), "use auto, mpi or store"));
  CHECK(contains(error({{"BULKHEAD_BOOTSTRAP", "store"}}), "needs the launcher's RANK and WORLD_SIZE"));
}

TEST_CASE("Slurm on one node makes every task local") {
  auto world = discoverWorld(fake({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_STEP_NUM_NODES", "1"}}));
  CHECK(world.localSize == 4);
  auto spread = discoverWorld(fake({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_STEP_NUM_NODES", "2"}}));
  CHECK(spread.localSize == -1);
}

TEST_CASE("a numeric address is one inet_pton reads, not a name made of hex letters") {
  for (const char* numeric : {"10.0.0.1", "127.0.0.1", "::1", "fe80::1", "2001:db8::7"}) {
    INFO(numeric);
    CHECK(isNumericAddress(numeric));
  }
  for (const char* name : {"bad.cafe", "dead.beef", "node-1", "a.b.c", "cafe", ""}) {
    INFO(name);
    CHECK(!isNumericAddress(name));
  }
}

namespace {

// Simulated ranks of one job, each with its own connection to one in-process
// store: every rank arrives, then every rank awaits the roster (the order one
// process must drive them in). Returns each rank's error text ("" for none).
std::vector<std::string> rendezvous(const std::vector<WorldInfo>& ranks, double seconds) {
  TcpStoreServer server(TcpStoreOptions{.host = "127.0.0.1", .port = 0, .token = "roster-test"});
  std::vector<std::unique_ptr<TcpStoreClient>> clients;
  for (const WorldInfo& world : ranks)
    clients.push_back(std::make_unique<TcpStoreClient>(
        TcpStoreOptions{.host = "127.0.0.1", .port = server.port(), .token = "roster-test", .rank = world.rank}));
  const Deadline deadline = Deadline::afterSeconds(seconds);
  std::vector<std::string> errors(ranks.size());
  std::vector<bool> arrived(ranks.size(), false);
  // Arrivals in a shuffled order, so that any rank may be the first or the last.
  std::vector<size_t> order(ranks.size());
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(static_cast<unsigned>(ranks.size()) * 7919u));
  for (size_t i : order) {
    try {
      arriveAtRoster(*clients[i], ranks[i], deadline);
      arrived[i] = true;
    } catch (const Error& e) {
      errors[i] = e.what();
    }
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (!arrived[i]) continue;
    try {
      awaitRoster(*clients[i], ranks[i], deadline);
    } catch (const Error& e) {
      errors[i] = e.what();
    }
  }
  return errors;
}

std::vector<WorldInfo> worldOf(int size, std::vector<int> ranks) {
  std::vector<WorldInfo> infos;
  for (int r : ranks) infos.push_back({.rank = r, .size = size});
  return infos;
}

}  // namespace

TEST_CASE("the store roster: every rank joins, and each contradiction reaches every rank") {
  SECTION("a whole world of 64 joins") {
    std::vector<int> ranks(64);
    std::iota(ranks.begin(), ranks.end(), 0);
    for (const std::string& error : rendezvous(worldOf(64, ranks), 10)) CHECK(error.empty());
  }
  SECTION("a rank claimed twice is named on every rank") {
    for (const std::string& error : rendezvous(worldOf(4, {0, 1, 1, 2}), 10)) {
      INFO(error);
      CHECK(contains(error, "two processes claim rank 1"));
    }
  }
  SECTION("another world size is named on every rank, whichever rank arrives first or last") {
    std::vector<WorldInfo> infos = worldOf(6, {0, 1, 2, 3, 4, 5});
    infos[3].size = 7;
    for (const std::string& error : rendezvous(infos, 10)) {
      INFO(error);
      CHECK(contains(error, "started with WORLD_SIZE="));
    }
  }
  SECTION("a rank that never comes is named at the deadline") {
    const auto start = std::chrono::steady_clock::now();
    for (const std::string& error : rendezvous(worldOf(5, {0, 1, 3, 4}), 1)) {
      INFO(error);
      CHECK(contains(error, "rank 2 did not join the store"));
      CHECK(contains(error, "4 of 5 ranks joined"));
    }
    // Four waits of up to the deadline (the ranks await one after another) plus their grace.
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(8));
  }
  SECTION("a fourth process in a world of three raises; the others raise the same or form the world") {
    // Whether the duplicate is among the first three arrivals decides which.
    std::vector<std::string> errors = rendezvous(worldOf(3, {0, 1, 2, 0}), 10);
    for (const std::string& error : errors) {
      INFO(error);
      CHECK((error.empty() || contains(error, "two processes claim rank 0") || contains(error, "one too many")));
    }
    CHECK(std::count(errors.begin(), errors.end(), "") != 4);
  }
}
