// GPU fault program: with the nccl backend on 2 or more ranks, rank 1
// misbehaves and every other rank must raise TimeoutError within the deadline
// plus 2 s, without hanging in abort; the job must then exit non-zero.
//
//   gpu_fault <init|collective|unwaited> <deadline-ms> <out-dir>
//   init:       rank 1 takes NCCL's unique id but never joins ncclCommInitRankConfig
//   collective: rank 1 skips an all-reduce that rank 0 waits on
//   unwaited:   as collective, but rank 0 never waits: the watchdog must fail it
//   connect:    rank 1 skips the very first all-to-all, whose NCCL call on rank 0
//               blocks connecting to it: the watchdog must bound the call itself
// Each rank but 1 writes <out-dir>/rank_<r>.txt: seconds waited, the error's type and message.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "launch/init.h"
#include "runtime/errors.h"
#include "runtime/nccl/nccl_backend.h"

using namespace bulkhead;

namespace {

void report(const std::string& dir, int rank, double waited, const std::string& outcome) {
  std::FILE* file = std::fopen(fmt::format("{}/rank_{}.txt", dir, rank).c_str(), "w");
  std::fprintf(file, "%.3f %s\n", waited, outcome.c_str());
  std::fclose(file);
}

std::string describe(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    return fmt::format("{} {}", e.kind(), e.what());
  } catch (const std::exception& e) {
    return fmt::format("std::exception {}", e.what());
  }
}

// An aborted communicator must refuse further use.
std::string laterOperation(Communicator& gpu, at::Tensor& t) {
  try {
    gpu.allReduce(t)->wait();
    return " | a later operation ran";
  } catch (const CommError&) {
    return " | later operations refused";
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <init|collective|unwaited|connect> <deadline-ms> <out-dir>\n", argv[0]);
    return 2;
  }
  std::string mode = argv[1], outDir = argv[3];
  auto deadlineAfter = std::chrono::milliseconds(std::stoi(argv[2]));
  auto runtime = init({.backend = Backend::Mpi});
  Communicator& cpu = runtime->cpuWorld();
  int me = cpu.rank();
  auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };

  if (mode == "init") {
    if (me == 1) {
      at::Tensor id = at::empty({128}, at::kByte);  // NCCL_UNIQUE_ID_BYTES: what initWorld broadcasts
      cpu.broadcast(id, 0)->wait();
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    }
    start = std::chrono::steady_clock::now();
    try {
      nccl::initWorld(cpu, {.deadline = Deadline::after(deadlineAfter), .localRank = me});
      report(outDir, me, elapsed(), "no error");
    } catch (...) {
      report(outDir, me, elapsed(), describe(std::current_exception()));
    }
    return 0;
  }

  CommunicatorPtr gpu = nccl::initWorld(cpu, {.localRank = me});
  at::Tensor t = at::randn({1 << 20}, at::TensorOptions().device(gpu->device()));
  if (mode == "connect") {
    if (me == 1) {
      std::this_thread::sleep_for(std::chrono::seconds(60));
      return 0;
    }
    at::Tensor recv = at::empty_like(t);
    start = std::chrono::steady_clock::now();
    std::string outcome = "no error";
    try {
      gpu->allToAll(t, recv, {}, {}, {.deadline = Deadline::after(deadlineAfter)})->wait();
    } catch (...) {
      outcome = describe(std::current_exception());
    }
    double waited = elapsed();
    outcome += laterOperation(*gpu, t);
    report(outDir, me, waited, outcome);
    return 0;
  }
  for (int i = 0; i < 5; ++i) gpu->allReduce(t)->wait();
  if (me == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(60));
    return 0;
  }
  start = std::chrono::steady_clock::now();
  auto work = gpu->allReduce(t, {.deadline = Deadline::after(deadlineAfter)});
  std::string outcome = "no error";
  if (mode == "collective") {
    try {
      work->wait();
    } catch (...) {
      outcome = describe(std::current_exception());
    }
  } else {
    while (!work->isCompleted()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (work->exception()) outcome = describe(work->exception());
  }
  double waited = elapsed();
  outcome += laterOperation(*gpu, t);
  report(outDir, me, waited, outcome);
  return 0;
}
