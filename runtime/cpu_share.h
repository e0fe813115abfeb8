#pragma once
// How much of the host's CPU a thread may use: its launcher's binding
// (sched_getaffinity) against the CPUs online. Open MPI binds each rank to
// one core when it starts 2 ranks or fewer; the training loop's thread then
// shares that core with every helper thread of its rank.

namespace bulkhead {

struct CpuShare {
  int allowed = 1;  // CPUs the calling thread may run on
  int online = 1;   // CPUs online on the host
  bool crampedToOne() const { return allowed == 1 && online > 1; }
};

CpuShare cpuShare();

}  // namespace bulkhead
