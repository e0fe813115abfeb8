#include "launch/recovery.h"

#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "launch/bootstrap.h"
#include "runtime/diagnosis/fatal_exit.h"
#include "runtime/diagnosis/monitor.h"
#include "runtime/diagnosis/monitor_record.h"
#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"
#include "runtime/store/prefix_store.h"

namespace bulkhead::launch {

std::shared_ptr<Store> generationStore(const std::shared_ptr<Store>& job, int generation) {
  if (generation == 0) return job;
  return std::make_shared<PrefixStore>(job, fmt::format("gen/{}/", generation));
}

std::string spareTurnKey(int launcherRank) { return fmt::format("spare/{}/turn", launcherRank); }

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kAttempts = 3;
// A spare ends once every rank of the job has been silent this long.
constexpr double kJobSilentSeconds = 10;
// The leader closes its wait this long before its deadline, so the plan is out before the others' reads end.
constexpr double kLeaderMargin = 2;

double secondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::string recoveryKey(int generation, const std::string& what) {
  return fmt::format("recovery/{}/{}", generation, what);
}
const std::string kLatestGeneration = "recovery/generation";

// What a process brings to a generation's rendezvous.
struct GenerationArrival {
  int rank = -1;
  std::string process;
  std::vector<int64_t> own, ward;  // snapshot steps, -1 for none
};

std::string encode(const GenerationArrival& a) {
  return fmt::format("{} {} {} {} {} {}", a.rank, a.process, a.own[0], a.own[1], a.ward[0], a.ward[1]);
}

std::optional<GenerationArrival> decodeArrival(const std::optional<std::string>& text) {
  if (!text) return std::nullopt;
  GenerationArrival a;
  a.own.resize(2);
  a.ward.resize(2);
  std::istringstream in(*text);
  if (!(in >> a.rank >> a.process >> a.own[0] >> a.own[1] >> a.ward[0] >> a.ward[1])) return std::nullopt;
  return a;
}

// Seconds since `rank` last published its monitor record under `store`
// (infinity when it never did).
std::vector<double> silentSeconds(Store& store, const std::vector<int>& ranks, Deadline deadline) {
  std::vector<std::string> keys;
  for (int rank : ranks) keys.push_back(monitor_record::stateKey(rank));
  const auto records = store.multiGet(keys, deadline);
  const int64_t now = monitor_record::wallClockMs();
  std::vector<double> silent;
  for (const auto& record : records) {
    const auto state = monitor_record::decodeState(record);
    silent.push_back(state ? (now - state->wallMs) / 1000.0 : std::numeric_limits<double>::infinity());
  }
  return silent;
}

}  // namespace

// A generation's plan: the step to resume from and, for every rank, the
// process that takes it and where its state comes from.
struct Recovery::Plan {
  bool ok = false;
  std::string failure;
  int64_t step = -1;
  struct Member {
    std::string process;  // host:pid:nonce, or "spare:<launcher rank>"
    int source = -1;      // -1: its own copy; else the holder rank that sends it
  };
  std::vector<Member> members;  // by rank
  std::vector<int> replaced;

  std::string encode() const {
    if (!ok) return "fail\n" + failure;
    std::string text = fmt::format("ok {}\nreplaced {}\n", step, fmt::join(replaced, ","));
    for (const auto& m : members) text += fmt::format("{} {}\n", m.process, m.source);
    return text;
  }

  static Plan decode(const std::string& text) {
    Plan plan;
    std::istringstream in(text);
    std::string word;
    in >> word;
    if (word != "ok") {
      plan.failure = text.substr(std::min(text.size(), size_t{5}));
      return plan;
    }
    plan.ok = true;
    std::string replaced;
    in >> plan.step >> word;
    std::getline(in, replaced);
    std::istringstream list(replaced);
    for (std::string item; std::getline(list, item, ',');)
      if (item.find_first_not_of(" ") != std::string::npos) plan.replaced.push_back(std::stoi(item));
    for (Member m; in >> m.process >> m.source;) plan.members.push_back(m);
    return plan;
  }

