// bulkhead-ckpt: look at and check a checkpoint folder without a job.
//
//   bulkhead-ckpt list DIR                                  committed steps, `latest`, partial (.tmp) folders
//   bulkhead-ckpt inspect DIR [--step N|latest] [--slices] [--json]
//                                                           step, layout, tensors (dtype, shape, slices, bytes)
//   bulkhead-ckpt verify DIR [--step N|latest|all] [--threads N]
//                                                           every checksum, digest, file and the coverage
//   bulkhead-ckpt export DIR --to OUT [--step N|latest] [--map FILE] [--with-optimizer] [--shard-size 5GB]
//                                                           Hugging Face safetensors shards + index
//   bulkhead-ckpt import SRC --to DIR [--map FILE] [--step N]
//                                                           safetensors -> a committed checkpoint
//   bulkhead-ckpt diff A B [--step-a N] [--step-b M] [--rtol X] [--atol Y]
//                                                           per key: equal, how far apart, or missing
//
// DIR is a checkpoint folder or one of its step folders (DIR/step_000200), which names that step.
// Exit codes: 0 fine; 1 verify found a fault, or diff a difference (each is printed); otherwise the
// error's code (2 usage, 6 I/O, 7 checkpoint: missing or unreadable).
// --help lists the flags of each subcommand (bulkhead-ckpt verify --help).

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>
#include <vector>

#include "checkpoint/convert.h"
#include "checkpoint/dtype.h"
#include "checkpoint/inspect.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/tensor_reader.h"
#include "launch/cli.h"
#include "launch/init.h"
#include "models/hf_export.h"
#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/progress_bar.h"

using namespace bulkhead;
using namespace bulkhead::checkpoint;

namespace {

using Json = nlohmann::ordered_json;

std::string bytesText(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int unit = 0;
  while (bytes >= 1024 && unit < 4) {
    bytes /= 1024;
    ++unit;
  }
  return unit == 0 ? fmt::format("{:.0f} B", bytes) : fmt::format("{:.1f} {}", bytes, units[unit]);
}

std::string ageText(double seconds) {
  if (seconds < 120) return fmt::format("{:.0f} s", seconds);
  if (seconds < 7200) return fmt::format("{:.0f} min", seconds / 60);
  return fmt::format("{:.1f} h", seconds / 3600);
}

// A progress bar on stderr when it is a terminal: "<label> [####....] 42% 1.2 GB / 2.9 GB".
class Progress {
 public:
  explicit Progress(std::string label) : bar_({.stream = stderr, .label = std::move(label)}) {}
  void operator()(int64_t done, int64_t total) {
    bar_.draw(done, total,
              fmt::format("{:3d}% {} / {}", total > 0 ? static_cast<int>(100 * done / total) : 100, bytesText(done),
                          bytesText(total)),
              /*finish=*/true);
  }

