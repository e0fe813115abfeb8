#pragma once
// Checkpoints that travel: export a committed checkpoint as Hugging Face
// safetensors, import safetensors as a committed checkpoint that any layout
// loads, and compare two checkpoints key by key. One process, no job; what
// `bulkhead-ckpt export`, `import` and `diff` run.
//
// Export reads each tensor whole from its saved slices (whatever layout saved
// them; a tensor at a time through the page cache, the next read while the
// last is written), maps its
// key (key_map.h) and writes model-0000i-of-0000N.safetensors shards of at most
// `shardBytes` with model.safetensors.index.json. Optimizer state (keys
// "optim.*"), when asked for, goes under its own keys to
// optimizer-0000i-of-0000N.safetensors and optimizer.safetensors.index.json,
// which model loaders ignore. Dtypes are kept (bfloat16 as BF16).
//
// Import reads model.safetensors.index.json (and optimizer.safetensors.index.json
// when present), a folder's *.safetensors files, or one file; maps every name
// back, reassembles split tensors, and saves them as step `step` of `dir`
// through the Checkpointer (manifest, checksums, atomic commit) on a world of
// one. A run resumed from it starts from those weights; without optimizer state
// its optimizer starts fresh.
//
// Errors: CheckpointError for a damaged file, a tensor the map does not cover,
// pieces missing or of mismatched shapes or dtypes (naming the key and the
// file); ConfigError for a bad map or options; IoError for the file system.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace bulkhead::checkpoint {

using ProgressFn = std::function<void(int64_t done, int64_t total)>;

struct ExportOptions {
  std::string dir;              // the checkpoint folder
  std::string step = "latest";  // a step number or latest
  std::string out;              // the folder to write; created, and must not hold an export already
  std::string map;              // a key map file; empty: mapText, else every key keeps its name
  std::string mapText;          // a key map document itself (a model's own, models/hf_export.h)
  // Files written beside the shards (a model's config.json), by name, after them.
  std::map<std::string, std::string> files;
  bool withOptimizer = false;
  int64_t shardBytes = 5'000'000'000;
  int threads = 4;      // reader threads
  ProgressFn progress;  // bytes written
};

struct ExportReport {
  int64_t step = 0;
  std::string folder;   // the step folder read
  int64_t tensors = 0;  // written
  int64_t bytes = 0;    // of tensor data
  std::vector<std::string> files;
  double seconds = 0;
};

ExportReport exportSafetensors(const ExportOptions& options);

struct ImportOptions {
  std::string source;   // a folder of safetensors files (with or without an index), or one file
  std::string dir;      // the checkpoint folder to write
  std::string map;      // empty: every name is a Bulkhead key
  int64_t step = 0;     // the step the checkpoint is saved as
  ProgressFn progress;  // bytes read
};

struct ImportReport {
  int64_t step = 0;
  std::string path;     // the committed step folder
  int64_t tensors = 0;  // Bulkhead tensors written
  int64_t bytes = 0;
  double seconds = 0;
};

ImportReport importSafetensors(const ImportOptions& options);

struct DiffOptions {
  std::string a, b;  // checkpoint folders
  std::string stepA = "latest", stepB = "latest";
  double rtol = 0, atol = 0;  // close when |a - b| <= atol + rtol * |b| everywhere
  int threads = 4;
};

struct KeyDiff {
  enum class Kind { Equal, Close, Differs, OnlyInA, OnlyInB };
  std::string key;
  Kind kind = Kind::Equal;
  double maxAbs = 0, maxRel = 0;  // Close and Differs with matching shapes
  std::string detail;             // a shape or dtype mismatch
};

struct DiffReport {
  std::string folderA, folderB;
  std::vector<KeyDiff> keys;  // by key
  int count(KeyDiff::Kind kind) const;
  // Nothing missing on either side and nothing beyond the tolerance.
  bool same() const {
    return count(KeyDiff::Kind::Differs) + count(KeyDiff::Kind::OnlyInA) + count(KeyDiff::Kind::OnlyInB) == 0;
  }
};

// Every tensor key of both (the per-rank state under "_bulkhead/" left out).
DiffReport diffCheckpoints(const DiffOptions& options);

}  // namespace bulkhead::checkpoint
