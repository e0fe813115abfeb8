// bulkhead-collectives: builds the world communicator, runs every operation on
// seeded random data, checks each result against a reference computed locally,
// and prints what ran and how long it took (slowest rank) on rank 0.
//
//   mpirun -np 4 --oversubscribe bulkhead-collectives [--iters N] [--sizes 4K,256K,4M]

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "launch/cli.h"
#include "launch/init.h"
#include "runtime/errors.h"

using namespace bulkhead;

namespace {

struct Options {
  std::optional<Backend> backend;  // a CPU backend; unset: mpi under an MPI launcher, else gloo
  int iterations = 10;
  std::vector<int64_t> bytes = {4 << 10, 256 << 10, 4 << 20};
};

void addFlags(CLI::App& app, Options& options) {
  app.add_option_function<std::string>(
         "--backend", [&options](const std::string& name) { options.backend = parseBackend(name); },
         "CPU backend: mpi or gloo (default: mpi when an MPI launcher started the job, else gloo)")
      ->check(CLI::IsMember({"mpi", "gloo"}));
  app.add_option("--iters", options.iterations, "timed iterations of each operation")->check(cli::positive());
  app.add_option_function<std::vector<std::string>>(
         "--sizes",
         [&options](const std::vector<std::string>& sizes) {
           options.bytes.clear();
           for (const auto& size : sizes) options.bytes.push_back(cli::parseBytes("--sizes", size, 0));
         },
         "bytes per rank of each operation, comma-separated (0 allowed)")
      ->delimiter(',')
      ->type_name("SIZE,...")
      ->default_str("4K,256K,4M");
}

// Rank r's input for one test: small integers, so sums are exact in fp32.
at::Tensor input(int rank, int64_t numel, int salt) {
  auto generator = at::detail::createCPUGenerator(1000003 * (rank + 1) + salt);
  return at::randint(-8, 8, {numel}, generator, at::kFloat);
}

// One operation at one size: `op` runs it on prepared tensors (what is timed);
// `check` resets the inputs, runs it once more and compares with a reference.
struct Case {
  std::string name;
  std::function<void()> op;
  std::function<bool()> check;
};

struct Row {
  std::string name;
  int64_t bytes;
  double meanMs, slowestMs;
  bool ok;
};

std::vector<Case> cases(Communicator& world, int64_t numel) {
  int n = world.size(), me = world.rank();
  std::vector<Case> all;
  auto sumOf = [n](int64_t count, int salt) {
    at::Tensor sum = at::zeros({count});
    for (int r = 0; r < n; ++r) sum += input(r, count, salt);
    return sum;
  };

  at::Tensor reduced = input(me, numel, 1);
  all.push_back({"all_reduce sum", [&world, reduced] { world.allReduce(reduced)->wait(); },
                 [&world, reduced, me, numel, sumOf]() mutable {
                   reduced.copy_(input(me, numel, 1));
                   world.allReduce(reduced)->wait();
                   return at::equal(reduced, sumOf(numel, 1));
                 }});

  at::Tensor gatherIn = input(me, numel, 2), gathered = at::empty({n * numel});
  auto gather = [&world, gatherIn, gathered] { world.allGather(gatherIn, gathered)->wait(); };
  all.push_back({"all_gather", gather, [gather, gathered, n, numel] {
                   gather();
                   std::vector<at::Tensor> parts;
                   for (int r = 0; r < n; ++r) parts.push_back(input(r, numel, 2));
                   return at::equal(gathered, at::cat(parts));
                 }});

  int64_t chunk = std::max<int64_t>(1, numel / n);
  at::Tensor scatterIn = input(me, chunk * n, 3), scattered = at::empty({chunk});
  auto scatter = [&world, scatterIn, scattered] { world.reduceScatter(scatterIn, scattered)->wait(); };
  all.push_back({"reduce_scatter sum", scatter, [scatter, scattered, sumOf, chunk, n, me] {
                   scatter();
                   return at::equal(scattered, sumOf(chunk * n, 3).slice(0, me * chunk, (me + 1) * chunk));
                 }});

  // Rank s sends (s + d) % n + 1 units of rows to rank d: every pair differs.
  int64_t unit = std::max<int64_t>(1, numel / (n * n));
  auto rows = [n, unit](int s, int d) { return ((s + d) % n + 1) * unit; };
  std::vector<int64_t> sendSplits, recvSplits;
  for (int r = 0; r < n; ++r) {
    sendSplits.push_back(rows(me, r));
    recvSplits.push_back(rows(r, me));
  }
  auto total = [](const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t{0}); };
  at::Tensor sendBuf = input(me, total(sendSplits), 4), recvBuf = at::empty({total(recvSplits)});
  auto exchange = [&world, sendBuf, recvBuf, sendSplits, recvSplits] {
    world.allToAll(sendBuf, recvBuf, sendSplits, recvSplits)->wait();
  };
  all.push_back({"all_to_all uneven", exchange, [exchange, recvBuf, rows, n, me] {
                   exchange();
                   std::vector<at::Tensor> parts;
                   for (int s = 0; s < n; ++s) {
                     int64_t offset = 0, sent = 0;
                     for (int d = 0; d < n; ++d) sent += rows(s, d);
                     for (int d = 0; d < me; ++d) offset += rows(s, d);
                     parts.push_back(input(s, sent, 4).slice(0, offset, offset + rows(s, me)));
                   }
                   return at::equal(recvBuf, at::cat(parts));
                 }});

