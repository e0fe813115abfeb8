#include "examples/train_moe/data.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include <array>
#include <vector>

#include "runtime/errors.h"

namespace bulkhead::examples {
namespace {

// splitmix64: a well-mixed 64-bit value from any 64-bit input.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

std::string generateCorpus(uint64_t seed, size_t bytes) {
  const std::array<const char*, 8> subjects{"the cat",   "a dog",  "the old man", "my sister",
                                            "the robot", "a bird", "the teacher", "our neighbour"};
  const std::array<const char*, 8> verbs{"sees", "likes", "follows", "paints", "finds", "carries", "hears", "greets"};
  const std::array<const char*, 8> objects{"the red ball", "a small house", "the river",  "a green apple",
                                           "the moon",     "an open door",  "the garden", "a quiet song"};
  const std::array<const char*, 4> endings{" today.", " every morning.", " again.", "."};
  std::string text;
  uint64_t state = seed;
  while (text.size() < bytes) {
    auto pick = [&](size_t n) { return (state = mix(state)) % n; };
    text += subjects[pick(subjects.size())];
    text += ' ';
    text += verbs[pick(verbs.size())];
    text += ' ';
    text += objects[pick(objects.size())];
    text += endings[pick(endings.size())];
    text += pick(5) == 0 ? '\n' : ' ';
  }
  text.resize(bytes);
  return text;
}

Batches::Batches(std::string text, int sequence, int globalBatch, uint64_t seed)
    : text_(std::move(text)), sequence_(sequence), globalBatch_(globalBatch), seed_(seed) {
  if (static_cast<int64_t>(text_.size()) <= sequence_ + 1) {
    throw ConfigError(
        fmt::format("data: a corpus of {} bytes is too short for sequences of {}", text_.size(), sequence_),
        {.expected = "corpus longer than the sequence length + 1"});
  }
}

TokenBatch Batches::batch(int64_t step, int rank, int ranks, c10::Device device) const {
  if (globalBatch_ % ranks != 0) {
    throw ConfigError(fmt::format("data: a global batch of {} sequences does not split over {} data-parallel ranks",
                                  globalBatch_, ranks),
                      {.rank = rank, .expected = "global batch a multiple of dp"});
  }
  const int local = globalBatch_ / ranks;
  // Page-locked on the way to a GPU, so the copy does not wait for the work
  // queued before it: the host goes on queueing the step meanwhile.
  at::Tensor window = at::empty({local, sequence_ + 1}, at::TensorOptions(at::kLong).pinned_memory(device.is_cuda()));
  auto data = window.accessor<int64_t, 2>();
  const uint64_t span = text_.size() - sequence_ - 1;
  for (int row = 0; row < local; ++row) {
    const uint64_t sequenceIndex = static_cast<uint64_t>(step) * globalBatch_ + rank * local + row;
    const uint64_t start = mix(seed_ ^ mix(sequenceIndex)) % span;
    for (int position = 0; position <= sequence_; ++position)
      data[row][position] = static_cast<unsigned char>(text_[start + position]);
  }
  window = window.to(device, /*non_blocking=*/true);
  const int64_t firstKey = (step * globalBatch_ + rank * local) * int64_t{sequence_};
  at::Tensor keys =
      at::arange(firstKey, firstKey + int64_t{local} * sequence_, at::TensorOptions(at::kLong).device(device));
  return {.ids = window.narrow(1, 0, sequence_).contiguous(),
          .targets = window.narrow(1, 1, sequence_).contiguous(),
          .keys = keys.view({local, sequence_})};
}

DatasetBatches::DatasetBatches(std::shared_ptr<const data::SampleSource> source, DatasetBatchOptions options)
    : source_(std::move(source)), options_(std::move(options)) {}

TokenBatch DatasetBatches::batch(int64_t step, int rank, int ranks, c10::Device device) const {
  const int B = options_.globalBatch, sequence = source_->sequence();
  if (B % ranks != 0)
    throw ConfigError(
        fmt::format("data: a global batch of {} sequences does not split over {} data-parallel ranks", B, ranks),
        {.rank = rank, .expected = "global batch a multiple of dp"});
  const int local = B / ranks;
  const int64_t first = firstSampleOf(step) + int64_t{rank} * local;
  if (first < 0 || first + local > source_->size())
    throw ConfigError(fmt::format("data: step {} reads {} samples {} to {}, past the {} the dataset built", step,
                                  options_.what, first, first + local, source_->size()),
                      {.rank = rank, .expected = "steps within the schedule the dataset was built for"});
  at::Tensor window = at::empty({local, sequence + 1}, at::TensorOptions(at::kLong).pinned_memory(device.is_cuda()));
  int64_t* rows = window.data_ptr<int64_t>();
  for (int row = 0; row < local; ++row) source_->sample(first + row, rows + int64_t{row} * (sequence + 1));
  for (int64_t i = 0; i < int64_t{local} * (sequence + 1); ++i) {
    if (rows[i] >= 0 && rows[i] < options_.vocab) continue;
    throw ConfigError(fmt::format("data: {} sample {} holds token id {}, outside the model's vocabulary of {}",
                                  options_.what, first + i / (sequence + 1), rows[i], options_.vocab),
                      {.rank = rank, .expected = options_.vocabHint});
  }
  at::Tensor mask;
  if (options_.eodMask >= 0) {  // Megatron's loss_mask[tokens == eod] = 0, on the inputs
    mask = window.narrow(1, 0, sequence).ne(options_.eodMask).to(at::kFloat).to(device, /*non_blocking=*/true);
  }
  window = window.to(device, /*non_blocking=*/true);
  const int64_t firstKey = (step * B + int64_t{rank} * local) * sequence;
  at::Tensor keys =
      at::arange(firstKey, firstKey + int64_t{local} * sequence, at::TensorOptions(at::kLong).device(device));
  return {.ids = window.narrow(1, 0, sequence).contiguous(),
          .targets = window.narrow(1, 1, sequence).contiguous(),
          .keys = keys.view({local, sequence}),
          .lossMask = mask};
}

}  // namespace bulkhead::examples