  // The rank `process` takes in this plan, -1 when none.
  int rankOf(const std::string& process) const {
    for (size_t r = 0; r < members.size(); ++r)
      if (members[r].process == process) return static_cast<int>(r);
    return -1;
  }
};

namespace {

// The leader's wait: until every rank of the world arrived, or each missing
// one is silent in every generation store given (then it is lost), or the
// deadline. Returns the arrivals by rank.
std::map<int, GenerationArrival> gatherArrivals(Store& job, int generation, int size,
                                                const std::vector<std::shared_ptr<Store>>& beats, double deadAfter,
                                                Deadline until) {
  for (;;) {
    const Deadline trip = Deadline::afterSeconds(5);
    const int64_t count =
        parseStoreInteger(job.tryGet(recoveryKey(generation, "arrivals"), trip).value_or("0")).value_or(0);
    std::vector<std::string> keys;
    for (int64_t slot = 1; slot <= count; ++slot)
      keys.push_back(recoveryKey(generation, fmt::format("arrival/{}", slot)));
    std::map<int, GenerationArrival> arrived;
    for (const auto& record : job.multiGet(keys, trip))
      if (auto a = decodeArrival(record); a && a->rank >= 0 && a->rank < size) arrived.emplace(a->rank, *a);
    std::vector<int> missing;
    for (int r = 0; r < size; ++r)
      if (!arrived.count(r)) missing.push_back(r);
    if (missing.empty() || until.expired()) return arrived;
    std::vector<double> silent(missing.size(), std::numeric_limits<double>::infinity());
    for (const auto& store : beats) {
      const auto seen = silentSeconds(*store, missing, trip);
      for (size_t i = 0; i < missing.size(); ++i) silent[i] = std::min(silent[i], seen[i]);
    }
    if (std::all_of(silent.begin(), silent.end(), [&](double s) { return s > deadAfter; })) return arrived;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

// The latest step whose state survives for every rank: its process's own
// copy, or its holder's copy of it. -1 with `lost` saying why when none.
int64_t agreeStep(const std::map<int, GenerationArrival>& arrived, int size, int localSize, std::string& lost) {
  std::set<int64_t> common;
  for (int r = 0; r < size; ++r) {
    std::set<int64_t> have;
    if (auto it = arrived.find(r); it != arrived.end())
      for (int64_t s : it->second.own)
        if (s >= 0) have.insert(s);
    const int holder = holderOf(r, size, localSize);
    if (auto it = arrived.find(holder); it != arrived.end() && holder != r)
      for (int64_t s : it->second.ward)
        if (s >= 0) have.insert(s);
    if (have.empty()) {
      lost = fmt::format(
          "rank {}'s state is lost: neither its process nor its holder, rank {}, came back with a copy "
          "(both lost, or the fault came before the first snapshot)",
          r, holder);
      return -1;
    }
    std::set<int64_t> both;
    for (int64_t s : have)
      if (r == 0 || common.count(s)) both.insert(s);
    common = std::move(both);
  }
  if (common.empty()) lost = "no step has a snapshot that survives for every rank";
  return common.empty() ? -1 : *common.rbegin();
}

// Claims a live spare for each lost rank, in order; the claimed spares'
// launcher ranks, or fewer when not enough are alive (`why` says which not).
std::vector<int> claimSpares(Store& job, int generation, size_t needed, int size, int spares, double deadAfter,
                             std::string& why) {
  std::vector<int> claimed;
  PrefixStore beats(std::shared_ptr<Store>(&job, [](Store*) {}), kSparePrefix);
  std::vector<int> all;
  for (int spare = size; spare < size + spares; ++spare) all.push_back(spare);
  const auto silent = silentSeconds(beats, all, Deadline::afterSeconds(5));
  for (size_t i = 0; i < all.size() && claimed.size() < needed; ++i) {
    if (silent[i] > deadAfter) {
      why += fmt::format("; spare {} is silent ({:.1f} s)", all[i], silent[i]);
      continue;
    }
    const std::string mine = fmt::format("gen {}", generation);
    const std::string turn = job.compareSet(spareTurnKey(all[i]), "", mine, Deadline::afterSeconds(5));
    if (turn == mine)
      claimed.push_back(all[i]);
    else
      why += fmt::format("; spare {} is taken ({})", all[i], turn);
  }
  return claimed;
}

}  // namespace

Recovery::Recovery(Runtime& runtime, RecoveryOptions options)
    : runtime_(runtime),
      options_(options),
      process_(processId()),
      snapshots_({.stageOnDevice = options.stageOnDevice}) {
  if (options_.snapshotEvery < 1)
    throw ConfigError(fmt::format("a snapshot every {} steps: use 1 or more", options_.snapshotEvery),
                      {.rank = runtime.info().rank, .expected = "snapshotEvery >= 1"});
  if (enabled()) fatal::deferToRecovery(true);
}

Recovery::~Recovery() {
  if (enabled()) fatal::deferToRecovery(false);
}

namespace {

// Raised inside recover() for what no further generation can mend.
struct Final {
  std::exception_ptr error;
};

}  // namespace

Recovery::Plan Recovery::lead(int generation, int from, Deadline deadline) {
  auto& job = *runtime_.jobStore();
  const int size = runtime_.info().size, localSize = runtime_.info().localSize;
  const double deadAfter = MonitorOptions::fromEnvironment().deadAfterSeconds;
  std::vector<std::shared_ptr<Store>> beats;  // where members beat: any generation since the fault
  for (int g = from; g < generation; ++g) beats.push_back(generationStore(runtime_.jobStore(), g));
  const Deadline until = Deadline::at(deadline.when() - std::chrono::seconds(static_cast<int>(kLeaderMargin)));
  const std::map<int, GenerationArrival> arrived = gatherArrivals(job, generation, size, beats, deadAfter, until);
  Plan plan;
  std::vector<int> lost;
  for (int r = 0; r < size; ++r)
    if (!arrived.count(r)) lost.push_back(r);
  std::string why;
  plan.step = agreeStep(arrived, size, localSize, why);
  if (plan.step < 0) {
    plan.failure = fmt::format("recovery generation {} cannot go on: {}; restart the job from its last checkpoint",
                               generation, why);
    return plan;
  }
  const std::vector<int> spares = claimSpares(job, generation, lost.size(), size, runtime_.spares(), deadAfter, why);
  if (spares.size() < lost.size()) {
    plan.failure = fmt::format(
        "recovery generation {} cannot go on: rank{} {} lost and {} live spare{} left{}; "
        "restart the job from its last checkpoint",
        generation, lost.size() > 1 ? "s" : "", fmt::join(lost, ", "), spares.size(), spares.size() == 1 ? "" : "s",
        why);
    return plan;
  }
  plan.ok = true;
  plan.replaced = lost;
  plan.members.resize(size);
  for (int r = 0, next = 0; r < size; ++r) {
    auto it = arrived.find(r);
    const bool own = it != arrived.end() && std::count(it->second.own.begin(), it->second.own.end(), plan.step) > 0;
    plan.members[r].process = it != arrived.end() ? it->second.process : fmt::format("spare:{}", spares[next++]);
    plan.members[r].source = own ? -1 : holderOf(r, size, localSize);
  }
  return plan;
}

Recovered Recovery::joinGeneration(int generation, int from, Deadline deadline) {
  auto& job = *runtime_.jobStore();
  const auto began = Clock::now();
  snapshots_.settle(deadline.earliest(Deadline::afterSeconds(kSnapshotLandingSeconds)));  // only landed copies count
  const GenerationArrival me{runtime_.info().rank, process_, snapshots_.ownSteps(), snapshots_.wardSteps()};
  const int64_t slot = job.add(recoveryKey(generation, "arrivals"), 1, deadline);
  job.set(recoveryKey(generation, fmt::format("arrival/{}", slot)), encode(me), deadline);
  if (slot == 1) {  // the first to arrive leads
    const Plan plan = lead(generation, from, deadline);
    job.set(recoveryKey(generation, "plan"), plan.encode(), deadline);
    if (plan.ok) job.set(kLatestGeneration, std::to_string(generation), deadline);
    log::info("recovery", "generation {}: {}", generation,
              plan.ok ? fmt::format("resuming from step {}, rank(s) [{}] given to spares", plan.step,
                                    fmt::join(plan.replaced, ", "))
                      : plan.failure);
  }
  const Plan plan = Plan::decode(job.get(recoveryKey(generation, "plan"), deadline));
  if (!plan.ok)
    throw Final{std::make_exception_ptr(
        CommError(plan.failure, {.rank = me.rank, .group = "world", .expected = "a live process for every rank"}))};
  if (plan.rankOf(process_) < 0)
    throw Final{std::make_exception_ptr(CommError(
        fmt::format("this process, rank {} until generation {}, was replaced by a spare in generation {}: it did not "
                    "answer in time (stopped, or cut off); it exits, and the job goes on without it",
                    me.rank, from, generation),
        {.rank = me.rank, .group = "world", .expected = "to be part of the next generation"}))};
  return start(plan, generation, began, deadline);
}

void Recovery::snapshot(int64_t completedSteps, const NamedTensors& state) {
  if (!enabled()) return;
  snapshots_.take(runtime_.cpuWorld(), runtime_.info().localSize, completedSteps, state,
                  Deadline::afterSeconds(env::kCollectiveTimeout.seconds()), deviceWorld());
}

Communicator* Recovery::deviceWorld() const { return runtime_.device().is_cpu() ? nullptr : &runtime_.world(); }

void Recovery::afterStep(int64_t completedSteps, const NamedTensors& state) {
  if (due(completedSteps)) snapshot(completedSteps, state);
}

}  // namespace bulkhead::launch

namespace bulkhead::launch {

Recovered Recovery::start(const Plan& plan, int generation, std::chrono::steady_clock::time_point since,
                          Deadline deadline) {
  const int rank =
      plan.rankOf(plan.rankOf(process_) >= 0 ? process_ : fmt::format("spare:{}", runtime_.launcherRank()));
  runtime_.startGeneration(generation, rank, deadline);
  snapshots_.newWorld();
  plan_ = std::make_shared<Plan>(plan);
  return Recovered{
      .generation = generation, .step = plan.step, .replaced = plan.replaced, .seconds = secondsSince(since)};
}

Recovered Recovery::recover(const std::exception_ptr& cause) {
  std::string what;
  try {
    std::rethrow_exception(cause);
  } catch (const TimeoutError& e) {
    what = e.what();
  } catch (const DesyncError& e) {
    what = e.what();
  } catch (const CommError& e) {
    what = e.what();
  }  // anything else goes on to the caller as it is
  if (!enabled()) std::rethrow_exception(cause);
  const auto began = Clock::now();
  const int from = runtime_.generation();
  log::warn("recovery", "generation {} failed; recovering: {}", from, what);
  runtime_.abortGeneration("the job is recovering: " + what);
  std::exception_ptr last = cause;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    const int generation = std::max(attempted_, runtime_.generation()) + 1;
    attempted_ = generation;
    try {
      Recovered recovered = joinGeneration(generation, from, Deadline::afterSeconds(env::kInitTimeout.seconds()));
      recovered.seconds = secondsSince(began);
      fatal::recovered();
      log::info("recovery", "generation {} is up in {:.1f} s as rank {}: resuming from step {}", generation,
                recovered.seconds, runtime_.info().rank, recovered.step);
      return recovered;
    } catch (const Final& final) {
      last = final.error;
      break;
    } catch (const Error& e) {  // a rank lost during the recovery: the next generation leaves it out
      log::warn("recovery", "generation {} did not come up: {}", generation, e.what());
      runtime_.abortGeneration("the job is recovering again: " + std::string(e.what()));
      last = std::current_exception();
    }
  }
  fatal::giveUpRecovery();
  std::rethrow_exception(last);
}

std::optional<Recovered> Recovery::awaitTurn() {
  if (!runtime_.isSpare())
    throw ConfigError("awaitTurn() is for spares; this process has a rank",
                      {.rank = runtime_.info().rank, .expected = "a spare (Runtime::isSpare)"});
  auto& job = *runtime_.jobStore();
  const auto began = Clock::now();
  auto lastBeat = Clock::now();
  std::vector<int> ranks;
  for (int r = 0; r < runtime_.info().size; ++r) ranks.push_back(r);
  for (;;) {
    std::optional<std::string> turn;
    try {
      turn = job.get(spareTurnKey(runtime_.launcherRank()), Deadline::afterSeconds(2));
    } catch (const TimeoutError&) {
    }
    if (turn && *turn == kSpareDone) {
      log::info("recovery", "the job is over and needed no spare: this one ends");
      return std::nullopt;
    }
    if (turn) {
      const int generation = std::stoi(turn->substr(4));
      const auto since = Clock::now();
      const Deadline deadline = Deadline::afterSeconds(env::kInitTimeout.seconds());
      const Plan plan = Plan::decode(job.get(recoveryKey(generation, "plan"), deadline));
      if (!plan.ok)
        throw CommError(plan.failure, {.rank = runtime_.launcherRank(), .expected = "a recovery to take part in"});
      attempted_ = generation;
      try {
        Recovered recovered = start(plan, generation, since, deadline);
        log::info("recovery", "spare {} took rank {} in generation {} ({:.1f} s): resuming from step {}",
                  runtime_.launcherRank(), runtime_.info().rank, generation, recovered.seconds, recovered.step);
        return recovered;
      } catch (const Error&) {  // a rank lost while the generation came up: a member now, it recovers with the rest
        return recover(std::current_exception());
      }
    }
    // No turn yet: the job still lives while any rank of its latest generation beats.
    const int latest = static_cast<int>(
        parseStoreInteger(job.tryGet(kLatestGeneration, Deadline::afterSeconds(5)).value_or("0")).value_or(0));
    for (int g = std::max(0, latest - 1); g <= latest; ++g) {
      const auto silent = silentSeconds(*generationStore(runtime_.jobStore(), g), ranks, Deadline::afterSeconds(5));
      if (*std::min_element(silent.begin(), silent.end()) < kJobSilentSeconds) lastBeat = Clock::now();
    }
    if (secondsSince(lastBeat) > kJobSilentSeconds && secondsSince(began) > env::kInitTimeout.seconds()) {
      log::warn("recovery", "no rank of the job has beaten for {:.0f} s: it ended without needing this spare",
                secondsSince(lastBeat));
      return std::nullopt;
    }
  }
}

void Recovery::restore(const NamedTensors& state) {
  if (!plan_)
    throw ConfigError("restore() comes after recover() or awaitTurn() returned",
                      {.rank = runtime_.info().rank, .expected = "a recovery to restore"});
  const Plan& plan = *plan_;
  Communicator& world = runtime_.cpuWorld();
  const int rank = world.rank();
  const Deadline deadline = Deadline::afterSeconds(env::kCollectiveTimeout.seconds());
  std::vector<PeerOp> ops;
  at::Tensor incoming;
  if (plan.members[rank].source < 0) {
    Snapshots::unpack(snapshots_.own(plan.step), state, rank);
  } else {
    incoming = at::empty({packedLayout(state).bytes}, at::kByte);
    ops.push_back({.kind = PeerOp::Kind::Recv,
                   .tensor = incoming,
                   .peer = plan.members[rank].source,
                   .label = fmt::format("rank {}'s snapshot of step {}", rank, plan.step)});
  }
  for (int q = 0; q < world.size(); ++q) {
    if (plan.members[q].source != rank) continue;
    at::Tensor copy = snapshots_.ward(plan.step);
    if (!copy.defined())
      throw CommError(
          fmt::format("rank {} holds no copy of rank {}'s step {}, which the plan says it sends", rank, q, plan.step),
          {.rank = rank, .group = "world", .expected = "the ward's snapshot of the agreed step"});
    ops.push_back({.kind = PeerOp::Kind::Send,
                   .tensor = copy,
                   .peer = q,
                   .label = fmt::format("rank {}'s snapshot of step {}", q, plan.step)});
  }
  world.sendRecv(std::move(ops), {.deadline = deadline})->wait();
  if (incoming.defined()) Snapshots::unpack(incoming, state, rank);
  snapshots_.forgetAfter(plan.step);
  snapshots_.take(world, runtime_.info().localSize, plan.step, state, deadline, deviceWorld());
  plan_.reset();
}

}  // namespace bulkhead::launch
