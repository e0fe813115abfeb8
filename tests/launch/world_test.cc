#include <map>
#include <string>

#include "launch/bootstrap.h"
#include "launch/world.h"
#include "runtime/errors.h"
#include "tests/support/catch_compat.h"

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

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }
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
