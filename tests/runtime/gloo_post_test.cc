// The gloo communicator over a stand-in Gloo transport (one process): its posts
// (Gloo's send or recv of an unbound buffer) can be held, as a pair connect
// holds them in Gloo, and no peer ever answers, so waits end by abort or timeout.

#include <ATen/ATen.h>
#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "runtime/deadline.h"
#include "runtime/errors.h"
#include "runtime/gloo/gloo_communicator.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;

namespace {

// Holds every post while closed, until opened or until its deadline passes (so
// that a test of code that cannot return while a post is held still ends).
class Gate {
 public:
  void close(Deadline until) {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = false;
    until_ = until;
  }
  void open() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
    changed_.notify_all();
  }
  // Called by every post.
  void pass() {
    std::unique_lock<std::mutex> lock(mutex_);
    ++held_;
    changed_.notify_all();
    changed_.wait_until(lock, until_.when(), [&] { return open_; });
    --held_;
  }
  // Whether a post was held at the gate by `deadline`.
  bool awaitHeld(Deadline deadline) {
    std::unique_lock<std::mutex> lock(mutex_);
    return changed_.wait_until(lock, deadline.when(), [&] { return held_ > 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool open_ = true;
  Deadline until_ = Deadline::never();
  int held_ = 0;
};

class HeldBuffer : public ::gloo::transport::UnboundBuffer {
 public:
  HeldBuffer(void* ptr, size_t size, std::shared_ptr<Gate> gate) : UnboundBuffer(ptr, size), gate_(std::move(gate)) {}

  bool waitRecv(int* rank, std::chrono::milliseconds timeout) override { return waitAborted(timeout); }
  bool waitSend(int* rank, std::chrono::milliseconds timeout) override { return waitAborted(timeout); }
  void abortWaitRecv() override { abort(); }
  void abortWaitSend() override { abort(); }
  void send(int dstRank, uint64_t slot, size_t offset, size_t nbytes) override { gate_->pass(); }
  void recv(int srcRank, uint64_t slot, size_t offset, size_t nbytes) override { gate_->pass(); }
  void recv(std::vector<int> srcRanks, uint64_t slot, size_t offset, size_t nbytes) override { gate_->pass(); }

 private:
  // As Gloo's: false once aborted, IoException when the timeout passes first.
  bool waitAborted(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!changed_.wait_for(lock, timeout, [&] { return aborted_; })) throw ::gloo::IoException("Timed out");
    aborted_ = false;
    return false;
  }
  void abort() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = true;
    changed_.notify_all();
  }

  std::shared_ptr<Gate> gate_;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool aborted_ = false;
};

class HeldTransport : public ::gloo::transport::Context {
 public:
  HeldTransport(int rank, int size, std::shared_ptr<Gate> gate) : Context(rank, size), gate_(std::move(gate)) {}
  std::unique_ptr<::gloo::transport::Pair>& createPair(int rank) override {
    throw std::logic_error("the stand-in transport has no pairs");
  }
  std::unique_ptr<::gloo::transport::UnboundBuffer> createUnboundBuffer(void* ptr, size_t size) override {
    return std::make_unique<HeldBuffer>(ptr, size, gate_);
  }

 private:
  std::shared_ptr<Gate> gate_;
};

// A Gloo context of `size` ranks over the stand-in transport.
class HeldContext : public ::gloo::Context {
 public:
  HeldContext(int rank, int size, std::shared_ptr<Gate> gate) : ::gloo::Context(rank, size) {
    transportContext_ = std::make_shared<HeldTransport>(rank, size, std::move(gate));
  }
};

CommunicatorPtr heldWorld(const std::shared_ptr<Gate>& gate) {
  // The factory only connects split groups; this test splits none.
  return bulkhead::gloo::makeCommunicator(std::make_shared<HeldContext>(0, 2, gate),
                                          bulkhead::gloo::ContextFactory(nullptr, "127.0.0.1", "gloo_post_test/"),
                                          "world", {0, 1});
}

}  // namespace

TEST_CASE("gloo: a wait keeps its deadline while another thread's post is held in Gloo") {
  auto gate = std::make_shared<Gate>();
  CommunicatorPtr comm = heldWorld(gate);
  at::Tensor first = at::zeros({4}), second = at::zeros({4});
  WorkPtr unanswered = comm->send(first, 1);
  // Held for 20 s at most: where the post blocks waiters, the wait below takes that long.
  gate->close(Deadline::afterSeconds(20));
  WorkPtr held;
  std::thread sender([&] { held = comm->recv(second, 1); });
  if (!gate->awaitHeld(Deadline::afterSeconds(10))) {
    gate->open();
    sender.join();
    FAIL("the recv never reached Gloo's post");
  }

  auto start = Deadline::Clock::now();
  CHECK_FALSE(unanswered->isCompleted());
  CHECK_THROWS_AS(unanswered->wait(Deadline::afterSeconds(0.5)), TimeoutError);
  CHECK(comm->isAborted());
  const double waited = secondsSince(start);
  gate->open();
  sender.join();
  CHECK(waited < 5.0);

  // Numbered after the first, and failed by the abort the timeout caused.
  REQUIRE(held);
  CHECK(held->sequence() == unanswered->sequence() + 1);
  CHECK(held->isCompleted());
  CHECK_THROWS_AS(held->wait(), CommError);
}
