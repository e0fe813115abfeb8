#include "data/numpy_random.h"

namespace bulkhead::data {
namespace {

// numpy's pairwise_sum for float64 (numpy/_core/src/umath/loops_utils.h.src): a plain loop below 8
// values, eight running sums up to 128, halves (a multiple of 8 first) above.
double pairwiseSum(const double* a, size_t n) {
  if (n < 8) {
    double sum = 0.;
    for (size_t i = 0; i < n; ++i) sum += a[i];
    return sum;
  }
  if (n <= 128) {
    double r[8];
    for (int j = 0; j < 8; ++j) r[j] = a[j];
    size_t i = 8;
    for (; i < n - (n % 8); i += 8)
      for (int j = 0; j < 8; ++j) r[j] += a[i + j];
    double sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; ++i) sum += a[i];
    return sum;
  }
  size_t half = n / 2;
  half -= half % 8;
  return pairwiseSum(a, half) + pairwiseSum(a + half, n - half);
}

}  // namespace

uint64_t LegacyRandomState::interval(uint64_t max) {
  if (max == 0) return 0;
  uint64_t mask = max;
  mask |= mask >> 1;
  mask |= mask >> 2;
  mask |= mask >> 4;
  mask |= mask >> 8;
  mask |= mask >> 16;
  mask |= mask >> 32;
  uint64_t value;
  if (max <= 0xffffffffULL) {
    while ((value = (engine_() & mask)) > max) {
    }
  } else {
    auto next64 = [this] {
      const uint64_t high = engine_();
      return (high << 32) | engine_();
    };
    while ((value = (next64() & mask)) > max) {
    }
  }
  return value;
}

double numpySum(std::span<const double> values) {
  // add.reduce of a float array starts from add's identity, 0.0, and adds the pairwise sum of all values.
  return 0. + pairwiseSum(values.data(), values.size());
}

std::vector<double> numpyNormalize(std::span<const double> weights) {
  const double sum = numpySum(weights);
  std::vector<double> normalized;
  for (double w : weights) normalized.push_back(w / sum);
  return normalized;
}

}  // namespace bulkhead::data