  int root = n - 1;
  at::Tensor shared = me == root ? input(root, numel, 5) : at::empty({numel});
  auto cast = [&world, shared, root] { world.broadcast(shared, root)->wait(); };
  all.push_back({"broadcast", cast, [cast, shared, root, numel] {
                   cast();
                   return at::equal(shared, input(root, numel, 5));
                 }});

  int next = (me + 1) % n, prev = (me + n - 1) % n;
  at::Tensor outgoing = input(me, numel, 6), incoming = at::empty({numel});
  auto ring = [&world, outgoing, incoming, next, prev] {
    auto sent = world.send(outgoing, next);
    auto received = world.recv(incoming, prev);
    sent->wait();
    received->wait();
  };
  all.push_back({"send/recv ring", ring, [ring, incoming, prev, numel] {
                   ring();
                   return at::equal(incoming, input(prev, numel, 6));
                 }});
  return all;
}

Row measure(Communicator& world, const Case& c, int64_t bytes, int iterations) {
  c.op();  // warm-up
  auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) c.op();
  double mean =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() / iterations;
  bool ok = c.check();
  at::Tensor stats = at::tensor({mean, ok ? 0.0 : 1.0}, at::kDouble);
  world.allReduce(stats, {.op = ReduceOp::Max})->wait();
  return {c.name, bytes, mean, stats[0].item<double>(), stats[1].item<double>() == 0.0};
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app(
      "Runs every collective on seeded data over the world (a CPU backend), checks each result against a "
      "reference and prints what it took.",
      "bulkhead-collectives");
  Options options;
  addFlags(app, options);
  if (auto code = cli::parse(app, argc, argv)) return *code;
  return guardedMain([&] {
    Backend backend = options.backend.value_or(
        launch::resolveBootstrap(launch::findWorld()) == launch::Bootstrap::Mpi ? Backend::Mpi : Backend::Gloo);
    auto runtime = init({.backend = backend});
    Communicator& world = runtime->world();
    std::vector<Row> rows;
    for (int64_t bytes : options.bytes) {
      int64_t numel = std::max<int64_t>(1, bytes / 4);
      for (const Case& c : cases(world, numel)) rows.push_back(measure(world, c, bytes, options.iterations));
    }
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < options.iterations; ++i) world.barrier()->wait();
    double barrierMs = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
                       options.iterations;

    // Split into even and odd ranks and all-reduce within each half.
    auto half = world.split(world.rank() % 2, world.rank(), "parity");
    at::Tensor mine = at::full({4}, world.rank() + 1.0);
    half->allReduce(mine)->wait();
    double expected = 0;
    for (int r = world.rank() % 2; r < world.size(); r += 2) expected += r + 1.0;
    at::Tensor splitOk = at::tensor({at::equal(mine, at::full({4}, expected)) ? 0.0 : 1.0}, at::kDouble);
    world.allReduce(splitOk, {.op = ReduceOp::Max})->wait();

    bool allOk = splitOk.item<double>() == 0.0;
    if (world.rank() == 0) {
      fmt::print("Bulkhead collectives: {} ranks, backend {}, {} iterations each, fp32\n", world.size(),
                 world.backend(), options.iterations);
      fmt::print("{:<20} {:>12} {:>12} {:>14} {:>10} {:>6}\n", "operation", "bytes/rank", "mean ms", "slowest ms",
                 "GB/s", "check");
      for (const Row& row : rows) {
        fmt::print("{:<20} {:>12} {:>12.3f} {:>14.3f} {:>10.3f} {:>6}\n", row.name, row.bytes, row.meanMs,
                   row.slowestMs, row.bytes / (row.slowestMs * 1e6), row.ok ? "ok" : "WRONG");
        allOk = allOk && row.ok;
      }
      fmt::print("{:<20} {:>12} {:>12.3f} {:>14} {:>10} {:>6}\n", "barrier", 0, barrierMs, "", "", "ok");
      fmt::print("{:<20} {:>12} {:>12} {:>14} {:>10} {:>6}\n", "split(parity)", "", "", "", "",
                 splitOk.item<double>() == 0.0 ? "ok" : "WRONG");
      fmt::print("{}\n", allOk ? "all results correct" : "SOME RESULTS WERE WRONG");
    }
    for (const Row& row : rows) allOk = allOk && row.ok;
    return allOk ? 0 : 1;
  });
}
