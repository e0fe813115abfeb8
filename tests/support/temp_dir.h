#pragma once
// A fresh directory for one test, removed with everything in it afterwards.
// POSIX calls on purpose: libtorch 2.x exports its own copy of
// std::filesystem's symbols, and calls into it crash (seen with
// std::filesystem::remove_all on the GPU machine).

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>

#include <stdexcept>
#include <string>

namespace bulkhead::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& stem = "bulkhead-test") {
    const char* base = std::getenv("TMPDIR");
    std::string pattern = std::string(base && *base ? base : "/tmp") + "/" + stem + "-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    ::nftw(
        path_.c_str(), [](const char* path, const struct stat*, int, struct FTW*) { return ::remove(path); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace bulkhead::testing
