#pragma once
// The benches' one check of a CUDA runtime return code (their timing events
// and syncs; the library converts its own in runtime/nccl/nccl_check.cc).

#include <fmt/format.h>

#include "runtime/errors.h"

#define BENCH_CHECK(call)                                                                       \
  do {                                                                                          \
    auto rc = (call);                                                                           \
    if (rc != decltype(rc){})                                                                   \
      throw bulkhead::CommError(fmt::format("{} failed with {}", #call, static_cast<int>(rc))); \
  } while (0)
