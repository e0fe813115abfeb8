// bulkhead-doctor: builds every process group of a layout with the manager
// (parallel/process_groups.h), then checks each group: a timed all-reduce
// (all-to-all on ep) on seeded data compared against a reference each rank
// computes alone, and its algorithm bandwidth (slowest rank of the group).
// Pipeline groups are checked with a message to the next stage and one back
// (send/recv). Rank 0 prints one table. Exit 0 when every group works and
// none is far slower than its peers; otherwise a diagnosis and a non-zero exit (the
// error's code from guardedMain when a group fails, 1 for a wrong result or a
// slow group).
//
//   mpirun -np 8 bulkhead-doctor --tp 2 --ep 2 [--pp 1 --cp 1 --etp 1 --order tp-cp-ep-dp-pp
//                                 --backend auto|mpi|gloo|nccl --bytes 4M --iters 10 --deadline 30]

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "launch/cli.h"
#include "launch/init.h"
#include "parallel/process_groups.h"
#include "runtime/errors.h"

using namespace bulkhead;
using namespace bulkhead::parallel;

namespace {

// A group this far under the median bandwidth of its kind's groups is reported.
constexpr double kSlowFraction = 0.25;
// Groups listed per kind; the rest are summarised in one line.
constexpr size_t kRowsPerKind = 16;

struct Options {
  LayoutOptions layout;
  std::optional<Backend> backend;  // unset: BULKHEAD_BACKEND
  int64_t bytes = 4 << 20;
  int iterations = 10;
  double deadlineSeconds = 30;
};

void addFlags(CLI::App& app, Options& options) {
  cli::addLayout(app, options.layout);
  cli::addBackend(app, options.backend);
  cli::addBytes(app, "--bytes", options.bytes, "bytes per rank of each group's timed check");
  app.add_option("--iters", options.iterations, "timed iterations per group")->check(cli::positive());
  app.add_option("--deadline", options.deadlineSeconds, "seconds for init, building the groups and each check")
      ->check(cli::positive());
}

// World rank r's input for the check of one kind: small integers, so sums are
// exact in fp32 and every rank can compute any member's input.
at::Tensor input(int worldRank, int64_t numel, GroupKind kind) {
  auto generator = at::detail::createCPUGenerator(1000003ULL * (worldRank + 1) + 7919ULL * static_cast<int>(kind));
  return at::randint(-8, 8, {numel}, generator, at::kFloat);
}

// What one rank measured on its group of one kind.
struct Measured {
  double medianMs = 0;  // median time of one operation over the iterations
  bool ok = true;       // the checked result equals the reference
};

// The operation that checks and times a group of `kind`.
const char* checkName(GroupKind kind) {
  return kind == GroupKind::Ep ? "all_to_all" : kind == GroupKind::Pp ? "send/recv" : "all_reduce";
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// Pipeline neighbours: a message to the next stage and one back to the
// previous (the pipeline's forward and backward traffic), each phase posting
// its send and receive together; the forward message is checked against what
// the previous stage sent. On NCCL, where sends and receives are not grouped,
// the hops of one phase run one after another down the chain.
Measured measureNeighbours(Communicator& comm, int64_t numel, int iterations, Deadline deadline) {
  const int n = comm.size(), me = comm.rank();
  const std::vector<int>& members = comm.members();
  at::Tensor out = input(members[me], numel, GroupKind::Pp).to(comm.device());
  at::Tensor in = at::zeros_like(out);
  auto exchange = [&] {
    bool ok = true;  // both phases run whatever arrives, so no neighbour waits for a message that never comes
    for (int direction : {+1, -1}) {
      const int to = me + direction, from = me - direction;
      std::vector<WorkPtr> works;
      const std::string label = direction > 0 ? "doctor forward" : "doctor backward";
      if (to >= 0 && to < n) works.push_back(comm.send(out, to, {.deadline = deadline, .label = label}));
      if (from >= 0 && from < n) works.push_back(comm.recv(in, from, {.deadline = deadline, .label = label}));
      for (auto& work : works) work->wait(deadline);
      if (direction > 0 && me > 0) ok = ok && at::equal(in.cpu(), input(members[me - 1], numel, GroupKind::Pp));
    }
    return ok;
  };
  Measured result;
  result.ok = exchange();
  std::vector<double> times;
  for (int i = 0; i < iterations; ++i) {
    auto start = std::chrono::steady_clock::now();
    exchange();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  result.medianMs = median(std::move(times));
  return result;
}

// All-reduce (all-to-all on ep, send/recv between pipeline neighbours) of
// `bytes` per rank: one checked run, then `iterations` timed ones, all under
// `deadline`.
Measured measure(Communicator& comm, GroupKind kind, int64_t bytes, int iterations, Deadline deadline) {
  int n = comm.size(), me = comm.rank();
  if (kind == GroupKind::Pp && n > 1)
    return measureNeighbours(comm, std::max<int64_t>(n, bytes / 4 / n * n), iterations, deadline);
  const std::vector<int>& members = comm.members();
  at::Tensor sent = input(members[me], std::max<int64_t>(n, bytes / 4 / n * n), kind);
  int64_t numel = sent.numel(), chunk = numel / n;
  // A copy even on the CPU: the all-reduce works in place and `sent` restores it.
  at::Tensor work = sent.clone().to(comm.device()), received = at::empty_like(work);
  auto run = [&] {
    if (kind == GroupKind::Ep)
      comm.allToAll(work.view({n, chunk}), received.view({n, chunk}), {}, {}, {.deadline = deadline})->wait(deadline);
    else
      comm.allReduce(work, {.deadline = deadline})->wait(deadline);
  };
  Measured result;
  run();
  at::Tensor reference;
  if (kind == GroupKind::Ep) {  // chunk `me` of every member's input, in member order
    std::vector<at::Tensor> parts;
    for (int member : members) parts.push_back(input(member, numel, kind).slice(0, me * chunk, (me + 1) * chunk));
    reference = at::cat(parts);
    result.ok = at::equal(received.cpu(), reference);
  } else {
    reference = at::zeros({numel});
    for (int member : members) reference += input(member, numel, kind);
    result.ok = at::equal(work.cpu(), reference);
  }
  std::vector<double> times;
  for (int i = 0; i < iterations; ++i) {
    if (kind != GroupKind::Ep) work.copy_(sent);  // keep the values small: the sums stay exact and finite
    auto start = std::chrono::steady_clock::now();
    run();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  result.medianMs = median(std::move(times));
  return result;
}

// One group of one kind, as rank 0 prints it (the slowest member's numbers).
struct Row {
  std::string name;
  int size = 0;
  double createMs = 0, warmMs = 0, opMs = 0;
  bool ok = true;
  double gbps() const { return opMs > 0 ? bytes / (opMs * 1e6) : 0; }
  int64_t bytes = 0;
  const char* check = "all_reduce";
};

// The process groups of the layout, or a DIAGNOSIS on stderr and the error.
ProcessGroups buildGroups(Runtime& runtime, const Layout& layout, const Options& options) {
  try {
    return ProcessGroups::create(runtime.worldPtr(), layout,
                                 {.deadline = Deadline::afterSeconds(options.deadlineSeconds),
                                  .warmupBytes = std::min<int64_t>(options.bytes, 1 << 20),
                                  .localSize = runtime.info().localSize});
  } catch (const Error& e) {
    fmt::print(stderr, "bulkhead-doctor: DIAGNOSIS (rank {}): building the process groups failed.\n  {}\n  {}\n",
               runtime.world().rank(), e.what(),
               "Fix the rank(s) named above (a stalled or crashed process, a slow or broken link), then run the "
               "doctor again; the same layout must be passed to every rank.");
    std::fflush(stderr);
    throw;
  }
}

// Every group of `kind` checked; one row per group with its slowest member's
// figures (one world all-reduce), and a problem for each wrong result.
std::vector<Row> checkKind(Runtime& runtime, ProcessGroups& groups, const Layout& layout, GroupKind kind,
                           const Options& options, std::vector<std::string>& problems) {
  const CommunicatorPtr& comm = groups.get(kind);
  const int me = runtime.world().rank();
  const size_t count = layout.groups(kind).size();
  // Per group of the kind: create ms, warm ms, op ms, wrong.
  at::Tensor stats = at::zeros({static_cast<int64_t>(4 * count)}, at::kDouble);
  if (int index = layout.groupIndex(kind, me); index >= 0) {
    const GroupReport& mine = groups.report()[static_cast<size_t>(kind)];
    Measured measured;
    if (comm->size() > 1) {
      try {
        measured =
            measure(*comm, kind, options.bytes, options.iterations, Deadline::afterSeconds(options.deadlineSeconds));
      } catch (const Error& e) {
        fmt::print(stderr, "bulkhead-doctor: DIAGNOSIS (rank {}): group {} failed its check.\n  {}\n", me, comm->name(),
                   e.what());
        std::fflush(stderr);
        throw;
      }
    }
    double* s = stats.data_ptr<double>() + 4 * index;
    s[0] = mine.createMs;
    s[1] = mine.warmMs;
    s[2] = measured.medianMs;
    s[3] = measured.ok ? 0 : 1;
  }
  runtime.cpuWorld()
      .allReduce(stats, {.op = ReduceOp::Max, .deadline = Deadline::afterSeconds(options.deadlineSeconds)})
      ->wait();
  std::vector<Row> ofKind;
  for (size_t g = 0; g < count; ++g) {
    const double* s = stats.data_ptr<double>() + 4 * g;
    Row row{.name = fmt::format("{}[{}]", toString(kind), g),
            .size = static_cast<int>(layout.groups(kind)[g].size()),
            .createMs = s[0],
            .warmMs = s[1],
            .opMs = s[2],
            .ok = s[3] == 0};
    row.bytes = row.size > 1 ? std::max<int64_t>(row.size, options.bytes / 4 / row.size * row.size) * 4 : 0;
    if (kind == GroupKind::Pp) row.bytes *= 2;  // a message forward and one backward
    row.check = checkName(kind);
    if (!row.ok)
      problems.push_back(fmt::format("{} (ranks {}) returned a WRONG {} result: check its links and GPUs", row.name,
                                     fmt::join(layout.groups(kind)[g], ","), checkName(kind)));
    ofKind.push_back(row);
  }
  return ofKind;
}

// Same kind means same size and same traffic: a group under kSlowFraction of
// its kind's median bandwidth is a problem.
void flagSlow(const Layout& layout, GroupKind kind, const std::vector<Row>& ofKind,
              std::vector<std::string>& problems) {
  std::vector<double> speeds;
  for (const Row& row : ofKind)
    if (row.size > 1) speeds.push_back(row.gbps());
  if (speeds.size() < 2) return;
  const double typical = median(speeds);
  for (size_t g = 0; g < ofKind.size(); ++g) {
    const Row& row = ofKind[g];
    if (row.size > 1 && row.gbps() < kSlowFraction * typical)
      problems.push_back(fmt::format(
          "{} (ranks {}) is SLOW: {:.3f} GB/s, under {:.0f}% of the median {:.3f} GB/s of the {} {} groups; "
          "look for a degraded link, a busy or throttled GPU, or a rank placed on another node",
          row.name, fmt::join(layout.groups(kind)[g], ","), row.gbps(), kSlowFraction * 100, typical, speeds.size(),
          toString(kind)));
  }
}

// The first kRowsPerKind rows of a kind as they are, the rest folded into one
// row with the worst of each figure.
void appendFolded(const std::vector<Row>& ofKind, GroupKind kind, std::vector<Row>& rows) {
  for (size_t g = 0; g < ofKind.size() && g < kRowsPerKind; ++g) rows.push_back(ofKind[g]);
  if (ofKind.size() <= kRowsPerKind) return;
  const size_t g = kRowsPerKind;
  Row rest{.name = fmt::format("{}[{}..{}]", toString(kind), g, ofKind.size() - 1), .size = ofKind[g].size};
  for (size_t h = g; h < ofKind.size(); ++h) {
    rest.createMs = std::max(rest.createMs, ofKind[h].createMs);
    rest.warmMs = std::max(rest.warmMs, ofKind[h].warmMs);
    rest.opMs = std::max(rest.opMs, ofKind[h].opMs);
    rest.ok = rest.ok && ofKind[h].ok;
  }
  rest.bytes = ofKind[g].bytes;
  rest.check = ofKind[g].check;
  rows.push_back(rest);
}

void printReport(const std::vector<Row>& rows, const std::vector<std::string>& problems) {
  fmt::print("{:<22} {:>5} {:>10} {:>10} {:>11} {:>6} {:>10}\n", "group", "size", "create ms", "warm ms", "check", "ok",
             "GB/s");
  for (const Row& row : rows) {
    const bool traffic = row.size > 1;
    fmt::print("{:<22} {:>5} {:>10.2f} {:>10.2f} {:>11} {:>6} {:>10}\n", row.name, row.size, row.createMs, row.warmMs,
               !traffic ? "-" : row.check,
               !traffic ? "-"
               : row.ok ? "ok"
                        : "WRONG",
               traffic ? fmt::format("{:.3f}", row.gbps()) : "-");
  }
  if (problems.empty()) {
    fmt::print("all {} groups built and correct; none under {:.0f}% of the median bandwidth of its kind\n", rows.size(),
               kSlowFraction * 100);
  } else {
    fmt::print("bulkhead-doctor: DIAGNOSIS: {} problem{}:\n", problems.size(), problems.size() > 1 ? "s" : "");
    for (const std::string& problem : problems) fmt::print("  {}\n", problem);
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app(
      "Builds every process group of a layout and checks each: a result against a reference, and its "
      "bandwidth. Run it with the job's launcher and rank count.",
      "bulkhead-doctor");
  Options options;
  addFlags(app, options);
  if (auto code = cli::parse(app, argc, argv)) return *code;
  return guardedMain([&] {
    auto runtime = init({.backend = options.backend, .deadline = Deadline::afterSeconds(options.deadlineSeconds)});
    Communicator& world = runtime->world();
    const int me = world.rank();
    const Layout layout = Layout::create(world.size(), options.layout);
    const uint64_t firstSplit = world.ledger().heads().lastIssued + 1;
    if (me == 0) {
      fmt::print("bulkhead-doctor: {} ranks, backend {}, {} bytes per rank, {} iterations\n{}\n", world.size(),
                 world.backend(), options.bytes, options.iterations, layout.describe());
      fmt::print("creating {} groups: splits of world at seq {}..{}\n", allGroupKinds().size(), firstSplit,
                 firstSplit + allGroupKinds().size() - 1);
      std::fflush(stdout);
    }
    ProcessGroups groups = buildGroups(*runtime, layout, options);
    std::vector<Row> rows;
    std::vector<std::string> problems;
    for (GroupKind kind : allGroupKinds()) {
      const std::vector<Row> ofKind = checkKind(*runtime, groups, layout, kind, options, problems);
      flagSlow(layout, kind, ofKind, problems);
      appendFolded(ofKind, kind, rows);
    }
    if (me == 0) printReport(rows, problems);
    runtime->shutdown();
    return problems.empty() ? 0 : 1;
  });
}
