#include "checkpoint/manifest.h"

#include <fmt/format.h>

#include <charconv>
#include <string_view>

#include "checkpoint/checksum.h"
#include "checkpoint/dtype.h"
#include "checkpoint/fs.h"
#include "runtime/errors.h"

namespace bulkhead::checkpoint {
namespace {

constexpr std::string_view kMagic = "bulkhead-checkpoint 1";

std::vector<std::string_view> split(std::string_view line) {
  std::vector<std::string_view> tokens;
  size_t start = 0;
  while (start < line.size()) {
    size_t end = line.find(' ', start);
    if (end == std::string_view::npos) end = line.size();
    if (end > start) tokens.push_back(line.substr(start, end - start));
    start = end + 1;
  }
  return tokens;
}

template <typename T>
bool parseNumber(std::string_view text, T& value, int base = 10) {
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value, base);
  return error == std::errc() && end == text.data() + text.size();
}

}  // namespace

std::string escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (unsigned char c : text) {
    if (c <= ' ' || c >= 0x7f || c == '%')
      out += fmt::format("%{:02X}", c);
    else
      out += static_cast<char>(c);
  }
  return out.empty() ? "%" : out;  // "%" alone: the empty string (a token is never empty)
}

std::optional<std::string> unescape(const std::string& text) {
  if (text == "%") return std::string();
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '%') {
      out += text[i];
      continue;
    }
    unsigned value = 0;
    if (i + 2 >= text.size()) return std::nullopt;
    if (!parseNumber(std::string_view(text).substr(i + 1, 2), value, 16)) return std::nullopt;
    out += static_cast<char>(value);
    i += 2;
  }
  return out;
}

std::string formatDims(const std::vector<int64_t>& dims) {
  if (dims.empty()) return "-";
  std::string out;
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(dims[i]);
  }
  return out;
}

std::optional<std::vector<int64_t>> parseDims(const std::string& text) {
  std::vector<int64_t> dims;
  if (text == "-") return dims;
  size_t start = 0;
  for (;;) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    int64_t value = 0;
    if (!parseNumber(std::string_view(text).substr(start, end - start), value) || value < 0) return std::nullopt;
    dims.push_back(value);
    if (end == text.size()) return dims;
    start = end + 1;
  }
}

int64_t volume(const std::vector<int64_t>& dims) {
  int64_t count = 1;
  for (int64_t d : dims) count *= d;
  return count;
}

std::string Manifest::serialize() const {
  std::string out;
  out.reserve(128 + slices.size() * 96 + tensors.size() * 64);
  out += fmt::format("{}\nstep {}\njob {}\nworld_size {}\ncreated {:.3f}\nlayout {}\n", kMagic, step, escape(job),
                     worldSize, created, layout ? escape(layout->text()) : "-");
  for (const auto& file : files) out += fmt::format("file {} {} {}\n", file.rank, escape(file.name), file.bytes);
  for (const auto& tensor : tensors)
    out +=
        fmt::format("tensor {} {} {}\n", escape(tensor.key), dtypeName(tensor.dtype), formatDims(tensor.globalShape));
  for (const auto& slice : slices)
    out += fmt::format("slice {} {} {} {} {} {}\n", slice.tensor, slice.rank, escape(slice.dataset),
                       formatDims(slice.offsets), formatDims(slice.shape), hex64(slice.digest));
  out += fmt::format("checksum {}\n", hex64(Hash64().add(out).value()));
  return out;
}

