#pragma once
// Fault injection for checkpoint tests, off by default:
//   BULKHEAD_CHECKPOINT_FAULT=rank=R[,step=S],action=A
// World rank R misbehaves while saving step S (any step when omitted):
//   exit          the process ends abruptly (_exit(17)) halfway through writing its file
//   stop          the process stops itself (SIGSTOP) there, as a frozen rank; it goes on once continued
//   kill          the process kills itself (SIGKILL) there
//   stall:SEC     its writer sleeps SEC seconds before writing (the others must give up)
//   write-error   writing its file fails as on a full disk (IoError, ENOSPC)
//   commit-exit   the coordinator ends abruptly after writing the manifest, before the rename
// A malformed value is a ConfigError that shows the expected form.

#include <cstdint>
#include <optional>
#include <string>

namespace bulkhead::checkpoint::fault {

enum class Action { Exit, Stop, Kill, Stall, WriteError, CommitExit };

struct Fault {
  int rank = -1;
  std::optional<int64_t> step;
  Action action = Action::Exit;
  double stallSeconds = 0;
};

Fault parse(const std::string& text);
// The fault configured for this rank and step, if any.
std::optional<Fault> at(int rank, int64_t step);

}  // namespace bulkhead::checkpoint::fault
