// Bootstrap stall program (groups_bootstrap_stall_test.sh): every rank builds
// the process groups of tp2 ep2 on 4 ranks under a deadline passed to the
// manager, while BULKHEAD_FAULT delays one rank's split.
//
//   groups_bootstrap_stall probe <k>                 rank 0 prints "seq S group G": S is the world
//                                                   sequence number of the manager's k-th split
//   groups_bootstrap_stall run <k> <ms> <out-dir>    builds the groups with a <ms> deadline; each
//                                                   rank writes <out-dir>/rank_<r>.txt: the seconds
//                                                   create took, the name of the group it was
//                                                   creating at split k, the error's type and message
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "launch/init.h"
#include "parallel/process_groups.h"
#include "runtime/errors.h"

using namespace bulkhead;
using namespace bulkhead::parallel;

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "";
  if (!((mode == "probe" && argc == 3) || (mode == "run" && argc == 5))) {
    std::fprintf(stderr, "usage: %s probe <k> | run <k> <deadline-ms> <out-dir>\n", argv[0]);
    return 2;
  }
  size_t k = std::strtoul(argv[2], nullptr, 10);
  auto runtime = init({.backend = Backend::Mpi});
  int me = runtime->world().rank();
  Layout layout = Layout::create(runtime->world().size(), {.tp = 2, .ep = 2});
  GroupKind kind = allGroupKinds().at(k);
  std::string group = fmt::format("{}[{}]", toString(kind), layout.groupIndex(kind, me));
  // The manager splits the world once per kind, in allGroupKinds() order.
  uint64_t seq = runtime->world().ledger().heads().lastIssued + 1 + k;
  if (mode == "probe") {
    if (me == 0) std::printf("seq %llu group %s\n", static_cast<unsigned long long>(seq), toString(kind));
    runtime->shutdown();
    return 0;
  }
  auto deadline = Deadline::after(std::chrono::milliseconds(std::atoi(argv[3])));
  auto start = std::chrono::steady_clock::now();
  std::string outcome = "no error";
  int exitCode = 0;
  try {
    ProcessGroups::create(runtime->worldPtr(), layout, {.deadline = deadline});
  } catch (const Error& e) {
    outcome = fmt::format("{} {}", e.kind(), e.what());
    exitCode = e.exitCode();
  }
  double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::FILE* file = std::fopen(fmt::format("{}/rank_{}.txt", argv[4], me).c_str(), "w");
  std::fprintf(file, "%.3f %s %s\n", took, group.c_str(), outcome.c_str());
  std::fclose(file);
  return exitCode;  // as guardedMain would end the job
}
