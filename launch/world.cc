#include "launch/world.h"

#include <fmt/format.h>

#include <cstdlib>

#include "runtime/errors.h"

namespace bulkhead::launch {

const char* toString(WorldSource source) {
  switch (source) {
    case WorldSource::OpenMpi:
      return "Open MPI";
    case WorldSource::Slurm:
      return "Slurm";
    case WorldSource::Generic:
      return "environment";
  }
  return "?";
}

EnvLookup processEnvironment() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (!value) return std::nullopt;
    return std::string(value);
  };
}

namespace {

struct Reader {
  const EnvLookup& lookup;

  std::optional<int> integer(std::string_view name) const {
    auto text = lookup(name);
    if (!text) return std::nullopt;
    char* end = nullptr;
    long value = std::strtol(text->c_str(), &end, 10);
    if (text->empty() || *end != '\0' || value < 0 || value > 1 << 30)
      throw ConfigError(
          fmt::format("{}='{}' is not a non-negative integer; fix the launcher's environment", name, *text),
          {.expected = fmt::format("{} as a non-negative integer", name)});
    return static_cast<int>(value);
  }

  int required(std::string_view name, WorldSource source) const {
    auto value = integer(name);
    if (!value)
      throw ConfigError(fmt::format("the {} launcher set some of its variables but not {}; launch with {} "
                                    "(mpirun, srun) or set RANK, WORLD_SIZE, LOCAL_RANK yourself",
                                    toString(source), name, toString(source)),
                        {.expected = fmt::format("{} set", name)});
    return *value;
  }
};

void checkRange(const WorldInfo& world, const char* rankName, const char* sizeName) {
  if (world.size < 1)
    throw ConfigError(fmt::format("{}={} is not a world size", sizeName, world.size), {.expected = "a size >= 1"});
  if (world.rank >= world.size)
    throw ConfigError(fmt::format("{}={} is not below {}={}", rankName, world.rank, sizeName, world.size),
                      {.expected = fmt::format("a rank in [0, {})", world.size)});
  if (world.localSize > 0 && world.localRank >= world.localSize)
    throw ConfigError(fmt::format("local rank {} is not below the local size {}", world.localRank, world.localSize),
                      {.expected = "local rank < local size"});
}

// Generic variables set beside a launcher's must agree with it: a mismatch
// means two launchers (or a stale export) disagree on who this process is.
void checkAgreement(const WorldInfo& world, const Reader& env) {
  auto agree = [&](const char* name, int value) {
    auto other = env.integer(name);
    if (other && *other != value)
      throw ConfigError(fmt::format("{} says {}={}, but {} is set to {}; unset {} or launch consistently",
                                    toString(world.source), name, value, name, *other, name),
                        {.rank = world.rank, .expected = fmt::format("{}={}", name, value)});
  };
  agree("RANK", world.rank);
  agree("WORLD_SIZE", world.size);
  agree("LOCAL_RANK", world.localRank);
}

}  // namespace

std::optional<WorldInfo> findWorld(const EnvLookup& lookup) {
  Reader env{lookup};
  WorldInfo world;
  if (env.integer("OMPI_COMM_WORLD_RANK")) {
    world.source = WorldSource::OpenMpi;
    world.rank = env.required("OMPI_COMM_WORLD_RANK", world.source);
    world.size = env.required("OMPI_COMM_WORLD_SIZE", world.source);
    world.localRank = env.integer("OMPI_COMM_WORLD_LOCAL_RANK").value_or(0);
    world.localSize = env.integer("OMPI_COMM_WORLD_LOCAL_SIZE").value_or(-1);
    checkRange(world, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE");
  } else if (env.integer("SLURM_PROCID")) {
    world.source = WorldSource::Slurm;
    world.rank = env.required("SLURM_PROCID", world.source);
    world.size = env.required("SLURM_NTASKS", world.source);
    world.localRank = env.integer("SLURM_LOCALID").value_or(0);
    // One node: every task is local (the store and Gloo then use loopback).
    if (env.integer("SLURM_STEP_NUM_NODES").value_or(env.integer("SLURM_NNODES").value_or(0)) == 1)
      world.localSize = world.size;
    checkRange(world, "SLURM_PROCID", "SLURM_NTASKS");
  } else if (env.integer("RANK")) {
    world.source = WorldSource::Generic;
    world.rank = *env.integer("RANK");
    world.size = env.required("WORLD_SIZE", world.source);
    world.localRank = env.integer("LOCAL_RANK").value_or(0);
    world.localSize = env.integer("LOCAL_WORLD_SIZE").value_or(-1);
    checkRange(world, "RANK", "WORLD_SIZE");
  } else {
    return std::nullopt;
  }
  if (world.source != WorldSource::Generic) checkAgreement(world, env);
  world.masterAddr = lookup("MASTER_ADDR").value_or("");
  world.masterPort = env.integer("MASTER_PORT").value_or(-1);
  if (world.masterPort > 65535)
    throw ConfigError(fmt::format("MASTER_PORT={} is not a TCP port", world.masterPort),
                      {.expected = "MASTER_PORT in [1, 65535]"});
  return world;
}

WorldInfo discoverWorld(const EnvLookup& lookup) {
  if (auto world = findWorld(lookup)) return *world;
  throw ConfigError(
      "no launcher found: neither Open MPI (OMPI_COMM_WORLD_RANK), Slurm (SLURM_PROCID) nor RANK/WORLD_SIZE is "
      "set; start the job with mpirun or srun, or export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT",
      {.expected = "a launcher's environment"});
}

}  // namespace bulkhead::launch
