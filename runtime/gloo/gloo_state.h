#pragma once
// Internal to the gloo backend: an operation in flight, the state the
// communicator shares with its threads, and those threads (one runs the
// collectives in issue order, one per peer and direction completes the sends
// and receives in the order posted).

#include <ATen/core/Tensor.h>
#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/deadline.h"
#include "runtime/diagnosis/ledger.h"
#include "runtime/errors.h"

namespace bulkhead::gloo {

using Millis = std::chrono::milliseconds;

// One operation. Its tensors stay here until it settles; an operation that was
// abandoned (abort, timeout) may still be written by Gloo, so it is kept.
struct Op {
  Fingerprint fingerprint;
  uint64_t seq = 0;
  Deadline deadline = Deadline::never();
  Deadline::Clock::time_point issuedAt;
  std::vector<at::Tensor> buffers;
  std::function<void(Millis)> run;                            // collectives: runs on the worker
  std::unique_ptr<::gloo::transport::UnboundBuffer> unbound;  // sends and receives: set once posted
  bool isSend = false;
  bool stalled = false;  // an injected mismatch: never runs, never completes
  bool done = false;     // settled (under State::mutex)
  std::exception_ptr error;
};
using OpPtr = std::shared_ptr<Op>;

// What is left of `deadline` in whole milliseconds, never less than 1 ms.
Millis remainingMillis(Deadline deadline);

// What the communicator's threads share; it outlives the communicator while a
// thread still runs a Gloo call (bounded by that call's timeout).
struct State {
  std::shared_ptr<::gloo::Context> context;
  std::shared_ptr<Ledger> ledger;
  ErrorContext errorContext;
  // Every waiter takes it (Work::wait, isCompleted, abort, the timeouts), so it
  // is never held across a Gloo call that may block (a post, a wait, a connect).
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<OpPtr> collectives;                                   // waiting for the worker, in issue order
  std::map<std::pair<int, bool>, std::deque<OpPtr>> pointToPoint;  // (peer, isSend): posted, in order
  std::deque<OpPtr> pending;                                       // issued, not settled
  std::vector<OpPtr> abandoned;
  bool stopping = false;
  bool aborted = false;
  std::string abortReason;

  // Under `mutex`: records the outcome in the ledger and wakes the waiters.
  void settle(const OpPtr& op, std::exception_ptr error);
  // Under `mutex`: fails everything not settled and wakes every waiter. A
  // first abort with a non-zero `exitCode` raises the process's fatal error
  // (runtime/diagnosis/fatal_exit.h); 0 for a communicator that is only being destroyed.
  void abortLocked(const std::string& reason, int exitCode = 5);
};

// The worker: runs the collectives one at a time in issue order.
void collectiveWorker(std::shared_ptr<State> state);

// Completes the sends to (or receives from) one peer, in the order posted.
void pointToPointWorker(std::shared_ptr<State> state, std::pair<int, bool> key);

}  // namespace bulkhead::gloo
