#pragma once
// The benches' one check of a CUDA runtime return code (their timing events
// and syncs; the library converts its own in runtime/nccl/nccl_check.cc), and
// their one way of reporting a table.

#include <fmt/format.h>

#include <cstdio>
#include <string>

#include "runtime/errors.h"

#define BENCH_CHECK(call)                                                                       \
  do {                                                                                          \
    auto rc = (call);                                                                           \
    if (rc != decltype(rc){})                                                                   \
      throw bulkhead::CommError(fmt::format("{} failed with {}", #call, static_cast<int>(rc))); \
  } while (0)

namespace bulkhead::bench {

// Prints a bench's table, and writes it to `out` too where one is named.
inline void report(const std::string& text, const std::string& out) {
  std::fputs(text.c_str(), stdout);
  if (out.empty()) return;
  std::FILE* file = std::fopen(out.c_str(), "w");
  if (!file) throw bulkhead::IoError(fmt::format("cannot write {}", out));
  std::fputs(text.c_str(), file);
  std::fclose(file);
}

}  // namespace bulkhead::bench
