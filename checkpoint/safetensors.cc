#include "checkpoint/safetensors.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "checkpoint/fs.h"
#include "runtime/errors.h"

namespace bulkhead::checkpoint {
namespace {

constexpr std::pair<c10::ScalarType, const char*> kNames[] = {
    {c10::ScalarType::Double, "F64"},    {c10::ScalarType::Float, "F32"}, {c10::ScalarType::Half, "F16"},
    {c10::ScalarType::BFloat16, "BF16"}, {c10::ScalarType::Long, "I64"},  {c10::ScalarType::Int, "I32"},
    {c10::ScalarType::Short, "I16"},     {c10::ScalarType::Char, "I8"},   {c10::ScalarType::Byte, "U8"},
    {c10::ScalarType::Bool, "BOOL"},
};

// No dimension above 2^40 and no tensor above 2^60 bytes: far beyond any
// real file, and products of such numbers cannot overflow.
constexpr int64_t kMaxDimension = int64_t{1} << 40;
constexpr int64_t kMaxBytes = int64_t{1} << 60;

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw CheckpointError(fmt::format("safetensors file {}: {}; the file is damaged or not a safetensors file (export "
                                    "or download it again)",
                                    path, what),
                        {.expected = "8-byte header length, a JSON header that matches the data, the data"});
}

// A non-negative JSON integer no greater than `limit`.
std::optional<int64_t> count(const nlohmann::json& value, int64_t limit) {
  if (!value.is_number_unsigned() && !value.is_number_integer()) return std::nullopt;
  if (value.is_number_integer() && !value.is_number_unsigned() && value.get<int64_t>() < 0) return std::nullopt;
  const uint64_t n = value.get<uint64_t>();
  if (n > static_cast<uint64_t>(limit)) return std::nullopt;
  return static_cast<int64_t>(n);
}

SafetensorsTensor parseEntry(const std::string& name, const nlohmann::json& entry, int64_t dataBytes,
                             const std::string& path) {
  if (name.empty()) bad(path, "a tensor without a name");
  if (!entry.is_object()) bad(path, fmt::format("tensor '{}' is not a JSON object", name));
  SafetensorsTensor tensor;
  tensor.name = name;
  auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) bad(path, fmt::format("tensor '{}' has no dtype", name));
  auto parsed = parseSafetensorsDtype(dtype->get<std::string>());
  if (!parsed)
    bad(path, fmt::format("tensor '{}' has dtype '{}', which Bulkhead does not read (F64, F32, F16, BF16, I64, I32, "
                          "I16, I8, U8, BOOL)",
                          name, dtype->get<std::string>()));
  tensor.dtype = *parsed;
  auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array() || shape->size() > 64)
    bad(path, fmt::format("tensor '{}' has no shape (a list of at most 64 dimensions)", name));
  int64_t bytes = static_cast<int64_t>(c10::elementSize(tensor.dtype));
  for (const auto& dim : *shape) {
    auto n = count(dim, kMaxDimension);
    if (!n) bad(path, fmt::format("tensor '{}' has a dimension that is not a non-negative integer below 2^40", name));
    tensor.shape.push_back(*n);
    if (*n != 0 && bytes > kMaxBytes / *n) bad(path, fmt::format("tensor '{}' is larger than 2^60 bytes", name));
    bytes *= *n;
  }
  auto offsets = entry.find("data_offsets");
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2)
    bad(path, fmt::format("tensor '{}' has no data_offsets [begin, end]", name));
  auto begin = count((*offsets)[0], dataBytes), end = count((*offsets)[1], dataBytes);
  if (!begin || !end || *begin > *end)
    bad(path, fmt::format("tensor '{}' has data_offsets outside the {} bytes of data that follow the header", name,
                          dataBytes));
  tensor.begin = *begin;
  tensor.end = *end;
  if (tensor.bytes() != bytes)
    bad(path, fmt::format("tensor '{}' takes {} bytes by its data_offsets but {} by its dtype and shape", name,
                          tensor.bytes(), bytes));
  return tensor;
}

int openForReading(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fs::raise(fmt::format("opening safetensors file {}", path), errno, -1);
  return fd;
}

int64_t readAt(int fd, void* target, int64_t size, int64_t offset) {
  int64_t done = 0;
  while (done < size) {
    ssize_t n = ::pread(fd, static_cast<char*>(target) + done, static_cast<size_t>(size - done), offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -1;
    if (n == 0) break;
    done += n;
  }
  return done;
}

}  // namespace

