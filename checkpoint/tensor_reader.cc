#include "checkpoint/tensor_reader.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>

#include "checkpoint/box.h"
#include "checkpoint/inspect.h"
#include "checkpoint/reader.h"
#include "runtime/errors.h"

namespace bulkhead::checkpoint {

WholeTensorReader::WholeTensorReader(std::string stepFolder, int threads)
    : folder_(std::move(stepFolder)), manifest_(readManifest(folder_)) {
  checkCoverage(manifest_, 0);
  reader_ = std::make_unique<CheckpointReader>(folder_, manifest_, 0, std::max(1, threads));
}

WholeTensorReader::~WholeTensorReader() = default;

int64_t WholeTensorReader::bytesRead() const { return reader_->bytesRead(); }

at::Tensor WholeTensorReader::read(const std::string& key) {
  const int index = manifest_.findTensor(key);
  if (index < 0)
    throw CheckpointError(
        fmt::format("{} has no tensor '{}'; `bulkhead-ckpt inspect {}` lists what it holds", folder_, key, folder_),
        {.expected = "a key the manifest lists"});
  return read(index);
}

at::Tensor WholeTensorReader::read(int index) { return read(index, at::Tensor()); }

at::Tensor WholeTensorReader::read(int index, const at::Tensor& storage) {
  const TensorRecord& record = manifest_.tensors.at(static_cast<size_t>(index));
  const int64_t bytes = volume(record.globalShape) * static_cast<int64_t>(c10::elementSize(record.dtype));
  at::Tensor whole;
  if (storage.defined() && static_cast<int64_t>(storage.nbytes()) >= bytes)
    whole = at::from_blob(
        storage.data_ptr(), record.globalShape, [keep = storage](void*) {}, at::TensorOptions(record.dtype));
  else
    whole = at::empty(record.globalShape, at::TensorOptions(record.dtype));
  Region region;
  region.shape = record.globalShape.empty() ? std::vector<int64_t>{1} : record.globalShape;
  region.offsets.assign(region.shape.size(), 0);
  region.strides = contiguousStrides(region.shape);
  if (whole.numel() == 0) return whole;

  std::vector<CheckpointReader::Piece> pieces;
  for (int s : manifest_.slicesByTensor()[static_cast<size_t>(index)])
    for (int64_t chunk = 0; chunk < reader_->plan(s).count; ++chunk) pieces.push_back({s, chunk});
  std::vector<Box> boxes;
  boxes.reserve(pieces.size());
  for (const auto& piece : pieces)
    boxes.push_back(boxOf(reader_->plan(piece.slice), piece.chunk, manifest_.slices[piece.slice], region));
  auto* target = static_cast<uint8_t*>(whole.data_ptr());
  const int64_t elementSize = static_cast<int64_t>(whole.element_size());
  // Through the page cache: a checkpoint saved a moment ago is read from memory.
  reader_->read(pieces, [&](int, const CheckpointReader::Piece& piece, const uint8_t* bytes) {
    copyBox(bytes, target, boxes[static_cast<size_t>(&piece - pieces.data())], elementSize);
  });
  return whole;
}

}  // namespace bulkhead::checkpoint
