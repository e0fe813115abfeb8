#include "runtime/diagnosis/fatal_exit.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <string>
#include <thread>

#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead::fatal {
namespace {

using Clock = Deadline::Clock;

// Nanoseconds on Clock (CLOCK_MONOTONIC), 0 for none.
int64_t nanos(Clock::time_point when) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(when.time_since_epoch()).count();
}

// Margin left to the report between the last resort and the documented bound.
constexpr double kReportMargin = 1.0;
constexpr double kBoundSlack = 2.0;

std::atomic<bool> enabled{false};
std::atomic<bool> deferred{false};   // recovery may follow: no countdown (deferToRecovery)
std::atomic<bool> countdown{false};  // the countdown was started (the timer thread woken)
std::atomic<int> firstCode{0};
std::atomic<int64_t> raisedAt{0};      // nanos of the first fatal error
std::atomic<int64_t> boundAt{0};       // nanos of the last resort's moment
std::atomic<double> budgetSeconds{0};  // shutdown timeout + abort grace + slack - margin, set when enabled
sem_t wake;                            // posted once, by the first raise()

// The first error's text, written once by the raise() that set firstCode.
std::array<char, 512> firstWhat{};
std::atomic<bool> whatReady{false};

// Live Waiting scopes: slot i belongs to the thread that claimed it. Only
// try_lock is used by the report, so a thread blocked inside a scope never
// holds the report up.
constexpr int kSlots = 64;
struct Slot {
  pid_t tid = 0;
  std::array<char, 160> what{};
};
std::mutex slotsMutex;
std::array<Slot, kSlots> slots;
std::array<bool, kSlots> used{};

void put(int fd, std::string_view text) {
  while (!text.empty()) {
    ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    text.remove_prefix(static_cast<size_t>(n));
  }
}

// The first line of a small /proc file, without its newline ("" if none).
std::string procLine(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  char buffer[256];
  ssize_t n = ::read(fd, buffer, sizeof(buffer) - 1);
  ::close(fd);
  if (n <= 0) return "";
  std::string text(buffer, static_cast<size_t>(n));
  return text.substr(0, text.find('\n'));
}

// "main (tid 41) in futex_wait_queue; bulkhead-wd (tid 57) in do_poll; ..."
std::string threadsText() {
  std::string text;
  DIR* dir = ::opendir("/proc/self/task");
  if (!dir) return "(no /proc/self/task)";
  int listed = 0;
  while (dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    if (++listed > 48) {
      text += "; ...";
      break;
    }
    const std::string base = std::string("/proc/self/task/") + entry->d_name;
    std::string wait = procLine(base + "/wchan");
    if (wait.empty() || wait == "0") wait = "running";
    text += fmt::format("{}{} (tid {}) in {}", text.empty() ? "" : "; ", procLine(base + "/comm"), entry->d_name, wait);
  }
  ::closedir(dir);
  return text;
}

std::string waitingText() {
  std::unique_lock<std::mutex> lock(slotsMutex, std::try_to_lock);
  if (!lock.owns_lock()) return "(busy)";
  std::string text;
  for (int i = 0; i < kSlots; ++i)
    if (used[i]) text += fmt::format("{}tid {}: {}", text.empty() ? "" : "; ", slots[i].tid, slots[i].what.data());
  return text.empty() ? "nothing named" : text;
}

void onAlarm(int) { ::_exit(firstCode.load() != 0 ? firstCode.load() : 1); }

// The report goes through the log when stderr's lock is free, else straight
// to the descriptor; under an alarm in case stderr itself blocks (a full pipe
// nobody reads).
[[noreturn]] void lastResort() {
  const int code = firstCode.load() != 0 ? firstCode.load() : 1;
  struct sigaction action {};
  action.sa_handler = onAlarm;
  ::sigaction(SIGALRM, &action, nullptr);
  sigset_t alarmOnly;
  sigemptyset(&alarmOnly);
  sigaddset(&alarmOnly, SIGALRM);
  pthread_sigmask(SIG_UNBLOCK, &alarmOnly, nullptr);
  ::alarm(1);
  const std::string what = whatReady.load() ? std::string(firstWhat.data()) : std::string("?");
  const std::string text = fmt::format(
      "the process is still running {:.1f} s after its fatal error ({}); ending it now with code {}, "
      "within the bound of {:.1f} s. Still waiting: {}. Threads: {}",
      budgetSeconds.load(), what, code, budgetSeconds.load() + kReportMargin, waitingText(), threadsText());
  if (::ftrylockfile(stderr) == 0) {
    log::error("exit", "{}", text);
    ::funlockfile(stderr);
  } else {
    put(STDERR_FILENO, "[bulkhead exit] " + text + "\n");
  }
  ::_exit(code);
}

