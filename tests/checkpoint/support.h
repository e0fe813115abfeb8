#pragma once
// Shared pieces of the multi-rank checkpoint tests: the runtime (set up by
// main.cc), a folder every rank shares for one test, and a world barrier.

#include <memory>
#include <string>

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

}  // namespace bulkhead::testing::ckpt
