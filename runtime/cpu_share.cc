#include "runtime/cpu_share.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>

namespace bulkhead {

CpuShare cpuShare() {
  CpuShare share;
  share.online = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  cpu_set_t set;
  CPU_ZERO(&set);
  // An affinity mask larger than cpu_set_t (over 1024 CPUs) fails here: such
  // a host is not cramped, so it counts as all of it.
  share.allowed = ::sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : share.online;
  return share;
}

}  // namespace bulkhead
