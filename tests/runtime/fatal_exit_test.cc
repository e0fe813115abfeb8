// The last resort of the bounded exit (runtime/diagnosis/fatal_exit.h), in a forked
// child whose threads are all blocked for good: it ends with the fatal
// error's code within BULKHEAD_SHUTDOWN_TIMEOUT + BULKHEAD_ABORT_GRACE + 2 s,
// naming what it still waited for; without the bound nothing ends it.
#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "runtime/diagnosis/fatal_exit.h"
#include "runtime/env.h"
#include "tests/support/catch_compat.h"

using namespace bulkhead;

namespace {

struct Outcome {
  std::optional<int> code;  // unset: still running at the limit (then killed)
  double seconds = 0;       // from the fork to its end
  std::string output;       // its stderr
};

// Runs `child` in a forked process (which must not return) and waits at
// most `limit` seconds for it, reading its stderr meanwhile.
Outcome runChild(const std::function<void()>& child, double limit) {
  int pipeEnds[2];
  REQUIRE(::pipe(pipeEnds) == 0);
  const auto start = std::chrono::steady_clock::now();
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(pipeEnds[1], STDERR_FILENO);
    ::close(pipeEnds[0]);
    child();
    ::_exit(99);
  }
  ::close(pipeEnds[1]);
  ::fcntl(pipeEnds[0], F_SETFL, O_NONBLOCK);
  Outcome outcome;
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  for (;;) {
    pollfd readable{.fd = pipeEnds[0], .events = POLLIN, .revents = 0};
    ::poll(&readable, 1, 20);
    char buffer[4096];
    for (ssize_t n; (n = ::read(pipeEnds[0], buffer, sizeof(buffer))) > 0;) outcome.output.append(buffer, n);
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      outcome.seconds = elapsed();
      outcome.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    if (elapsed() > limit) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      outcome.seconds = elapsed();
      break;
    }
  }
  char rest[4096];
  for (ssize_t n; (n = ::read(pipeEnds[0], rest, sizeof(rest))) > 0;) outcome.output.append(rest, n);
  ::close(pipeEnds[0]);
  return outcome;
}

void setTimeouts(const char* shutdown, const char* grace) {
  ::setenv("BULKHEAD_SHUTDOWN_TIMEOUT", shutdown, 1);
  ::setenv("BULKHEAD_ABORT_GRACE", grace, 1);
  env::forgetCachedValues();
}

// Every thread of the child blocked for good: one in a named wait, the main
// one on a mutex that thread holds.
[[noreturn]] void blockForever() {
  static std::mutex held;
  std::thread([] {
    std::lock_guard<std::mutex> lock(held);
    fatal::Waiting waiting("all_reduce seq 7 of dp-cp[0], which never completes");
    for (;;) ::pause();
  }).detach();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::lock_guard<std::mutex> lock(held);
  ::_exit(98);  // not reached
}

}  // namespace

TEST_CASE("a fatal error ends a process whose threads are all blocked, within the documented bound") {
  Outcome outcome = runChild(
      [] {
        setTimeouts("1", "0.5");
        fatal::endProcessOnFatalError();
        fatal::raise(3, "group dp-cp[0] all_reduce seq 7 did not complete in 2.0 s: rank 2 is dead");
        blockForever();
      },
      20);
  INFO(outcome.output);
  REQUIRE(outcome.code.has_value());
  CHECK(*outcome.code == 3);
  // The bound is 1 + 0.5 + 2 s from the error; the last resort takes 1 s of
  // it for its report.
  CHECK(outcome.seconds >= 2.3);
  CHECK(outcome.seconds <= 3.5 + 0.5);
  CHECK(outcome.output.find("rank 2 is dead") != std::string::npos);
  CHECK(outcome.output.find("all_reduce seq 7 of dp-cp[0], which never completes") != std::string::npos);
  CHECK(outcome.output.find("Threads:") != std::string::npos);
  CHECK(outcome.output.find("ending it now with code 3") != std::string::npos);
}

TEST_CASE("without the bound a fatal error is only recorded: the process goes on") {
  Outcome outcome = runChild(
      [] {
        setTimeouts("0.2", "0.1");
        fatal::raise(5, "ep[0] was aborted");
        if (!fatal::raised() || fatal::ending() || fatal::exitCode() != 5) ::_exit(1);
        std::this_thread::sleep_for(std::chrono::milliseconds(2000));  // past the bound it would have had
        ::_exit(0);
      },
      20);
  INFO(outcome.output);
  REQUIRE(outcome.code.has_value());
  CHECK(*outcome.code == 0);
}

TEST_CASE("the first fatal error is the one the process ends with, and shutdown counts from it") {
  Outcome outcome = runChild(
      [] {
        setTimeouts("0.3", "0.2");
        fatal::endProcessOnFatalError();
        if (fatal::ending() || !fatal::bound().isNever()) ::_exit(1);
        fatal::raise(4, "a desync");
        fatal::raise(5, "a later abort");
        if (!fatal::ending() || fatal::exitCode() != 4) ::_exit(2);
        // Shutdown steps started later still end BULKHEAD_SHUTDOWN_TIMEOUT after the error.
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        if (fatal::shutdownDeadline().remainingSeconds() > 0.15) ::_exit(3);
        if (fatal::lingerDeadline().remainingSeconds() > 0.05) ::_exit(5);
        blockForever();
      },
      20);
  INFO(outcome.output);
  REQUIRE(outcome.code.has_value());
  CHECK(*outcome.code == 4);
  CHECK(outcome.seconds <= 0.3 + 0.2 + 2 + 0.5);
  CHECK(outcome.output.find("a desync") != std::string::npos);
}
