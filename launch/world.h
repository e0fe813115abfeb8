#pragma once
// World discovery (docs/design.md#launch-and-the-rendezvous-store): who am I, how many of us, and where is
// the rendezvous. Sources, in order: Open MPI (OMPI_COMM_WORLD_*), Slurm
// (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), generic (RANK, WORLD_SIZE,
// LOCAL_RANK, MASTER_ADDR, MASTER_PORT). The first source whose rank variable
// is set is used; the generic variables, when set too, must agree with it.

#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace bulkhead::launch {

enum class WorldSource { OpenMpi, Slurm, Generic };
const char* toString(WorldSource source);

struct WorldInfo {
  WorldSource source = WorldSource::Generic;
  int rank = 0;
  int size = 1;
  int localRank = 0;
  int localSize = -1;      // -1 when the launcher does not say
  std::string masterAddr;  // empty when unknown (MPI carries the rendezvous then)
  int masterPort = -1;
};

// Reads one environment variable; the default reads the process environment.
using EnvLookup = std::function<std::optional<std::string>(std::string_view)>;
EnvLookup processEnvironment();

// Raises ConfigError when a value does not parse, a rank is out of range, or
// two sources disagree; nullopt when no launcher's variables are set at all.
std::optional<WorldInfo> findWorld(const EnvLookup& lookup = processEnvironment());
// As findWorld, and a ConfigError that says how to launch when none is found.
WorldInfo discoverWorld(const EnvLookup& lookup = processEnvironment());

}  // namespace bulkhead::launch
