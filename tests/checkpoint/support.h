#pragma once
// Shared pieces of the multi-rank checkpoint tests: the runtime (set up by
// main.cc), a folder every rank shares for one test, and a world barrier.

#include <memory>
#include <string>
#include <vector>

#include "launch/init.h"
#include "tests/support/temp_dir.h"

namespace bulkhead::testing::ckpt {

Runtime& runtime();
int rank();
int worldSize();
void barrier();

// A fresh folder for one test: rank 0 creates it and shares its path through
// the store; the destructor waits for every rank, then rank 0 removes it.
class SharedDir {
 public:
  explicit SharedDir(const std::string& stem);
  ~SharedDir();
  const std::string& path() const { return path_; }

 private:
  std::unique_ptr<TempDir> owned_;
  std::string path_;
};

// The exit code of a shell command (std::system), for bulkhead-ckpt runs.
int run(const std::string& command);

// A command an error message tells its reader to run (`bulkhead-ckpt verify DIR/step_000100`), run as written
// with the built bulkhead-ckpt: its exit code and what it printed.
struct HintRun {
  std::string hint;
  int code = -1;
  std::string output;
};
// Every `bulkhead-ckpt ...` hint quoted in `message`, each run; `scratch` is a folder for their output.
std::vector<HintRun> runHints(const std::string& message, const std::string& scratch);

}  // namespace bulkhead::testing::ckpt
