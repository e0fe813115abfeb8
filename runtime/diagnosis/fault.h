#pragma once
// Fault injection for tests, off by default. BULKHEAD_FAULT names one
// operation and what goes wrong there:
//   BULKHEAD_FAULT=rank=2,group=world,seq=6,action=skip
//   BULKHEAD_FAULT=rank=2,group=dp-cp[0],op=reduce_scatter,seq=40,action=stop
// rank is the world rank, group the communicator's name ("world", "ep[1]";
// a name without an index, "ep", stands for whichever group of that kind the
// rank is in),
// seq the operation's sequence number in that group on that rank (sends and
// receives are numbered apart from collectives, as the ledger numbers them; a
// seq names both a collective and a send or receive). With op (an operation's
// name as the ledger writes it: all_reduce, reduce_scatter, all_to_all, send,
// ...) the fault is at the first operation of that kind from seq on. Actions:
//   skip           the rank does not issue it (no communication, no ledger entry)
//   mismatch-op    the rank issues a different collective there and is stuck in it
//   mismatch-size  the rank issues the same collective with another size, stuck in it
//                  (both: collectives only; a send or receive there runs as usual)
//   delay:S        the rank issues it S seconds late
//   exit           the process ends abruptly (exit code 17) instead of issuing it
//   stop           the process stops itself (SIGSTOP) there, as a frozen rank;
//                  once continued (SIGCONT) it issues the operation
//   kill           the process kills itself (SIGKILL) there
// The mismatches are recorded in the ledger as issued but sent to no backend:
// what peers observe (through the store) is a desync, without the undefined
// behaviour of really mismatched MPI or NCCL calls.

#include <optional>
#include <string>

#include "runtime/communicator.h"

namespace bulkhead::fault {

enum class Action { Skip, MismatchOp, MismatchSize, Delay, Exit, Stop, Kill };

struct Fault {
  int rank = -1;
  std::string group;
  std::optional<OpType> op;  // unset: any operation, at seq exactly
  uint64_t seq = 0;
  Action action = Action::Skip;
  double delaySeconds = 0;
};

// Parses a BULKHEAD_FAULT value; ConfigError that shows the expected form.
Fault parse(const std::string& text);

// Whether BULKHEAD_FAULT is set at all: one load on the hot path otherwise.
bool armed();

// The fault configured for operation `seq` (of kind `op`) of `comm` on this
// rank, if any (the mismatches only for collectives), once per process.
// Delay, exit, stop and kill are carried out here; skip and the mismatches
// are returned for the backend to apply.
std::optional<Action> inject(const Communicator& comm, uint64_t seq, OpType op);

// The fingerprint a mismatching rank issues instead of `fingerprint`.
Fingerprint mismatch(const Fingerprint& fingerprint, Action action);

// The handle a skipped operation returns: completed, no error.
WorkPtr skippedWork();

}  // namespace bulkhead::fault
