// Fault test program: one rank skips a collective (it stalls instead of issuing
// it); every other rank must get a TimeoutError within the deadline plus 1 s,
// and the job must exit non-zero instead of hanging.
//
//   skip_collective <skip-rank> <world|split> <all_reduce|all_to_all|barrier> <deadline-ms> <out-dir>
//
// Each rank that raised writes <out-dir>/rank_<r>.txt with the seconds it
// waited, the sequence number the skipped collective had, the error's type and
// its message; the driver script checks them.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "launch/init.h"
#include "runtime/errors.h"

using namespace bulkhead;

int main(int argc, char** argv) {
  if (argc != 6) {
    std::fprintf(stderr, "usage: %s <skip-rank> <world|split> <op> <deadline-ms> <out-dir>\n", argv[0]);
    return 2;
  }
  int skipRank = std::stoi(argv[1]);
  std::string groupKind = argv[2], op = argv[3], outDir = argv[5];
  auto deadline = std::chrono::milliseconds(std::stoi(argv[4]));

  auto runtime = init({.backend = Backend::Mpi});
  Communicator& world = runtime->world();
  int me = world.rank(), n = world.size();
  CommunicatorPtr group = groupKind == "split" ? world.split(me % 2, me, "half") : runtime->worldPtr();
  bool inSkippersGroup = groupKind == "world" || me % 2 == skipRank % 2;

  auto issue = [&](Deadline until) {
    if (op == "all_reduce") {
      at::Tensor t = at::randn({4096});
      group->allReduce(t, {.deadline = until})->wait();
    } else if (op == "all_to_all") {
      int size = group->size();
      at::Tensor send = at::randn({3 * size, 8}), recv = at::empty({3 * size, 8});
      group->allToAll(send, recv, {}, {}, {.deadline = until})->wait();
    } else {
      group->barrier({.deadline = until})->wait();
    }
  };
  for (int i = 0; i < 5; ++i) issue(Deadline::after(std::chrono::seconds(30)));  // seq 1..5 succeed everywhere

  if (me == skipRank) {
    // Stalls instead of issuing seq 6; the launcher ends it once a peer exits.
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  if (!inSkippersGroup) {
    // Ranks of the other half finish their own work; shutdown's final barrier
    // then waits for the stalled rank and exits non-zero too.
    issue(Deadline::after(std::chrono::seconds(30)));
    return 0;
  }
  uint64_t expectedSeq = group->ledger().heads().lastIssued + 1;
  auto start = std::chrono::steady_clock::now();
  std::string outcome = "no error";
  try {
    issue(Deadline::after(deadline));
  } catch (const TimeoutError& e) {
    outcome = fmt::format("TimeoutError seq={} {}", e.sequence(), e.what());
  } catch (const Error& e) {
    outcome = fmt::format("{} {}", e.kind(), e.what());
  }
  double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::FILE* file = std::fopen(fmt::format("{}/rank_{}.txt", outDir, me).c_str(), "w");
  std::fprintf(file, "%.3f %llu %s\n", waited, static_cast<unsigned long long>(expectedSeq), outcome.c_str());
  std::fclose(file);
  // The Runtime's shutdown sees the abandoned MPI operation and exits with 3.
  (void)n;
  return 0;
}
