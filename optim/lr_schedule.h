#pragma once
// The learning rate per step: linear warm-up to the peak, then cosine decay
// to the minimum, then the minimum.
//   step < warmup:          peak * (step + 1) / warmup
//   warmup <= step < total: min + (peak - min) * (1 + cos(pi * (step - warmup) / (total - warmup))) / 2
//   step >= total:          min
// `step` is the 0-based index of the update about to be taken (an optimizer's
// stepCount() before its step).

#include <cstdint>

namespace bulkhead::optim {

struct LrSchedule {
  double peak = 1e-3;
  double min = 0.0;
  int64_t warmupSteps = 0;
  int64_t totalSteps = 1;  // warm-up included

  // ConfigError for a negative rate, min > peak, negative warm-up, or a warm-up
  // longer than the whole.
  void validate() const;
  double at(int64_t step) const;
};

}  // namespace bulkhead::optim