 private:
  ProgressBar bar_;
};

int list(const std::string& dir) {
  auto steps = listCheckpoints(dir);
  if (steps.empty()) {
    fmt::print("{}: no checkpoints\n", dir);
    return 0;
  }
  size_t width = 32;  // superseded folders' names are longer
  for (const auto& step : steps) width = std::max(width, step.name.size());
  fmt::print("{:<{}} {:>10} {:<36} {:>6} {:>11} {:>8}  {}\n", "folder", width, "step", "state", "files", "size", "age",
             "job");
  for (const auto& step : steps)
    fmt::print("{:<{}} {:>10} {:<36} {:>6} {:>11} {:>8}  {}\n", step.name, width, step.step,
               step.latest ? step.state + " (latest)" : step.state, step.files, bytesText(step.bytes),
               ageText(step.ageSeconds), step.job);
  return 0;
}

int inspect(const std::string& dir, const std::string& which, bool slices, bool asJson) {
  std::string folder = resolveStepFolder(dir, which);
  Manifest manifest = readManifest(folder);
  const auto& byTensor = manifest.slicesByTensor();
  auto tensorBytes = [&](size_t t) {
    return volume(manifest.tensors[t].globalShape) * dtypeSize(manifest.tensors[t].dtype);
  };
  if (asJson) {
    Json out{{"step", manifest.step},
             {"path", folder},
             {"job", manifest.job},
             {"world_size", manifest.worldSize},
             {"created", manifest.created},
             {"layout", manifest.layout ? Json(manifest.layout->text()) : Json()},
             {"bytes", manifest.totalBytes()},
             {"files", Json::array()},
             {"tensors", Json::array()}};
    for (const auto& file : manifest.files)
      out["files"].push_back({{"rank", file.rank}, {"name", file.name}, {"bytes", file.bytes}});
    for (size_t t = 0; t < manifest.tensors.size(); ++t) {
      const auto& tensor = manifest.tensors[t];
      Json sliceList = Json::array();
      for (int s : byTensor[t]) {
        const auto& slice = manifest.slices[s];
        sliceList.push_back({{"rank", slice.rank},
                             {"offsets", slice.offsets},
                             {"shape", slice.shape},
                             {"dataset", slice.dataset},
                             {"digest", fmt::format("{:016x}", slice.digest)}});
      }
      out["tensors"].push_back({{"key", tensor.key},
                                {"dtype", dtypeName(tensor.dtype)},
                                {"shape", tensor.globalShape},
                                {"bytes", tensorBytes(t)},
                                {"internal", isReservedKey(tensor.key)},
                                {"slices", std::move(sliceList)}});
    }
    // Keys are the writer's bytes: invalid UTF-8 is replaced rather than refused.
    fmt::print("{}\n", out.dump(2, ' ', false, Json::error_handler_t::replace));
    return 0;
  }
  std::time_t created = static_cast<std::time_t>(manifest.created);
  char when[64];
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&created));
  fmt::print("step {}  ({})\nsaved {} by job {}, world size {}\nlayout: {}\n{} files, {}\n\n", manifest.step, folder,
             when, manifest.job, manifest.worldSize, manifest.layout ? manifest.layout->text() : "not recorded",
             manifest.files.size(), bytesText(manifest.totalBytes()));
  fmt::print("{:<48} {:<9} {:<22} {:>6} {:>11}\n", "tensor", "dtype", "shape", "slices", "size");
  size_t internal = 0;
  for (size_t t = 0; t < manifest.tensors.size(); ++t) {
    const auto& tensor = manifest.tensors[t];
    if (isReservedKey(tensor.key)) {
      ++internal;
      continue;
    }
    fmt::print("{:<48} {:<9} {:<22} {:>6} {:>11}\n", tensor.key, dtypeName(tensor.dtype),
               fmt::format("[{}]", fmt::join(tensor.globalShape, ", ")), byTensor[t].size(), bytesText(tensorBytes(t)));
    if (slices)
      for (int s : byTensor[t])
        fmt::print("    rank {:<5} offsets [{}]  shape [{}]\n", manifest.slices[s].rank,
                   fmt::join(manifest.slices[s].offsets, ", "), fmt::join(manifest.slices[s].shape, ", "));
  }
  fmt::print("\nnon-tensor state: {} entries (per-rank RNG states and data positions, user blob)\n", internal);
  if (slices)
    for (const auto& tensor : manifest.tensors)
      if (isReservedKey(tensor.key))
        fmt::print("    {:<44} {:>11}\n", tensor.key, bytesText(volume(tensor.globalShape)));
  return 0;
}

int verify(const std::string& dir, const std::string& which, int threads) {
  std::vector<std::string> folders;
  if (which == "all" && asStepFolder(dir)) {
    folders.push_back(dir);  // a step folder: all of it is that one step
  } else if (which == "all") {
    for (const auto& step : listCheckpoints(dir))
      if (step.state == "committed") folders.push_back(fmt::format("{}/{}", dir, step.name));
    if (folders.empty()) throw CheckpointError(fmt::format("{} holds no committed checkpoint", dir));
  } else {
    folders.push_back(resolveStepFolder(dir, which));
  }
  int faulty = 0;
  for (const auto& folder : folders) {
    auto started = std::chrono::steady_clock::now();
    Progress progress(fmt::format("verifying {}", folder));
    VerifyReport report = verifyCheckpoint(folder, threads, std::ref(progress));
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (report.ok()) {
      fmt::print("{}: ok (step {}, {} slices, {} chunks, {} read and verified in {:.2f} s)\n", folder, report.step,
                 report.slicesChecked, report.chunksChecked, bytesText(report.bytesChecked), seconds);
      continue;
    }
    ++faulty;
    fmt::print("{}: {} fault{} found\n", folder, report.problems.size(), report.problems.size() == 1 ? "" : "s");
    for (const auto& problem : report.problems) fmt::print("  - {}\n", problem);
  }
  return faulty == 0 ? 0 : 1;
}

