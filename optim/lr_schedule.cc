#include "optim/lr_schedule.h"

#include <fmt/format.h>

#include <cmath>
#include <numbers>

#include "runtime/errors.h"

namespace bulkhead::optim {

void LrSchedule::validate() const {
  if (!(peak >= 0.0) || !(min >= 0.0) || min > peak)
    throw ConfigError(fmt::format("LrSchedule: peak {} and min {} must satisfy 0 <= min <= peak", peak, min),
                      {.expected = "0 <= min <= peak"});
  if (warmupSteps < 0 || totalSteps < 1 || warmupSteps > totalSteps)
    throw ConfigError(fmt::format("LrSchedule: warm-up {} and total {} steps must satisfy 0 <= warm-up <= total, "
                                  "total >= 1",
                                  warmupSteps, totalSteps),
                      {.expected = "0 <= warmupSteps <= totalSteps"});
}

double LrSchedule::at(int64_t step) const {
  validate();
  if (step < 0) throw ConfigError(fmt::format("LrSchedule: step {} is negative", step), {.expected = "step >= 0"});
  if (step < warmupSteps) return peak * static_cast<double>(step + 1) / static_cast<double>(warmupSteps);
  if (step >= totalSteps) return min;
  double progress = static_cast<double>(step - warmupSteps) / static_cast<double>(totalSteps - warmupSteps);
  return min + (peak - min) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
}

}  // namespace bulkhead::optim
