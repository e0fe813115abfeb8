// A 4-stage pipeline (1F1B, 8 micro-batches, a chain of float64 layers) that
// goes wrong, for pipeline_fault_test.sh. Each rank writes <out-dir>/rank_<r>.txt:
// the seconds from the start of the failing run to its error, the error's
// kind and message ("0 none" when none).
//
//   pipeline_fault probe <out-dir>   no fault; prints "SEND_SEQ <n>": the ledger
//                                    sequence number of the faulty stage's fifth send
//   pipeline_fault run <out-dir>     three runs; the fault comes from BULKHEAD_FAULT
//                                    (a skipped send) or, with PIPELINE_WRONG_SHAPE=1,
//                                    stage PIPELINE_FAULT_STAGE (default 1) sends
//                                    micro-batch 3 with one row too many
// The backend is BULKHEAD_BACKEND's (mpi unless set; nccl: one GPU a rank).
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "launch/init.h"
#include "parallel/pipeline.h"
#include "runtime/errors.h"

using namespace bulkhead;

namespace {

constexpr int kHidden = 16, kBatch = 5, kMicroBatches = 8;

at::Tensor seeded(std::vector<int64_t> shape, uint64_t seed, c10::Device device) {
  auto generator = at::detail::createCPUGenerator(seed);
  return at::randn(shape, generator, at::kDouble).to(device);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s probe|run <out-dir>\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1], outDir = argv[2];
  const char* backend = std::getenv("BULKHEAD_BACKEND");
  auto runtime = init({.backend = backend && std::string(backend) == "nccl" ? Backend::Nccl : Backend::Mpi});
  const int me = runtime->world().rank();
  auto pp = runtime->world().split(0, me, "pp");
  const int stages = pp->size();
  const bool wrongShape = std::getenv("PIPELINE_WRONG_SHAPE") != nullptr;
  const char* faultyText = std::getenv("PIPELINE_FAULT_STAGE");
  const int faulty = faultyText ? std::atoi(faultyText) : 1;
  const c10::Device device = pp->device();
  at::Tensor weight = (seeded({kHidden, kHidden}, 10 + me, device) / 4).requires_grad_(true);
  parallel::PipelineChunk chunk{.forward = [&](int m, const at::Tensor& input) {
    at::Tensor x = at::tanh(at::matmul(me == 0 ? seeded({kBatch, kHidden}, 100 + m, device) : input, weight));
    if (wrongShape && me == faulty && m == 3) x = at::cat({x, x.slice(0, 0, 1)});
    return me == stages - 1 ? x.pow(2).mean() : x;
  }};
  parallel::Pipeline pipeline(
      pp, {.schedule = parallel::PipelineSchedule::OneFOneB, .microBatches = kMicroBatches, .activationShape = [](int) {
             return std::vector<int64_t>{kBatch, kHidden};
           }});

  if (mode == "probe") {
    pipeline.run({chunk});
    int sends = 0;
    for (const LedgerEntry& entry : pp->ledger().entries())
      if (entry.fingerprint.op == OpType::Send && ++sends == 5 && me == faulty)
        std::printf("SEND_SEQ %llu\n", (unsigned long long)entry.seq);
    return 0;
  }
  std::string outcome = "0 none";
  int exitCode = 0;
  for (int run = 0; run < 3; ++run) {
    auto start = std::chrono::steady_clock::now();
    try {
      pipeline.run({chunk});
    } catch (const Error& e) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      outcome = fmt::format("{:.2f} {} {}", seconds, e.kind(), e.what());
      exitCode = e.exitCode();
      break;
    }
  }
  std::FILE* file = std::fopen(fmt::format("{}/rank_{}.txt", outDir, me).c_str(), "w");
  if (file) {
    std::fputs(outcome.c_str(), file);
    std::fclose(file);
  }
  return exitCode;
}
