#pragma once
// The benches' one check of a raw CUDA or NCCL return code (their reference
// calls bypass Bulkhead's own conversions on purpose).

#include <fmt/format.h>

#include "runtime/errors.h"

#define BENCH_CHECK(call)                                                                                     \
  do {                                                                                                        \
    auto rc = (call);                                                                                         \
    if (rc != decltype(rc){}) throw bulkhead::CommError(fmt::format("{} failed with {}", #call, static_cast<int>(rc))); \
  } while (0)
