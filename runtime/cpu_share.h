#pragma once
// How much of the host's CPU a thread may use: its launcher's binding
// (sched_getaffinity) against the CPUs online. Open MPI binds each rank to
// one core when it starts 2 ranks or fewer (with hyperthreading, the core's
// hardware threads); the training loop's thread then shares that core with
// every helper thread of its rank.

namespace bulkhead {

struct CpuShare {
  int allowed = 1;       // CPUs (hardware threads) the calling thread may run on
  int allowedCores = 1;  // the physical cores they belong to
  int online = 1;        // CPUs online on the host
  bool crampedToOne() const { return allowedCores == 1 && online > allowed; }
};

CpuShare cpuShare();

}  // namespace bulkhead
