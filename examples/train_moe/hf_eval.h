#pragma once
// train_moe --hf-model DIR (or --model-config FILE) --tokens FILE --steps 0 [--logits-out OUT]: a Hugging
// Face model at the run's layout, evaluated on given token ids (docs/train_moe.md#hugging-face-models):
// - the rows of input_ids split evenly over the data-parallel ranks (their count must divide by dp), pipeline
//   stage s holding layers [s L / pp, (s + 1) L / pp) and sending its activations to the next;
// - rank 0 prints the LM loss with transformers' convention (the labels are the ids, shifted inside the loss;
//   the mean over every predicted token), computed from the logits in the model's dtype (float32 for bf16);
// - with --logits-out, rank 0 writes the logits [rows, seq, vocab] as one safetensors file, a row at a time
//   from the last stage's ranks (each holds its rows' vocabulary block), so no rank holds more than its own
//   logits and one row of the whole.

#include "examples/train_moe/train_options.h"
#include "launch/init.h"

namespace bulkhead::examples {

// ConfigError (exit code 2) for a config, a weights folder or a tokens file that does not fit, before any
// forward. Collective over the world.
void evaluateHfModel(Runtime& runtime, const TrainOptions& options);

// The refusals of flags that do not go together (--tokens without --steps 0, both --hf-model and
// --model-config, ...), on every rank before anything is built.
void checkHfFlags(const TrainOptions& options, int rank);

}  // namespace bulkhead::examples
