#pragma once
// The two pieces of NumPy that decide Megatron-LM's sample order, reproduced bit for bit: the legacy
// RandomState's shuffle (MT19937 seeded as numpy.random.RandomState(seed) seeds it, then, for i from n - 1
// down to 1, a swap with a bounded draw j in [0, i] by mask rejection) and numpy.sum over float64 (0.0 plus
// numpy's pairwise sum), which Megatron's normalize() divides by.

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace bulkhead::data {

class LegacyRandomState {
 public:
  // numpy.random.RandomState(seed) for a seed in [0, 2^32).
  explicit LegacyRandomState(uint32_t seed) : engine_(seed) {}

  // A draw in [0, max] as numpy's legacy random_interval makes it: 32-bit draws while max fits 32 bits,
  // else 64-bit ones (two 32-bit draws, high word first), masked to max's bit width, redrawn above max.
  uint64_t interval(uint64_t max);

  // RandomState.shuffle of a 1-D array, in place.
  template <typename T>
  void shuffle(std::span<T> values) {
    for (size_t i = values.size(); i-- > 1;) {
      const size_t j = static_cast<size_t>(interval(i));
      std::swap(values[i], values[j]);
    }
  }

 private:
  std::mt19937 engine_;
};

// numpy.sum of a float64 array.
double numpySum(std::span<const double> values);
// Megatron's normalize(): each weight over numpy.sum of them.
std::vector<double> numpyNormalize(std::span<const double> weights);

}  // namespace bulkhead::data
