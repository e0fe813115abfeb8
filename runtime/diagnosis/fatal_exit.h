#pragma once
// A fatal communication error ends the process in bounded time
// (docs/design.md#a-fatal-error-ends-the-process).
//
// A fatal error is a communicator aborted for a timeout, a desync, a dead or
// silent peer or an error of its backend: the job cannot go on. Once one is
// raised in a process that has the bound on (guardedMain turns it on; a
// library user calls fatal::endProcessOnFatalError()), the process ends with
// that error's exit code within
//     BULKHEAD_SHUTDOWN_TIMEOUT + BULKHEAD_ABORT_GRACE + 2 s
// whatever its threads are blocked in (an abandoned ncclCommAbort, a kernel
// that waits on a peer that is gone, a deleter or cudaFree behind it, a
// checkpoint writer, a barrier):
//  - the way out skips what waits on peers: communicators are aborted, not
//    drained and destroyed, and the final barrier is not attempted
//    (fatal::ending());
//  - guardedMain ends the process with _exit once the error reaches it (no
//    static destructors, no CUDA context teardown, no MPI_Finalize);
//  - a last resort: a thread started with the bound, which takes no lock any
//    other thread takes, sleeps until the bound, logs what the process still
//    waits for (each thread's name and kernel wait, and the fatal::Waiting
//    scopes alive) and calls _exit.
// Without the bound (library tests that provoke faults on purpose and go on)
// errors are raised exactly as before and nothing ends the process.
//
// Recovery inside the job (launch/recovery.h) defers the bound: while a
// process may recover, a fatal error is recorded (ending() is true, so the
// broken communicators are let go of without waiting on peers) but the last
// resort's countdown does not start. recovered() forgets the error once the
// job goes on; giveUpRecovery() starts the countdown from that moment.

#include <exception>
#include <string>
#include <string_view>

#include "runtime/deadline.h"

namespace bulkhead::fatal {

// Turns the bound on for this process and starts the last resort's thread;
// idempotent and thread-safe. Reads BULKHEAD_SHUTDOWN_TIMEOUT and
// BULKHEAD_ABORT_GRACE now (a ConfigError names a malformed one).
void endProcessOnFatalError();
bool boundEnabled();

// Records a fatal error; the first one's exit code and text are kept. With
// the bound on, starts the last resort's countdown. Never blocks, any thread.
void raise(int exitCode, std::string_view what);
// The same for a raised exception: an Error's exit code and what(); 1 and
// `otherwise` for anything else.
void raise(const std::exception_ptr& error, std::string_view otherwise);
// Whether a fatal error was raised (with or without the bound).
bool raised();
// Whether the process is on its way out: a fatal error was raised and the
// bound is on. Shutdown paths then skip whatever waits on peers.
bool ending();
// The first fatal error's exit code, 0 when none was raised.
int exitCode();
// The moment the last resort ends the process (Deadline::never() before a
// fatal error or without the bound).
Deadline bound();

// BULKHEAD_ABORT_GRACE after the first fatal error (now without one): how
// long an ending process keeps its store served and waits before it exits,
// so that every rank raises and logs its own diagnosis first.
Deadline lingerDeadline();

// The deadline of a shutdown step: BULKHEAD_SHUTDOWN_TIMEOUT from now, and
// once the process is ending never later than BULKHEAD_SHUTDOWN_TIMEOUT from
// its fatal error, so that all communicators and the runtime together wait
// no longer than one of them may. (A shutdown step that runs out of time
// aborts its communicator, which raises a fatal error: one slow step bounds
// the rest.)
Deadline shutdownDeadline();

// While on, a fatal error starts no countdown (see above). Idempotent.
void deferToRecovery(bool on);
// The fatal error was recovered from: forgets it, so that raised() and
// ending() are false again and the next one counts afresh.
void recovered();
// Recovery failed: with the bound on, the countdown starts now (the error
// already raised stays the one the process ends with).
void giveUpRecovery();

// Names what this thread is waiting for while it lives; the last resort's
// report lists every live one.
class Waiting {
 public:
  explicit Waiting(std::string_view what);
  ~Waiting();
  Waiting(const Waiting&) = delete;
  Waiting& operator=(const Waiting&) = delete;

 private:
  int slot_ = -1;
};

// Flushes stdio (bounded: a blocked stream is skipped) and ends the process
// at once with `code`, without destructors or teardown.
[[noreturn]] void exitNow(int code);

}  // namespace bulkhead::fatal
