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
  if (schedule == PipelineSchedule::Interleaved && s.microBatches % s.stages != 0)
    throw ConfigError(fmt::format("pipeline: the interleaved schedule needs micro-batches ({}) to be a multiple of "
                                  "the pipeline size ({})",
                                  s.microBatches, s.stages),
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

}  // namespace

std::vector<PipelineStep> pipelineSteps(PipelineSchedule schedule, const PipelineShape& s) {
  validate(schedule, s);
  std::vector<PipelineStep> steps;
  const int total = s.microBatches * s.virtualStages;
  if (schedule == PipelineSchedule::AllForwardAllBackward) {
    for (int chunk = 0; chunk < s.virtualStages; ++chunk)
      for (int m = 0; m < s.microBatches; ++m) steps.push_back({true, chunk, m});
    for (int chunk = s.virtualStages - 1; chunk >= 0; --chunk)
      for (int m = 0; m < s.microBatches; ++m) steps.push_back({false, chunk, m});
    return steps;
  }
  int warmup;
  if (schedule == PipelineSchedule::OneFOneB) {
    warmup = std::min(s.stages - s.rank - 1, s.microBatches);
  } else if (s.microBatches == s.stages) {
    warmup = total;  // Megatron-LM: with M == P every forward comes first
  } else {
    warmup = std::min((s.stages - s.rank - 1) * 2 + (s.virtualStages - 1) * s.stages, total);
  }
  int forwards = 0, backwards = 0;
  for (; forwards < warmup; ++forwards) steps.push_back(virtualStep(s, forwards, true));
  while (forwards < total) {
    steps.push_back(virtualStep(s, forwards++, true));
    steps.push_back(virtualStep(s, backwards++, false));
  }
  while (backwards < total) steps.push_back(virtualStep(s, backwards++, false));
  return steps;
}

}  // namespace bulkhead::parallel
