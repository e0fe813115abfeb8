// diffCheckpoints (convert.h): every key of two checkpoints, compared as whole
// tensors, whatever layouts saved them.

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstring>
#include <map>

#include "checkpoint/convert.h"
#include "checkpoint/dtype.h"
#include "checkpoint/inspect.h"
#include "checkpoint/state_dict.h"
#include "checkpoint/tensor_reader.h"

namespace bulkhead::checkpoint {
namespace {

KeyDiff compare(const std::string& key, const at::Tensor& a, const at::Tensor& b, const DiffOptions& options) {
  KeyDiff diff{key};
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) {
    diff.kind = KeyDiff::Kind::Differs;
    diff.detail = fmt::format("{} [{}] against {} [{}]", dtypeName(a.scalar_type()), fmt::join(a.sizes(), ", "),
                              dtypeName(b.scalar_type()), fmt::join(b.sizes(), ", "));
    return diff;
  }
  if (a.nbytes() == 0 || std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0) return diff;  // equal, bit for bit
  at::Tensor x = a.to(at::kDouble), y = b.to(at::kDouble);
  at::Tensor gap = (x - y).abs();
  // NaN against NaN counts as equal; NaN against a number as infinitely far.
  const at::Tensor bothNan = x.isnan().logical_and(y.isnan());
  gap = at::where(bothNan, at::zeros_like(gap), at::where(gap.isnan(), at::full_like(gap, INFINITY), gap));
  at::Tensor scale = y.abs();
  at::Tensor relative = at::where(gap == 0, at::zeros_like(gap), gap / scale);
  diff.maxAbs = gap.max().item<double>();
  diff.maxRel = relative.max().item<double>();
  const bool close = (gap <= options.atol + options.rtol * scale).all().item<bool>();
  diff.kind = close ? KeyDiff::Kind::Close : KeyDiff::Kind::Differs;
  return diff;
}

}  // namespace

int DiffReport::count(KeyDiff::Kind kind) const {
  int n = 0;
  for (const auto& key : keys) n += key.kind == kind;
  return n;
}

DiffReport diffCheckpoints(const DiffOptions& options) {
  DiffReport report;
  report.folderA = resolveStepFolder(options.a, options.stepA);
  report.folderB = resolveStepFolder(options.b, options.stepB);
  WholeTensorReader a(report.folderA, options.threads), b(report.folderB, options.threads);
  std::map<std::string, std::pair<int, int>> keys;  // key -> index in a, in b (-1: absent)
  for (size_t t = 0; t < a.manifest().tensors.size(); ++t)
    if (!isReservedKey(a.manifest().tensors[t].key)) keys[a.manifest().tensors[t].key] = {static_cast<int>(t), -1};
  for (size_t t = 0; t < b.manifest().tensors.size(); ++t) {
    const std::string& key = b.manifest().tensors[t].key;
    if (isReservedKey(key)) continue;
    auto [at, fresh] = keys.emplace(key, std::make_pair(-1, static_cast<int>(t)));
    if (!fresh) at->second.second = static_cast<int>(t);
  }
  for (const auto& [key, where] : keys) {
    if (where.second < 0) {
      report.keys.push_back({key, KeyDiff::Kind::OnlyInA});
    } else if (where.first < 0) {
      report.keys.push_back({key, KeyDiff::Kind::OnlyInB});
    } else {
      report.keys.push_back(compare(key, a.read(where.first), b.read(where.second), options));
    }
  }
  return report;
}

}  // namespace bulkhead::checkpoint
