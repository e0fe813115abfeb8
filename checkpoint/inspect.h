#pragma once
// What `bulkhead-ckpt` does, as functions: list a checkpoint folder, read a
// step's manifest, verify a step completely (every chunk's checksum, every
// slice's digest, file sizes and identities, coverage). One process, no store.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/manifest.h"

namespace bulkhead::checkpoint {

struct StepInfo {
  int64_t step = 0;
  std::string name;   // the folder's name
  std::string state;  // "committed", "partial (in progress or abandoned)", "being removed",
                      // "superseded (left by a resumed run)"
  bool latest = false;
  std::string job;  // the saving job's nonce
  double ageSeconds = 0;
  int64_t bytes = 0;  // sum of its files
  int files = 0;      // rank files present
};

// Every step folder of `dir`, by step. IoError when it cannot be listed;
// a `latest` that does not parse is reported as no latest.
std::vector<StepInfo> listCheckpoints(const std::string& dir);

// The folder of `which` ("latest" or a step number) in `dir`. CheckpointError
// when there is no such committed step. `dir` may also be a step folder
// (step_000200): "latest" and its own step then name it, and another step is
// looked up in the folder that holds it.
std::string resolveStepFolder(const std::string& dir, const std::string& which);

// When `dir` is a step folder (a folder named as a committed step, holding no
// `latest`): the checkpoint folder holding it and its step.
std::optional<std::pair<std::string, int64_t>> asStepFolder(const std::string& dir);

// A step folder's manifest, checksum verified. CheckpointError otherwise.
Manifest readManifest(const std::string& stepFolder);

struct VerifyReport {
  int64_t step = -1;
  int64_t bytesChecked = 0;
  int64_t chunksChecked = 0;
  int64_t slicesChecked = 0;
  std::vector<std::string> problems;  // empty: the checkpoint is intact
  bool ok() const { return problems.empty(); }
};

// Reads everything and reports every problem found (it goes on after the
// first). `progress(done, total)` is called with bytes as reading advances.
VerifyReport verifyCheckpoint(const std::string& stepFolder, int threads,
                              const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace bulkhead::checkpoint
