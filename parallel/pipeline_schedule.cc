#include "parallel/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>

#include "runtime/errors.h"

namespace bulkhead::parallel {

const char* toString(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::AllForwardAllBackward:
      return "all-forward-all-backward";
    case PipelineSchedule::OneFOneB:
      return "1f1b";
    case PipelineSchedule::Interleaved:
      return "interleaved-1f1b";
  }
  return "?";
}

namespace {

void validate(PipelineSchedule schedule, const PipelineShape& s) {
  if (s.stages < 1 || s.rank < 0 || s.rank >= s.stages || s.virtualStages < 1 || s.microBatches < 1)
    throw ConfigError(fmt::format("pipeline: {} stages, rank {}, {} virtual stages, {} micro-batches do not form a "
                                  "pipeline",
                                  s.stages, s.rank, s.virtualStages, s.microBatches),
                      {.expected = "stages >= 1, 0 <= rank < stages, virtual stages >= 1, micro-batches >= 1"});
  if (schedule == PipelineSchedule::OneFOneB && s.virtualStages != 1)
    throw ConfigError(
        fmt::format("pipeline: 1f1b runs one chunk per rank, not {}; use the interleaved schedule", s.virtualStages),
        {.expected = "virtual stages = 1"});
  const bool chunked = schedule == PipelineSchedule::Interleaved ||
                       (schedule == PipelineSchedule::AllForwardAllBackward && s.virtualStages > 1);
  if (chunked && s.microBatches % s.stages != 0)
    throw ConfigError(
        fmt::format("pipeline: the {} schedule{} needs micro-batches ({}) to be a multiple of the "
                    "pipeline size ({})",
                    toString(schedule), s.virtualStages > 1 ? " over several chunks" : "", s.microBatches, s.stages),
        {.expected = fmt::format("micro-batches a multiple of {}", s.stages)});
}

// Virtual micro-batch k of the interleaved schedule: micro-batches go through
// the chunks in groups of P (Megatron-LM's order).
PipelineStep virtualStep(const PipelineShape& s, int k, bool forward) {
  const int group = k / s.stages, inGroup = k % s.stages;
  const int chunkInOrder = group % s.virtualStages;
  const int chunk = forward ? chunkInOrder : s.virtualStages - 1 - chunkInOrder;
  const int microBatch = (group / s.virtualStages) * s.stages + inGroup;
  return {.forward = forward, .chunk = chunk, .microBatch = microBatch};
}

// Forwards before the first backward.
int warmupOf(PipelineSchedule schedule, const PipelineShape& s) {
  const int total = s.microBatches * s.virtualStages;
  if (schedule == PipelineSchedule::AllForwardAllBackward) return total;
  if (schedule == PipelineSchedule::OneFOneB) return std::min(s.stages - s.rank - 1, s.microBatches);
  if (s.microBatches == s.stages) return total;  // Megatron-LM: with M == P every forward comes first
  return std::min((s.stages - s.rank - 1) * 2 + (s.virtualStages - 1) * s.stages, total);
}

}  // namespace

std::vector<PipelineStep> pipelineSteps(PipelineSchedule schedule, const PipelineShape& s) {
  validate(schedule, s);
  std::vector<PipelineStep> steps;
  const int total = s.microBatches * s.virtualStages;
  if (schedule == PipelineSchedule::AllForwardAllBackward && s.virtualStages == 1) {
    for (int m = 0; m < s.microBatches; ++m) steps.push_back({true, 0, m});
    for (int m = 0; m < s.microBatches; ++m) steps.push_back({false, 0, m});
    return steps;
  }
  const int warmup = warmupOf(schedule, s);
  int forwards = 0, backwards = 0;
  for (; forwards < warmup; ++forwards) steps.push_back(virtualStep(s, forwards, true));
  while (forwards < total) {
    steps.push_back(virtualStep(s, forwards++, true));
    steps.push_back(virtualStep(s, backwards++, false));
  }
  while (backwards < total) steps.push_back(virtualStep(s, backwards++, false));
  return steps;
}

std::vector<std::vector<PipelineStep>> pipelineUnits(PipelineSchedule schedule, const PipelineShape& s) {
  const std::vector<PipelineStep> steps = pipelineSteps(schedule, s);
  std::vector<std::vector<PipelineStep>> units;
  if (schedule != PipelineSchedule::Interleaved) {
    for (const PipelineStep& step : steps) units.push_back({step});
    return units;
  }
  const int total = s.microBatches * s.virtualStages, warmup = warmupOf(schedule, s);
  size_t i = 0;
  for (; i < static_cast<size_t>(warmup); ++i) units.push_back({steps[i]});
  for (int pair = 0; pair < total - warmup; ++pair, i += 2) units.push_back({steps[i], steps[i + 1]});
  for (; i < steps.size(); ++i) units.push_back({steps[i]});
  return units;
}
}  // namespace bulkhead::parallel
