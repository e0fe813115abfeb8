#include "examples/train_moe/train_options.h"

#include <ATen/ATen.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <functional>
#include <map>

#include "runtime/errors.h"

namespace bulkhead::examples {
namespace {

constexpr const char* kUsage = R"(usage: train_moe [flags]
  layout:      --tp N --ep N --backend auto|mpi|nccl
  model:       --layers N --hidden N --heads N --ffn N --experts N --topk N --shared-ffn N
               --aux-coeff X --z-coeff X --capacity X --per-slot --dtype float32|float64|bfloat16 --seed N
  data:        --seq N --batch N (global sequences per step)
  training:    --steps N --stop-after N --lr X --warmup N --clip X --log-interval N
  checkpoints: --ckpt-dir DIR --ckpt-interval N --keep N --resume latest|STEP
  tests:       --loss-log FILE --digest)";

at::ScalarType parseDtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float64") return at::kDouble;
  if (name == "bfloat16") return at::kBFloat16;
  throw ConfigError(fmt::format("unknown --dtype '{}'\n{}", name, kUsage), {.expected = "float32|float64|bfloat16"});
}

}  // namespace

TrainOptions parseTrainOptions(int argc, char** argv) {
  TrainOptions o;
  auto& m = o.model;
  std::map<std::string, std::function<void(const std::string&)>> flags{
      {"--backend", [&](const std::string& v) { o.backend = parseBackend(v); }},
      {"--tp", [&](const std::string& v) { o.tp = std::stoi(v); }},
      {"--ep", [&](const std::string& v) { o.ep = std::stoi(v); }},
      {"--layers", [&](const std::string& v) { m.layers = std::stoi(v); }},
      {"--hidden", [&](const std::string& v) { m.hidden = std::stoi(v); }},
      {"--heads", [&](const std::string& v) { m.heads = std::stoi(v); }},
      {"--ffn", [&](const std::string& v) { m.ffn = std::stoi(v); }},
      {"--experts", [&](const std::string& v) { m.experts = std::stoi(v); }},
      {"--topk", [&](const std::string& v) { m.topK = std::stoi(v); }},
      {"--shared-ffn", [&](const std::string& v) { m.sharedFfn = std::stoi(v); }},
      {"--aux-coeff", [&](const std::string& v) { m.auxLossCoeff = std::stod(v); }},
      {"--z-coeff", [&](const std::string& v) { m.zLossCoeff = std::stod(v); }},
      {"--capacity", [&](const std::string& v) { m.capacityFactor = std::stod(v); }},
      {"--dtype", [&](const std::string& v) { m.dtype = parseDtype(v); }},
      {"--seed", [&](const std::string& v) { m.seed = std::stoull(v); }},
      {"--seq", [&](const std::string& v) { o.sequence = std::stoi(v); }},
      {"--batch", [&](const std::string& v) { o.globalBatch = std::stoi(v); }},
      {"--steps", [&](const std::string& v) { o.steps = std::stoll(v); }},
      {"--stop-after", [&](const std::string& v) { o.stopAfter = std::stoll(v); }},
      {"--lr", [&](const std::string& v) { o.lr = std::stod(v); }},
      {"--warmup", [&](const std::string& v) { o.warmup = std::stoll(v); }},
      {"--clip", [&](const std::string& v) { o.clip = std::stod(v); }},
      {"--log-interval", [&](const std::string& v) { o.logInterval = std::max(1, std::stoi(v)); }},
      {"--ckpt-dir", [&](const std::string& v) { o.checkpointDir = v; }},
      {"--ckpt-interval", [&](const std::string& v) { o.checkpointInterval = std::stoll(v); }},
      {"--keep", [&](const std::string& v) { o.keep = std::stoi(v); }},
      {"--resume", [&](const std::string& v) { o.resume = v; }},
      {"--loss-log", [&](const std::string& v) { o.lossLog = v; }},
  };
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--per-slot") {
      m.oncePerRank = false;
    } else if (flag == "--digest") {
      o.printDigest = true;
    } else if (flag == "--help" || flag == "-h") {
      throw ConfigError(kUsage, {.expected = "flags as listed"});
    } else if (auto it = flags.find(flag); it != flags.end() && i + 1 < argc) {
      const std::string value = argv[++i];
      try {
        it->second(value);
      } catch (const std::logic_error&) {  // std::stoi and friends
        throw ConfigError(fmt::format("{} {}: not a valid value\n{}", flag, value, kUsage), {.expected = flag});
      }
    } else {
      throw ConfigError(fmt::format("unknown flag or missing value: '{}'\n{}", flag, kUsage), {.expected = "a flag"});
    }
  }
  return o;
}

std::string parameterDigest(const std::vector<parallel::Parameter>& parameters, Communicator& cpuWorld) {
  std::vector<const parallel::Parameter*> sorted;
  for (const auto& parameter : parameters) sorted.push_back(&parameter);
  std::sort(sorted.begin(), sorted.end(), [](auto* a, auto* b) { return a->name < b->name; });
  uint64_t hash = 1469598103934665603ULL;
  for (const auto* parameter : sorted) {
    at::Tensor bytes = parameter->tensor.detach().to(at::kCPU).contiguous();
    const auto* data = static_cast<const unsigned char*>(bytes.data_ptr());
    for (size_t i = 0; i < bytes.nbytes(); ++i) hash = (hash ^ data[i]) * 1099511628211ULL;
  }
  at::Tensor mine = at::full({1}, static_cast<int64_t>(hash), at::kLong);
  at::Tensor all = at::empty({cpuWorld.size()}, at::kLong);
  cpuWorld.allGather(mine, all)->wait();
  std::vector<std::string> hex;
  for (int rank = 0; rank < cpuWorld.size(); ++rank)
    hex.push_back(fmt::format("{:016x}", static_cast<uint64_t>(all[rank].item<int64_t>())));
  return fmt::format("parameter digest: {}", fmt::join(hex, " "));
}

}  // namespace bulkhead::examples
