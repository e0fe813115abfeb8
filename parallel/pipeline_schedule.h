#pragma once
// The order in which one pipeline rank runs its forward and backward passes.
//
// A model cut into P * V stages runs on a pp group of P ranks: rank r holds
// the V chunks r, P + r, 2P + r, ... (Megatron-LM's interleaved layout), so
// stage g = chunk * P + r. Activations of micro-batch m flow from stage g to
// g + 1 and their gradients back. Schedules, each a list per rank:
//   AllForwardAllBackward  every forward, then every backward: the simple
//                          reference; keeps all M micro-batches' activations.
//                          V > 1 goes through the chunks as the interleaved
//                          schedule does (M a multiple of P).
//   OneFOneB               (V = 1) P - r - 1 warm-up forwards, then one forward
//                          and one backward in turn, then the remaining
//                          backwards: the first stage keeps at most P
//                          micro-batches' activations.
//   Interleaved            1F1B over virtual micro-batches (Megatron-LM's
//                          interleaved schedule: (P - r - 1) * 2 + (V - 1) * P
//                          warm-up steps, every forward first when M == P); M
//                          must be a multiple of P. Meant for V > 1; at V = 1
//                          it runs, with more warm-up than OneFOneB.
// Backwards of one chunk run in micro-batch order, so gradients accumulate in
// the same order under every schedule.

#include <string>
#include <vector>

namespace bulkhead::parallel {

enum class PipelineSchedule { AllForwardAllBackward, OneFOneB, Interleaved };
const char* toString(PipelineSchedule schedule);

struct PipelineStep {
  bool forward = true;
  int chunk = 0;       // this rank's chunk (0 .. V-1)
  int microBatch = 0;  // 0 .. M-1
  bool operator==(const PipelineStep&) const = default;
};

struct PipelineShape {
  int stages = 1;         // P: ranks of the pp group
  int rank = 0;           // this rank in it
  int virtualStages = 1;  // V: chunks per rank
  int microBatches = 1;   // M
};

// This rank's steps under `schedule`; ConfigError for shapes it cannot run
// (OneFOneB with V > 1, M not a multiple of P when interleaving or running
// all forwards over several chunks).
std::vector<PipelineStep> pipelineSteps(PipelineSchedule schedule, const PipelineShape& shape);

// The same steps in the units a rank communicates between, as Megatron-LM's
// p2p layer does: each step alone (1F1B: a forward's send goes with the
// next backward's receive), or under the interleaved schedule a warm-up
// forward or cool-down backward alone and a steady-state forward with the
// backward after it. Before unit u a rank issues, grouped, the sends of unit
// u - 1 and the receives of unit u (interleaved: the forward direction's,
// then the backward's, so the forward computes while the backward's messages
// move). Under every schedule here each rank's sends to a peer then come in
// the order that peer receives them, and no exchange waits on a later one
// (pipeline_schedule_test checks both for P <= 8, V <= 4, M <= 16).
std::vector<std::vector<PipelineStep>> pipelineUnits(PipelineSchedule schedule, const PipelineShape& shape);

}  // namespace bulkhead::parallel