// A checkpoint of a Hugging Face model (its config.json in the user state, as train_moe --hf-model saves
// it) exports under save_pretrained's names with its config.json and generation_config.json beside, unless
// --map names another key map.
void addModelFiles(ExportOptions& options) {
  if (!options.map.empty()) return;
  const std::string folder = resolveStepFolder(options.dir, options.step);
  WholeTensorReader reader(folder, 1);
  const std::string key = userKey(models::kHfConfigKey);
  for (const TensorRecord& record : reader.manifest().tensors) {
    if (record.key != key) continue;
    const at::Tensor bytes = reader.read(key);
    const std::string text(static_cast<const char*>(bytes.data_ptr()), bytes.nbytes());
    const models::HfExport model = models::hfExport(text, folder + " (the model's config.json, saved with it)");
    options.mapText = model.keyMap;
    options.files = model.files;
    return;
  }
}

int exportTo(ExportOptions options) {
  addModelFiles(options);
  Progress progress(fmt::format("exporting to {}", options.out));
  options.progress = std::ref(progress);
  ExportReport report = exportSafetensors(options);
  fmt::print("exported step {} of {} to {}: {} tensors, {} in {} files, {:.2f} s ({:.0f} MB/s)\n", report.step,
             report.folder, options.out, report.tensors, bytesText(static_cast<double>(report.bytes)),
             report.files.size(), report.seconds, report.bytes / 1e6 / std::max(report.seconds, 1e-9));
  return 0;
}

int importFrom(ImportOptions options) {
  Progress progress(fmt::format("importing {}", options.source));
  options.progress = std::ref(progress);
  ImportReport report = importSafetensors(options);
  fmt::print("imported {}: {} tensors, {} committed as {} in {:.2f} s\n", options.source, report.tensors,
             bytesText(static_cast<double>(report.bytes)), report.path, report.seconds);
  return 0;
}

