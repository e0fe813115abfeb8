#include "runtime/gloo/gloo_state.h"

#include <fmt/format.h>

#include <algorithm>

#include "runtime/diagnosis/fatal_exit.h"
#include "runtime/gloo/gloo_check.h"

namespace bulkhead::gloo {

Millis remainingMillis(Deadline deadline) {
  auto left = std::chrono::duration_cast<Millis>(deadline.remaining());
  return std::max(left, Millis(1));
}

void State::settle(const OpPtr& op, std::exception_ptr error) {
  if (op->done) return;
  op->done = true;
  op->error = error;
  if (error)
    ledger->fail(op->fingerprint.op, op->seq);
  else
    ledger->complete(op->fingerprint.op, op->seq);
  pending.erase(std::remove(pending.begin(), pending.end(), op), pending.end());
  changed.notify_all();
}

void State::abortLocked(const std::string& reason, int exitCode) {
  if (!aborted && exitCode != 0) fatal::raise(exitCode, fmt::format("{} was aborted ({})", errorContext.group, reason));
  if (!aborted) abortReason = reason;
  aborted = true;
  auto error = std::make_exception_ptr(
      CommError(fmt::format("{} was aborted ({})", errorContext.group, abortReason), errorContext));
  for (const OpPtr& op : std::deque<OpPtr>(pending)) {
    if (op->unbound) op->isSend ? op->unbound->abortWaitSend() : op->unbound->abortWaitRecv();
    abandoned.push_back(op);
    settle(op, error);
  }
  collectives.clear();
  changed.notify_all();
}

// The worker: runs the collectives one at a time in issue order.
void collectiveWorker(std::shared_ptr<State> state) {
  for (;;) {
    OpPtr op;
    {
      std::unique_lock<std::mutex> lock(state->mutex);
      state->changed.wait(lock, [&] { return state->stopping || !state->collectives.empty(); });
      if (state->collectives.empty()) return;
      op = state->collectives.front();
      state->collectives.pop_front();
      if (op->done) continue;
    }
    std::exception_ptr error;
    try {
      guarded(toString(op->fingerprint.op), state->errorContext, [&] { op->run(remainingMillis(op->deadline)); });
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mutex);
    state->settle(op, error);
    // A Gloo context whose call failed is not reusable.
    if (error) state->abortLocked(fmt::format("{} seq {} failed", toString(op->fingerprint.op), op->seq));
  }
}

// Completes the sends to (or receives from) one peer, in the order posted.
void pointToPointWorker(std::shared_ptr<State> state, std::pair<int, bool> key) {
  for (;;) {
    OpPtr op;
    {
      std::unique_lock<std::mutex> lock(state->mutex);
      auto& queue = state->pointToPoint[key];
      state->changed.wait(lock, [&] { return state->stopping || !queue.empty(); });
      if (queue.empty()) return;
      op = queue.front();
      queue.pop_front();
      if (op->done) continue;
    }
    std::exception_ptr error;
    try {
      guarded(key.second ? "send" : "recv", state->errorContext, [&] {
        Millis timeout = remainingMillis(op->deadline);
        bool completed = key.second ? op->unbound->waitSend(timeout) : op->unbound->waitRecv(timeout);
        if (!completed) throw CommError("aborted while waiting", state->errorContext);
      });
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(state->mutex);
    state->settle(op, error);
    if (error && !state->aborted)
      state->abortLocked(fmt::format("{} seq {} failed", toString(op->fingerprint.op), op->seq));
  }
}

}  // namespace bulkhead::gloo
