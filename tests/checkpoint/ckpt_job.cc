// A small training-like job for the checkpoint fault tests (fault_test.sh):
// saves the test model (model.h) at the given steps while "training"
// (all-reduces on the world) goes on, then optionally loads and checks it.
//
//   mpirun -np 4 bulkhead_ckpt_job DIR [tp=2] [ep=2] [seed=1] [saves=100,200] [train=0.5]
//          [load=latest|N|none] [seeds=1,2] [timeout=60] [keep=3] [layers=2] [hidden=16] [ffn=24]
//
// Prints, per rank: "RANK r SAVE step ok|failed kind total=S blocking=S error=..." for each
// save, "RANK r LATEST n" after each, and "RANK r LOAD step n seed k" (k = the seed whose
// data it holds, 0 for none). Exit 1 when a load matched no seed; errors exit with their code.

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>
#include <thread>

#include "checkpoint/checkpointer.h"
#include "checkpoint/folder.h"
#include "launch/init.h"
#include "runtime/errors.h"
#include "tests/checkpoint/model.h"

using namespace bulkhead;
using namespace bulkhead::checkpoint;
using namespace bulkhead::testing::ckpt;

namespace {

std::vector<int64_t> numbers(const std::string& text) {
  std::vector<int64_t> values;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) values.push_back(std::stoll(item));
  return values;
}

// About `seconds` of steps; the same number of all-reduces on every rank.
void train(Communicator& world, double seconds) {
  at::Tensor gradient = at::ones({1024});
  for (int step = 0; step < static_cast<int>(seconds * 50); ++step) {
    world.allReduce(gradient, {.deadline = Deadline::afterSeconds(30)})->wait();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

int main(int argc, char** argv) {
  return guardedMain([&] {
    if (argc < 2) throw ConfigError("usage: bulkhead_ckpt_job DIR [key=value ...]");
    std::string dir = argv[1];
    std::map<std::string, std::string> args = {{"tp", "1"},    {"ep", "1"},      {"seed", "1"},    {"saves", ""},
                                               {"train", "0"}, {"load", "none"}, {"seeds", ""},    {"timeout", "60"},
                                               {"keep", "3"},  {"layers", "2"},  {"hidden", "16"}, {"ffn", "24"}};
    for (int i = 2; i < argc; ++i) {
      std::string arg = argv[i];
      size_t equals = arg.find('=');
      if (equals == std::string::npos || !args.count(arg.substr(0, equals)))
        throw ConfigError(fmt::format("unknown argument '{}'", arg));
      args[arg.substr(0, equals)] = arg.substr(equals + 1);
    }
    auto runtime = init({.backend = Backend::Mpi});
    Communicator& world = runtime->world();
    int rank = world.rank();
    auto layout = parallel::Layout::create(world.size(), {.tp = std::stoi(args["tp"]), .ep = std::stoi(args["ep"])});
    ModelShape shape{
        .layers = std::stoi(args["layers"]), .hidden = std::stoi(args["hidden"]), .ffn = std::stoi(args["ffn"])};
    int seed = std::stoi(args["seed"]);
    auto ckpt = Checkpointer::create(
        {.dir = dir, .keep = std::stoi(args["keep"]), .timeoutSeconds = std::stod(args["timeout"])}, runtime->store(),
        rank, world.size());

    for (int64_t step : numbers(args["saves"])) {
      SaveHandle handle = ckpt->save(step, build(shape, layout, rank, seed * 1000 + static_cast<int>(step)));
      train(world, std::stod(args["train"]));  // training goes on while the save is written
      SaveResult result = handle.wait(Deadline::afterSeconds(120));
      std::string error = result.error;
      for (char& c : error)
        if (c == '\n') c = ' ';
      std::printf("RANK %d SAVE %lld %s %s total=%.3f blocking=%.3f error=%s\n", rank, static_cast<long long>(step),
                  result.ok ? "ok" : "failed", result.ok ? "-" : result.errorKind.c_str(), result.totalSeconds,
                  result.blockingSeconds, error.c_str());
      world.barrier({.deadline = Deadline::afterSeconds(60)})->wait();
      auto latest = readLatest(dir, rank);
      std::printf("RANK %d LATEST %lld\n", rank, static_cast<long long>(latest.value_or(-1)));
      std::fflush(stdout);
    }

    int code = 0;
    if (args["load"] != "none") {
      LoadOptions options;
      if (args["load"] != "latest") options.step = std::stoll(args["load"]);
      auto targets = build(shape, layout, rank, 999999);
      LoadResult loaded = ckpt->load(targets, options);
      std::vector<int64_t> seeds = numbers(args["seeds"].empty() ? args["seed"] : args["seeds"]);
      int64_t matched = 0;
      for (int64_t candidate : seeds)
        if (mismatches(targets, shape, static_cast<int>(candidate * 1000 + loaded.step)).empty()) matched = candidate;
      bool stateOk = loaded.user["blob"] == userBlobOf(static_cast<int>(matched * 1000 + loaded.step));
      std::printf("RANK %d LOAD step %lld seed %lld user %s\n", rank, static_cast<long long>(loaded.step),
                  static_cast<long long>(matched), stateOk ? "ok" : "wrong");
      std::fflush(stdout);
      if (matched == 0 || !stateOk) code = 1;
    }
    world.barrier({.deadline = Deadline::afterSeconds(60)})->wait();
    ckpt.reset();
    runtime->shutdown();
    return code;
  });
}
