#pragma once
// Timing a launch on a CUDA stream, shared by the communication benches:
// back-to-back launches between two events, and the median of rounds.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "bench/bench_check.h"

namespace bulkhead::bench {

// Microseconds a launch, over `iterations` back-to-back launches on `stream`.
inline double timeLoop(cudaStream_t stream, int iterations, const std::function<void()>& launch) {
  cudaEvent_t start, stop;
  BENCH_CHECK(cudaEventCreate(&start));
  BENCH_CHECK(cudaEventCreate(&stop));
  BENCH_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < iterations; ++i) launch();
  BENCH_CHECK(cudaEventRecord(stop, stream));
  BENCH_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  BENCH_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms * 1000.0 / iterations;
}

inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace bulkhead::bench
