#include "runtime/cpu_share.h"

#include <fmt/format.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <string>

namespace bulkhead {

CpuShare cpuShare() {
  CpuShare share;
  share.online = static_cast<int>(std::max(1L, ::sysconf(_SC_NPROCESSORS_ONLN)));
  cpu_set_t set;
  CPU_ZERO(&set);
  // An affinity mask larger than cpu_set_t (over 1024 CPUs) fails here: such
  // a host is not cramped, so it counts as all of it.
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) {
    share.allowed = share.allowedCores = share.online;
    return share;
  }
  share.allowed = CPU_COUNT(&set);
  // A core's hardware threads share one list of siblings; where sysfs does
  // not say, each CPU counts as a core.
  std::set<std::string> cores;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &set)) continue;
    std::ifstream siblings(fmt::format("/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list", cpu));
    std::string list;
    if (!(siblings >> list)) list = fmt::format("cpu{}", cpu);
    cores.insert(list);
  }
  share.allowedCores = static_cast<int>(std::max<size_t>(1, cores.size()));
  return share;
}

}  // namespace bulkhead
