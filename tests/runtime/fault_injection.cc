// Fault injection program (see runtime/diagnosis/fault.h). Every rank runs a fixed
// sequence of collectives on the group "all[0]" (every rank, a fresh ledger),
// each under a 2 s deadline, with BULKHEAD_FAULT naming one rank and sequence
// number. Each rank writes <out-dir>/rank_<r>.txt: the seconds its failing
// call took, the error's type and message ("no error" when none).
//
//   fault_injection <out-dir> [mpi|nccl]
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
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s <out-dir> [mpi|nccl]\n", argv[0]);
    return 2;
  }
  std::string outDir = argv[1];
  auto runtime = init({.backend = argc == 3 ? parseBackend(argv[2]) : Backend::Mpi});
  auto on = at::TensorOptions().device(runtime->device());
  int me = runtime->world().rank();
  auto group = runtime->world().split(0, me, "all");
  int n = group->size();
  std::string outcome = "no error";
  double waited = 0;
  int exitCode = 0;
  for (int call = 1; call <= 8; ++call) {
    auto deadline = Deadline::after(std::chrono::seconds(2));
    auto start = std::chrono::steady_clock::now();
    try {
      WorkPtr work;
      at::Tensor a = at::randn({4096}, on), b = at::empty({4096 * n}, on);
      at::Tensor send = at::randn({3 * n, 8}, on), recv = at::empty({3 * n, 8}, on);
      switch (call % 4) {
        case 0:
          work = group->allReduce(a, {.deadline = deadline});
          break;
        case 1:
          work = group->allGather(a, b, {.deadline = deadline});
          break;
        case 2:
          work = group->allToAll(send, recv, {}, {}, {.deadline = deadline});
          break;
        default:
          work = group->broadcast(a, 0, {.deadline = deadline});
          break;
      }
      if (work->sequence() == 0) {  // skipped by the fault: this rank is elsewhere now
        std::this_thread::sleep_for(std::chrono::seconds(30));
        return 0;
      }
      work->wait();
    } catch (const Error& e) {
      waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      outcome = fmt::format("{} {}", e.kind(), e.what());
      exitCode = e.exitCode();
      break;
    }
  }
  std::FILE* file = std::fopen(fmt::format("{}/rank_{}.txt", outDir, me).c_str(), "w");
  std::fprintf(file, "%.3f %s\n", waited, outcome.c_str());
  std::fclose(file);
  return exitCode;  // as an uncaught error would end the job (see guardedMain)
}
