// Multi-rank checkpoint tests: run under mpirun (MPI backend). Every rank runs
// every test case in the same order; the job fails if any rank fails.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <cstdlib>

#include "checkpoint/fs.h"
#include "tests/checkpoint/support.h"
#include "tests/support/catch_compat.h"
#include "tests/support/catch_session.h"

namespace bulkhead::testing::ckpt {
namespace {
std::unique_ptr<Runtime> instance;
int sharedDirs = 0;
}  // namespace

Runtime& runtime() { return *instance; }
int rank() { return instance->world().rank(); }
int worldSize() { return instance->world().size(); }
void barrier() { instance->world().barrier({.deadline = Deadline::afterSeconds(120)})->wait(); }

SharedDir::SharedDir(const std::string& stem) {
  std::string key = fmt::format("test/shared-dir/{}", sharedDirs++);
  auto deadline = Deadline::afterSeconds(60);
  if (rank() == 0) {
    owned_ = std::make_unique<TempDir>(stem);
    path_ = owned_->path();
    runtime().store()->set(key, path_, deadline);
  } else {
    path_ = runtime().store()->get(key, deadline);
  }
}

SharedDir::~SharedDir() {
  try {
    barrier();
  } catch (const std::exception&) {
  }
}

int run(const std::string& command) {
  int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

std::vector<HintRun> runHints(const std::string& message, const std::string& scratch) {
  const std::string tool = "bulkhead-ckpt";
  std::vector<HintRun> runs;
  for (size_t at = message.find("`" + tool); at != std::string::npos; at = message.find("`" + tool, at + 1)) {
    size_t end = message.find('`', at + 1);
    if (end == std::string::npos) break;
    HintRun hint{.hint = message.substr(at + 1, end - at - 1)};
    std::string log = fmt::format("{}/hint-{}.log", scratch, runs.size());
    hint.code = run(fmt::format("{}{} > {} 2>&1", BULKHEAD_CKPT_TOOL, hint.hint.substr(tool.size()), log));
    hint.output = checkpoint::fs::readFile(log).value_or("");
    runs.push_back(std::move(hint));
  }
  return runs;
}

}  // namespace bulkhead::testing::ckpt

int main(int argc, char** argv) {
  return bulkhead::guardedMain([&] {
    using namespace bulkhead::testing::ckpt;
    instance = bulkhead::init({.backend = bulkhead::Backend::Mpi});
    int failed = bulkhead::testing::runCatch(argc, argv);
    at::Tensor verdict = at::tensor({failed}, at::kInt);
    instance->world().allReduce(verdict, {.op = bulkhead::ReduceOp::Max})->wait();
    instance->shutdown();
    instance.reset();
    return verdict.item<int>() == 0 ? 0 : 1;
  });
}