int diff(const DiffOptions& options) {
  DiffReport report = diffCheckpoints(options);
  fmt::print("A: {}\nB: {}\n\n{:<52} {}\n", report.folderA, report.folderB, "key", "result");
  for (const auto& key : report.keys) {
    std::string result;
    switch (key.kind) {
      case KeyDiff::Kind::Equal:
        result = "equal";
        break;
      case KeyDiff::Kind::OnlyInA:
        result = "only in A";
        break;
      case KeyDiff::Kind::OnlyInB:
        result = "only in B";
        break;
      case KeyDiff::Kind::Close:
      case KeyDiff::Kind::Differs:
        result = !key.detail.empty() ? "DIFFERS: " + key.detail
                                     : fmt::format("{}: max abs {:.3g}, max rel {:.3g}",
                                                   key.kind == KeyDiff::Kind::Close ? "within tolerance" : "DIFFERS",
                                                   key.maxAbs, key.maxRel);
        break;
    }
    fmt::print("{:<52} {}\n", key.key, result);
  }
  fmt::print("\n{} keys: {} equal, {} within tolerance, {} differ, {} only in A, {} only in B\n", report.keys.size(),
             report.count(KeyDiff::Kind::Equal), report.count(KeyDiff::Kind::Close),
             report.count(KeyDiff::Kind::Differs), report.count(KeyDiff::Kind::OnlyInA),
             report.count(KeyDiff::Kind::OnlyInB));
  return report.same() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app("Lists, inspects, verifies, exports, imports and compares the checkpoints in a folder, without a job.",
               "bulkhead-ckpt");
  app.require_subcommand(1);
  std::string dir, step = "latest";
  bool slices = false, asJson = false;
  int threads = static_cast<int>(std::max<int64_t>(1, env::kCheckpointThreads.integer()));

  auto* list = app.add_subcommand("list", "committed steps, latest, partial and superseded folders, sizes, ages");
  list->add_option("DIR", dir, "the checkpoint folder")->required();
  auto* inspect = app.add_subcommand("inspect", "a checkpoint's step, layout, tensors, slices and sizes");
  inspect->add_option("DIR", dir, "the checkpoint folder, or one of its step folders")->required();
  inspect->add_option("--step", step, "a step number or latest");
  inspect->add_flag("--slices", slices, "list every saved slice of each tensor");
  inspect->add_flag("--json", asJson, "print the manifest as JSON");
  auto* verify = app.add_subcommand("verify", "reads everything: every checksum, digest, file and the coverage");
  verify->add_option("DIR", dir, "the checkpoint folder, or one of its step folders")->required();
  verify->add_option("--step", step, "a step number, latest or all");
  verify->add_option("--threads", threads, "reader threads")->check(CLI::Range(1, 1024));
  ExportOptions exporting{.threads = threads};
  auto* exportCommand = app.add_subcommand("export", "writes a checkpoint's weights as Hugging Face safetensors");
  exportCommand->add_option("DIR", exporting.dir, "the checkpoint folder, or one of its step folders")->required();
  exportCommand->add_option("--to", exporting.out, "the folder to write (new or empty)")->required();
  exportCommand->add_option("--step", exporting.step, "a step number or latest");
  exportCommand
      ->add_option("--map", exporting.map, "a key map (JSON; docs/checkpoints.md); none: keys keep their names")
      ->check(CLI::ExistingFile);
  exportCommand->add_flag("--with-optimizer", exporting.withOptimizer,
                          "also write the optimizer state (optimizer-*.safetensors, under Bulkhead's keys)");
  exportCommand->add_option("--shard-size", exporting.shardBytes, "the most bytes of one file (5GB, 500MB, ...)")
      ->transform(CLI::AsSizeValue(true))
      ->check(CLI::PositiveNumber);
  exportCommand->add_option("--threads", exporting.threads, "reader threads")->check(CLI::Range(1, 1024));
  ImportOptions importing;
  auto* importCommand = app.add_subcommand("import", "saves safetensors files as a committed checkpoint");
  importCommand
      ->add_option("SRC", importing.source, "a folder of .safetensors files (with or without an index), or one file")
      ->required()
      ->check(CLI::ExistingPath);
  importCommand->add_option("--to", importing.dir, "the checkpoint folder to write")->required();
  importCommand->add_option("--map", importing.map, "the key map the files were exported with")
      ->check(CLI::ExistingFile);
  importCommand->add_option("--step", importing.step, "the step the checkpoint is saved as")->check(cli::nonNegative());
  DiffOptions diffing{.threads = threads};
  auto* diffCommand = app.add_subcommand("diff", "compares two checkpoints key by key (exit 1 when they differ)");
  diffCommand->add_option("A", diffing.a, "a checkpoint folder")->required();
  diffCommand->add_option("B", diffing.b, "another checkpoint folder")->required();
  diffCommand->add_option("--step-a", diffing.stepA, "A's step number or latest");
  diffCommand->add_option("--step-b", diffing.stepB, "B's step number or latest");
  diffCommand->add_option("--rtol", diffing.rtol, "relative tolerance: |a - b| <= atol + rtol * |b|")
      ->check(CLI::NonNegativeNumber);
  diffCommand->add_option("--atol", diffing.atol, "absolute tolerance")->check(CLI::NonNegativeNumber);
  if (auto code = cli::parse(app, argc, argv)) return *code;

  return guardedMain([&] {
    if (list->parsed()) return ::list(dir);
    if (inspect->parsed()) return ::inspect(dir, step, slices, asJson);
    if (exportCommand->parsed()) return exportTo(exporting);
    if (importCommand->parsed()) return importFrom(importing);
    if (diffCommand->parsed()) return ::diff(diffing);
    return ::verify(dir, step, threads);
  });
}
