// Fault test program: a checked region in which one rank issues another
// sequence of collectives than the others. Every rank must raise DesyncError
// at the region's end, before waiting on anything it issued inside it, naming
// the position and both sides.
//
//   checked_region_fault <mismatch-op|mismatch-size|skip|extra|splits> <odd-rank> <out-dir>
//
// mismatch-op, mismatch-size and skip come from BULKHEAD_FAULT (set by the
// driver for seq 6 of the world on <odd-rank>); extra: <odd-rank> issues one
// all-reduce more at the end of the region; splits: <odd-rank>'s all-to-all
// (seq 7) sends and expects 9 rows a rank where the others send and expect 8
// (rows of the same width: only the splits differ, as with another capacity). Each rank writes
// <out-dir>/rank_<r>.txt: the seconds end() took, then the error's kind and
// message.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "launch/init.h"
#include "runtime/diagnosis/checked_region.h"
#include "runtime/errors.h"

using namespace bulkhead;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <mismatch-op|mismatch-size|skip|extra|splits> <odd-rank> <out-dir>\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1], outDir = argv[3];
  const int odd = std::stoi(argv[2]);
  return guardedMain([&] {
    const char* named = std::getenv("BULKHEAD_BACKEND");  // mpi unless it names gloo
    auto runtime = init({.backend = named && *named ? parseBackend(named) : Backend::Mpi});
    Communicator& world = runtime->world();
    const int me = world.rank(), n = world.size();
    at::manual_seed(1000 + me);
    // Up to seq 3 outside the region (init may have issued some already).
    while (world.ledger().heads().lastIssued < 3) world.allReduce(at::randn({64}))->wait();

    std::vector<WorkPtr> pending;  // issued inside the region, waited on only after its end
    CheckedRegion region(runtime->store(), {runtime->worldPtr()},
                         {.name = "step", .deadline = Deadline::afterSeconds(20)});
    pending.push_back(world.allReduce(at::randn({4096})));                       // seq 4
    pending.push_back(world.allGather(at::randn({256}), at::empty({256 * n})));  // seq 5
    pending.push_back(world.allReduce(at::randn({1024})));                       // seq 6: the fault
    const int64_t rows = mode == "splits" && me == odd ? 9 : 8;
    pending.push_back(world.allToAll(at::randn({rows * n, 16}), at::empty({rows * n, 16}), {}, {}));  // seq 7
    pending.push_back(world.allReduce(at::randn({32})));                                              // seq 8
    if (mode == "extra" && me == odd) pending.push_back(world.allReduce(at::randn({32})));

    const auto start = std::chrono::steady_clock::now();
    std::string outcome = "no error";
    try {
      region.end();
    } catch (const Error& e) {
      outcome = fmt::format("{} {}", e.kind(), e.message());
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::FILE* file = std::fopen(fmt::format("{}/rank_{}.txt", outDir, me).c_str(), "w");
    if (!file) throw IoError(fmt::format("cannot write {}/rank_{}.txt", outDir, me));
    std::fprintf(file, "%.3f %s\n", took, outcome.c_str());
    std::fclose(file);
    // The collectives issued inside the region cannot all complete now: the
    // job ends as a training job would, aborting its communicators.
    world.abort("checked region failed");
    return 4;
  });
}