std::string safetensorsDtypeName(c10::ScalarType dtype) {
  for (const auto& [type, name] : kNames)
    if (type == dtype) return name;
  throw ConfigError(fmt::format("safetensors files here hold no tensors of dtype {}", c10::toString(dtype)),
                    {.expected = "float64/32/16, bfloat16, int64/32/16/8, uint8 or bool"});
}

std::optional<c10::ScalarType> parseSafetensorsDtype(const std::string& name) {
  for (const auto& [type, known] : kNames)
    if (name == known) return type;
  return std::nullopt;
}

SafetensorsHeader parseSafetensorsHeader(const std::string& json, int64_t fileBytes, const std::string& path) {
  SafetensorsHeader header;
  header.dataStart = 8 + static_cast<int64_t>(json.size());
  if (header.dataStart > fileBytes)
    bad(path, fmt::format("the header of {} bytes runs past the end of the file ({} bytes)", json.size(), fileBytes));
  header.dataBytes = fileBytes - header.dataStart;
  nlohmann::json root = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) bad(path, "the header is not valid JSON");
  if (!root.is_object()) bad(path, "the header is not a JSON object");
  for (const auto& [name, entry] : root.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) bad(path, "__metadata__ is not an object of strings");
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) bad(path, fmt::format("__metadata__ '{}' is not a string", key));
        header.metadata[key] = value.get<std::string>();
      }
      continue;
    }
    header.tensors.push_back(parseEntry(name, entry, header.dataBytes, path));
  }
  std::vector<const SafetensorsTensor*> byBegin;
  for (const auto& tensor : header.tensors)
    if (tensor.bytes() > 0) byBegin.push_back(&tensor);
  std::sort(byBegin.begin(), byBegin.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < byBegin.size(); ++i)
    if (byBegin[i]->begin < byBegin[i - 1]->end)
      bad(path, fmt::format("tensors '{}' and '{}' overlap in the data", byBegin[i - 1]->name, byBegin[i]->name));
  return header;
}

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)), fd_(openForReading(path_)) {
  auto size = fs::fileSize(path_);
  if (!size) bad(path_, "it is not a regular file");
  if (*size < 8) bad(path_, fmt::format("it has {} bytes, fewer than the 8 of the header length", *size));
  unsigned char prefix[8];
  const int64_t got = readAt(fd_.get(), prefix, 8, 0);
  if (got < 0) fs::raise(fmt::format("reading {}", path_), errno, -1);
  if (got != 8) bad(path_, "it ends within the header length");
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | prefix[i];
  if (length > static_cast<uint64_t>(*size - 8))
    bad(path_, fmt::format("its header length {} runs past the end of the file ({} bytes)", length, *size));
  if (length > static_cast<uint64_t>(kMaxSafetensorsHeader))
    bad(path_,
        fmt::format("its header length {} exceeds the format's limit of {} bytes", length, kMaxSafetensorsHeader));
  std::string json(length, '\0');
  const int64_t read = readAt(fd_.get(), json.data(), static_cast<int64_t>(length), 8);
  if (read < 0) fs::raise(fmt::format("reading the header of {}", path_), errno, -1);
  if (read != static_cast<int64_t>(length)) bad(path_, "it ends within its header");
  header_ = parseSafetensorsHeader(json, *size, path_);
}

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  for (const auto& tensor : header_.tensors)
    if (tensor.name == name) return &tensor;
  return nullptr;
}

void SafetensorsFile::readInto(const SafetensorsTensor& tensor, void* target) const {
  const int64_t n = readAt(fd_.get(), target, tensor.bytes(), header_.dataStart + tensor.begin);
  if (n < 0) fs::raise(fmt::format("reading tensor '{}' of {}", tensor.name, path_), errno, -1);
  if (n != tensor.bytes())
    throw IoError(fmt::format("{}: tensor '{}' ends after {} of its {} bytes: the file was truncated after it was "
                              "opened",
                              path_, tensor.name, n, tensor.bytes()),
                  {.expected = "a file that does not change while it is read"});
}

at::Tensor SafetensorsFile::read(const SafetensorsTensor& tensor) const {
  at::Tensor out = at::empty(tensor.shape, at::TensorOptions(tensor.dtype));
  readInto(tensor, out.data_ptr());
  return out;
}