void sleepUntil(int64_t when) {
  timespec at{.tv_sec = static_cast<time_t>(when / 1000000000), .tv_nsec = static_cast<long>(when % 1000000000)};
  while (::clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, nullptr) == EINTR) {
  }
}

void timerThread() {
  pthread_setname_np(pthread_self(), "bulkhead-exit");
  while (::sem_wait(&wake) != 0) {  // EINTR
  }
  sleepUntil(boundAt.load());
  lastResort();
}

// Starts the last resort's countdown once (with the bound on and not deferred).
void startCountdown() {
  if (!enabled.load() || deferred.load() || countdown.exchange(true)) return;
  boundAt = nanos(Clock::now()) + static_cast<int64_t>(budgetSeconds.load() * 1e9);
  ::sem_post(&wake);
}

}  // namespace

void endProcessOnFatalError() {
  static std::once_flag once;
  std::call_once(once, [] {
    budgetSeconds = env::kShutdownTimeout.seconds() + env::kAbortGrace.seconds() + kBoundSlack - kReportMargin;
    ::sem_init(&wake, 0, 0);
    // Every signal blocked in the timer: no handler of the program runs on it.
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    std::thread(timerThread).detach();
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    enabled = true;
    // A fatal error raised before the bound was turned on starts it now.
    if (firstCode.load() != 0) {
      raisedAt = nanos(Clock::now());
      startCountdown();
    }
  });
}

bool boundEnabled() { return enabled.load(); }

void raise(int exitCode, std::string_view what) {
  int none = 0;
  if (!firstCode.compare_exchange_strong(none, exitCode != 0 ? exitCode : 1)) return;
  const size_t n = std::min(what.size(), firstWhat.size() - 1);
  std::memcpy(firstWhat.data(), what.data(), n);
  firstWhat[n] = '\0';
  whatReady = true;
  raisedAt = nanos(Clock::now());
  startCountdown();
}

void deferToRecovery(bool on) { deferred = on; }

void recovered() {
  if (countdown.load()) return;  // too late: the countdown runs
  whatReady = false;
  raisedAt = 0;
  firstCode = 0;
}

void giveUpRecovery() {
  deferred = false;
  if (firstCode.load() != 0) startCountdown();
}

void raise(const std::exception_ptr& error, std::string_view otherwise) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    raise(e.exitCode(), e.what());
  } catch (const std::exception& e) {
    raise(1, e.what());
  } catch (...) {
    raise(1, otherwise);
  }
}

bool raised() { return firstCode.load() != 0; }
bool ending() { return enabled.load() && raised(); }
int exitCode() { return firstCode.load(); }

Deadline bound() {
  const int64_t at = boundAt.load();
  if (at == 0) return Deadline::never();
  return Deadline::at(Clock::time_point(std::chrono::nanoseconds(at)));
}

Deadline lingerDeadline() {
  const int64_t at = raisedAt.load();
  if (at == 0) return Deadline::afterSeconds(0);
  const auto grace = std::chrono::duration<double>(env::kAbortGrace.seconds());
  return Deadline::at(Clock::time_point(std::chrono::nanoseconds(at)) +
                      std::chrono::duration_cast<Clock::duration>(grace));
}

Deadline shutdownDeadline() {
  Deadline fromNow = Deadline::afterSeconds(env::kShutdownTimeout.seconds());
  const int64_t at = raisedAt.load();
  if (!enabled.load() || at == 0) return fromNow;
  const auto timeout = std::chrono::duration<double>(env::kShutdownTimeout.seconds());
  return fromNow.earliest(Deadline::at(Clock::time_point(std::chrono::nanoseconds(at)) +
                                       std::chrono::duration_cast<Clock::duration>(timeout)));
}

Waiting::Waiting(std::string_view what) {
  std::lock_guard<std::mutex> lock(slotsMutex);
  for (int i = 0; i < kSlots; ++i) {
    if (used[i]) continue;
    used[i] = true;
    slots[i].tid = static_cast<pid_t>(::gettid());
    const size_t n = std::min(what.size(), slots[i].what.size() - 1);
    std::memcpy(slots[i].what.data(), what.data(), n);
    slots[i].what[n] = '\0';
    slot_ = i;
    return;
  }
}

Waiting::~Waiting() {
  if (slot_ < 0) return;
  std::lock_guard<std::mutex> lock(slotsMutex);
  used[slot_] = false;
}

void exitNow(int code) {
  for (std::FILE* stream : {stdout, stderr}) {
    if (::ftrylockfile(stream) != 0) continue;  // held by a thread that may be blocked writing
    std::fflush(stream);
    ::funlockfile(stream);
  }
  ::_exit(code);
}

}  // namespace bulkhead::fatal