Manifest Manifest::parse(const std::string& text, const std::string& path, int rank) {
  auto fail = [&](const std::string& what) -> CheckpointError {
    return CheckpointError(fmt::format("the manifest {} {}; it was edited or damaged after the save: load another "
                                       "step, or run `bulkhead-ckpt verify {}`",
                                       path, what, fs::parent(path)),
                           {.rank = rank, .expected = "a manifest whose checksum matches its content"});
  };
  size_t last = text.rfind("checksum ", text.size() >= 2 ? text.size() - 2 : 0);
  if (text.rfind(kMagic, 0) != 0) throw fail("does not start with the format line");
  if (last == std::string::npos || (last > 0 && text[last - 1] != '\n') || text.back() != '\n')
    throw fail("has no final checksum line (is it truncated?)");
  std::string_view body(text.data(), last);
  std::string stated = text.substr(last + 9, text.size() - last - 10);
  std::string actual = hex64(Hash64().add(body).value());
  if (stated != actual) throw fail(fmt::format("has checksum {} but its content hashes to {}", stated, actual));

  Manifest manifest;
  size_t lineNumber = 0, start = 0;
  bool haveStep = false, haveWorld = false;
  while (start < body.size()) {
    size_t end = body.find('\n', start);
    if (end == std::string_view::npos) end = body.size();
    std::string_view line = body.substr(start, end - start);
    start = end + 1;
    ++lineNumber;
    if (lineNumber == 1) continue;  // the format line, checked above
    auto tokens = split(line);
    auto bad = [&] { return fail(fmt::format("has a malformed line {}: '{}'", lineNumber, line.substr(0, 120))); };
    if (tokens.empty()) throw bad();
    auto string = [&](size_t i) {
      auto value = unescape(std::string(tokens[i]));
      if (!value) throw bad();
      return *value;
    };
    auto dims = [&](size_t i) {
      auto value = parseDims(std::string(tokens[i]));
      if (!value) throw bad();
      return *value;
    };
    std::string_view kind = tokens[0];
    if (kind == "step" && tokens.size() == 2) {
      if (!parseNumber(tokens[1], manifest.step)) throw bad();
      haveStep = true;
    } else if (kind == "job" && tokens.size() == 2) {
      manifest.job = string(1);
    } else if (kind == "world_size" && tokens.size() == 2) {
      if (!parseNumber(tokens[1], manifest.worldSize) || manifest.worldSize < 1) throw bad();
      haveWorld = true;
    } else if (kind == "created" && tokens.size() == 2) {
      manifest.created = std::strtod(std::string(tokens[1]).c_str(), nullptr);
    } else if (kind == "layout" && tokens.size() == 2) {
      if (tokens[1] != "-") {
        manifest.layout = LayoutRecord::parse(string(1));
        if (!manifest.layout) throw bad();
      }
    } else if (kind == "file" && tokens.size() == 4) {
      FileRecord file;
      if (!parseNumber(tokens[1], file.rank) || !parseNumber(tokens[3], file.bytes)) throw bad();
      file.name = string(2);
      manifest.files.push_back(std::move(file));
    } else if (kind == "tensor" && tokens.size() == 4) {
      TensorRecord tensor;
      tensor.key = string(1);
      auto dtype = parseDtype(std::string(tokens[2]));
      if (!dtype) throw bad();
      tensor.dtype = *dtype;
      tensor.globalShape = dims(3);
      manifest.tensors.push_back(std::move(tensor));
    } else if (kind == "slice" && tokens.size() == 7) {
      SliceRecord slice;
      if (!parseNumber(tokens[1], slice.tensor) || !parseNumber(tokens[2], slice.rank) ||
          !parseNumber(tokens[6], slice.digest, 16))
        throw bad();
      if (slice.tensor < 0 || slice.tensor >= static_cast<int>(manifest.tensors.size())) throw bad();
      slice.dataset = string(3);
      slice.offsets = dims(4);
      slice.shape = dims(5);
      manifest.slices.push_back(std::move(slice));
    } else {
      throw bad();
    }
  }
  if (!haveStep || !haveWorld) throw fail("lacks its step or world size");
  std::vector<char> hasFile(static_cast<size_t>(manifest.worldSize), 0);
  for (const auto& file : manifest.files)
    if (file.rank >= 0 && file.rank < manifest.worldSize) hasFile[file.rank] = 1;
  for (const auto& slice : manifest.slices)
    if (slice.rank < 0 || slice.rank >= manifest.worldSize || !hasFile[slice.rank])
      throw fail(fmt::format("lists a slice of rank {} without a file of that rank", slice.rank));
  return manifest;
}

int Manifest::findTensor(const std::string& key) const {
  if (byKey_.size() != tensors.size()) {
    byKey_.clear();
    for (size_t i = 0; i < tensors.size(); ++i) byKey_.emplace(tensors[i].key, static_cast<int>(i));
  }
  auto it = byKey_.find(key);
  return it == byKey_.end() ? -1 : it->second;
}

const std::vector<std::vector<int>>& Manifest::slicesByTensor() const {
  if (byTensor_.size() != tensors.size() || indexedSlices_ != slices.size()) {
    indexedSlices_ = slices.size();
    byTensor_.assign(tensors.size(), {});
    for (size_t i = 0; i < slices.size(); ++i) byTensor_[slices[i].tensor].push_back(static_cast<int>(i));
  }
  return byTensor_;
}

int64_t Manifest::totalBytes() const {
  int64_t bytes = 0;
  for (const auto& file : files) bytes += file.bytes;
  return bytes;
}

}  // namespace bulkhead::checkpoint