at::Tensor SafetensorsFile::readBlock(const SafetensorsTensor& tensor, const std::vector<int64_t>& offsets,
                                      const std::vector<int64_t>& sizes, const at::Tensor& buffer) const {
  const size_t dims = tensor.shape.size();
  bool inside = offsets.size() == dims && sizes.size() == dims;
  for (size_t d = 0; inside && d < dims; ++d)
    inside = offsets[d] >= 0 && sizes[d] >= 0 && offsets[d] + sizes[d] <= tensor.shape[d];
  if (!inside)
    throw ConfigError(fmt::format("{}: tensor '{}' of shape [{}] has no block at [{}] of [{}]", path_, tensor.name,
                                  fmt::join(tensor.shape, ", "), fmt::join(offsets, ", "), fmt::join(sizes, ", ")),
                      {.expected = "a block inside the tensor's shape"});
  int64_t elements = 1;
  for (int64_t extent : sizes) elements *= extent;
  const bool reuse = buffer.defined() && buffer.is_contiguous() && buffer.device().is_cpu() &&
                     buffer.scalar_type() == tensor.dtype && buffer.numel() >= elements;
  at::Tensor out =
      reuse ? buffer.view({-1}).narrow(0, 0, elements).view(sizes) : at::empty(sizes, at::TensorOptions(tensor.dtype));
  if (out.numel() == 0) return out;
  // The innermost dimensions the block spans whole, with the first partial one, make one contiguous run.
  size_t inner = dims;
  int64_t run = 1;
  while (inner > 0) {
    run *= sizes[inner - 1];
    --inner;
    if (sizes[inner] != tensor.shape[inner]) break;
  }
  const int64_t item = static_cast<int64_t>(c10::elementSize(tensor.dtype));
  std::vector<int64_t> strides(dims, 1);
  for (size_t d = dims; d-- > 1;) strides[d - 1] = strides[d] * tensor.shape[d];
  const int64_t runs = out.numel() / run;
  auto* target = static_cast<char*>(out.data_ptr());
  std::vector<int64_t> index(inner, 0);  // the outer dimensions' position within the block
  for (int64_t r = 0; r < runs; ++r) {
    int64_t element = 0;
    for (size_t d = 0; d < dims; ++d) element += (offsets[d] + (d < inner ? index[d] : 0)) * strides[d];
    const int64_t bytes = run * item, at = header_.dataStart + tensor.begin + element * item;
    const int64_t n = readAt(fd_.get(), target + r * bytes, bytes, at);
    if (n < 0) fs::raise(fmt::format("reading tensor '{}' of {}", tensor.name, path_), errno, -1);
    if (n != bytes)
      throw IoError(
          fmt::format("{}: tensor '{}' ends inside the block read: the file was truncated after it was opened", path_,
                      tensor.name),
          {.expected = "a file that does not change while it is read"});
    for (size_t d = inner; d-- > 0;) {
      if (++index[d] < sizes[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

namespace {

constexpr int64_t kAlignment = 4096;
constexpr int64_t kStagingBytes = int64_t{32} << 20;
constexpr int64_t kDirectFrom = int64_t{64} << 20;  // smaller files go through the page cache

void writeAt(int fd, const char* bytes, int64_t size, int64_t offset, const std::string& path) {
  int64_t done = 0;
  while (done < size) {
    ssize_t n = ::pwrite(fd, bytes + done, static_cast<size_t>(size - done), offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fs::raise(fmt::format("writing {}", path), errno, -1);
    done += n;
  }
}

// An aligned write through `direct` (O_DIRECT); where the file system turns
// that down (EINVAL), the same bytes through `buffered`.
void writeDirect(int direct, int buffered, const char* bytes, int64_t size, int64_t offset, const std::string& path) {
  int64_t done = 0;
  while (done < size) {
    ssize_t n = ::pwrite(direct, bytes + done, static_cast<size_t>(size - done), offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EINVAL) return writeAt(buffered, bytes + done, size - done, offset + done, path);
    if (n < 0) fs::raise(fmt::format("writing {}", path), errno, -1);
    done += n;
  }
}

}  // namespace

void SafetensorsWriter::Aligned::operator()(uint8_t* p) const { std::free(p); }

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<SafetensorsTensor> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), partial_(path_ + ".partial"), tensors_(std::move(tensors)) {
  nlohmann::ordered_json root = nlohmann::ordered_json::object();
  if (!metadata.empty()) root["__metadata__"] = metadata;
  int64_t offset = 0;
  for (auto& tensor : tensors_) {
    int64_t bytes = static_cast<int64_t>(c10::elementSize(tensor.dtype));
    for (int64_t d : tensor.shape) bytes *= d;
    tensor.begin = offset;
    tensor.end = offset += bytes;
    root[tensor.name] = {{"dtype", safetensorsDtypeName(tensor.dtype)},
                         {"shape", tensor.shape},
                         {"data_offsets", {tensor.begin, tensor.end}}};
  }
  fd_ = Fd(::open(partial_.c_str(), O_CREAT | O_TRUNC | O_RDWR | O_CLOEXEC, 0644));
  if (!fd_.valid()) fs::raise(fmt::format("creating {}", partial_), errno, -1);
  if (offset >= kDirectFrom) {
    directFd_ = Fd(::open(partial_.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC));
    for (auto& buffer : staging_) {
      void* p = nullptr;
      if (!directFd_.valid() || ::posix_memalign(&p, kAlignment, kStagingBytes) != 0) break;
      buffer.reset(static_cast<uint8_t*>(p));
    }
    if (!staging_[0] || !staging_[1]) directFd_.reset();
  }
  std::string json = root.dump();
  // Whitespace after the JSON object is part of the header: it aligns the data
  // (8 bytes, as the format asks; 4 KiB for O_DIRECT).
  const int64_t align = directFd_.valid() ? kAlignment : 8;
  json.append(static_cast<size_t>((align - (8 + static_cast<int64_t>(json.size())) % align) % align), ' ');
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>(static_cast<uint64_t>(json.size()) >> (8 * i));
  head += json;
  writeAt(fd_.get(), head.data(), static_cast<int64_t>(head.size()), 0, partial_);
  dataStart_ = stagedAt_ = static_cast<int64_t>(head.size());
  fileBytes_ = dataStart_ + offset;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (inFlight_.valid()) inFlight_.wait();
  if (fd_.valid()) ::unlink(partial_.c_str());
}

void SafetensorsWriter::settle() {
  if (inFlight_.valid()) inFlight_.get();
}

void SafetensorsWriter::flushStaged() {
  settle();
  const char* bytes = reinterpret_cast<const char*>(staging_[current_].get());
  inFlight_ = std::async(std::launch::async, [this, bytes, size = staged_, at = stagedAt_] {
    writeDirect(directFd_.get(), fd_.get(), bytes, size, at, partial_);
  });
  stagedAt_ += staged_;
  staged_ = 0;
  current_ ^= 1;
}

void SafetensorsWriter::put(const char* bytes, int64_t size) {
  if (!directFd_.valid()) {
    writeAt(fd_.get(), bytes, size, dataStart_ + written_, partial_);
    return;
  }
  while (size > 0) {
    const int64_t part = std::min(size, kStagingBytes - staged_);
    std::memcpy(staging_[current_].get() + staged_, bytes, static_cast<size_t>(part));
    staged_ += part;
    bytes += part;
    size -= part;
    if (staged_ == kStagingBytes) flushStaged();
  }
}

void SafetensorsWriter::append(const void* bytes, int64_t size) {
  const char* at = static_cast<const char*>(bytes);
  while (size > 0) {
    while (next_ < tensors_.size() && written_ == tensors_[next_].end) ++next_;
    if (next_ == tensors_.size())
      throw ConfigError(fmt::format("{}: {} bytes more than its tensors hold", path_, size),
                        {.expected = "exactly each tensor's bytes, in header order"});
    const int64_t part = std::min(size, tensors_[next_].end - written_);
    put(at, part);
    written_ += part;
    at += part;
    size -= part;
  }
}

int64_t SafetensorsWriter::finish() {
  const int64_t expected = tensors_.empty() ? 0 : tensors_.back().end;
  if (written_ != expected)
    throw ConfigError(fmt::format("{}: {} of {} bytes of data written", path_, written_, expected),
                      {.expected = "every tensor's bytes before finish()"});
  if (directFd_.valid()) {
    settle();
    // The aligned part of what is left with O_DIRECT, the last partial block through the page cache.
    const char* bytes = reinterpret_cast<const char*>(staging_[current_].get());
    const int64_t aligned = staged_ / kAlignment * kAlignment;
    writeDirect(directFd_.get(), fd_.get(), bytes, aligned, stagedAt_, partial_);
    writeAt(fd_.get(), bytes + aligned, staged_ - aligned, stagedAt_ + aligned, partial_);
  }
  if (::fsync(fd_.get()) != 0) fs::raise(fmt::format("fsync of {}", partial_), errno, -1);
  directFd_.reset();
  if (const int error = fd_.close()) fs::raise(fmt::format("closing {}", partial_), error, -1);
  if (::rename(partial_.c_str(), path_.c_str()) != 0) fs::raise(fmt::format("renaming {}", partial_), errno, -1);
  return fileBytes_;
}

}  // namespace bulkhead::checkpoint
