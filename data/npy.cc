#include "data/npy.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>

#include "runtime/errors.h"
#include "runtime/fd.h"

namespace bulkhead::data {
namespace {

constexpr char kNpyMagic[] = "\x93NUMPY";

int itemBytes(const std::string& descr) {
  if (descr.size() != 3 || descr[0] != '<' || (descr[1] != 'i' && descr[1] != 'u')) return 0;
  switch (descr[2]) {
    case '1':
    case '2':
    case '4':
    case '8':
      return descr[2] - '0';
    default:
      return 0;
  }
}

ConfigError npyError(const std::string& path, const std::string& what) {
  return ConfigError(fmt::format("{}: {}; write it again (a cached index is rebuilt when deleted)", path, what),
                     {.expected = "a .npy file of a C-order little-endian integer array"});
}

// The value of `key` in the header's dict: "'descr': '<i8', 'fortran_order': False, 'shape': (3, 2), }".
std::string field(const std::string& header, const std::string& key, const std::string& path) {
  const size_t at = header.find("'" + key + "'");
  if (at == std::string::npos) throw npyError(path, fmt::format("its header has no '{}'", key));
  size_t begin = header.find(':', at);
  if (begin == std::string::npos) throw npyError(path, fmt::format("its header's '{}' has no value", key));
  ++begin;
  while (begin < header.size() && header[begin] == ' ') ++begin;
  size_t end = begin;
  if (begin < header.size() && header[begin] == '(') {
    end = header.find(')', begin);
    if (end == std::string::npos) throw npyError(path, "its header's shape is not closed");
    return header.substr(begin, end - begin + 1);
  }
  while (end < header.size() && header[end] != ',' && header[end] != '}') ++end;
  return header.substr(begin, end - begin);
}

std::vector<int64_t> parseShape(const std::string& text, const std::string& path) {
  std::vector<int64_t> shape;
  std::string digits;
  for (char c : text.substr(1)) {
    if (c >= '0' && c <= '9') {
      digits += c;
      if (digits.size() > 15) throw npyError(path, "a dimension of its shape is too large");
    } else if (c == ',' || c == ')') {
      if (!digits.empty()) shape.push_back(std::stoll(digits));
      digits.clear();
    } else if (c != ' ' && c != 'L') {
      throw npyError(path, fmt::format("its shape {} is not a tuple of sizes", text));
    }
  }
  return shape;
}

}  // namespace

int64_t NpyArray::elements() const {
  int64_t count = 1;
  for (int64_t d : shape) count *= d;
  return count;
}

int64_t NpyArray::at(int64_t i) const {
  const int item = itemBytes(descr);
  const uint8_t* p = bytes.data() + i * item;
  const bool isSigned = descr[1] == 'i';
  switch (item) {
    case 1:
      return isSigned ? int64_t{static_cast<int8_t>(*p)} : int64_t{*p};
    case 2: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return isSigned ? int64_t{static_cast<int16_t>(v)} : int64_t{v};
    }
    case 4: {
      uint32_t v;
      std::memcpy(&v, p, 4);
      return isSigned ? int64_t{static_cast<int32_t>(v)} : int64_t{v};
    }
    default: {
      uint64_t v;
      std::memcpy(&v, p, 8);
      if (!isSigned && v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        throw ConfigError(fmt::format("a uint64 value {} does not fit int64", v));
      return static_cast<int64_t>(v);
    }
  }
}

std::vector<int64_t> NpyArray::toInt64() const {
  std::vector<int64_t> values(static_cast<size_t>(elements()));
  for (int64_t i = 0; i < elements(); ++i) values[i] = at(i);
  return values;
}

NpyArray readNpy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw IoError(fmt::format("{}: cannot be opened ({})", path, std::strerror(errno)));
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (content.size() < 10 || content.compare(0, 6, kNpyMagic, 6) != 0) throw npyError(path, "it is not a .npy file");
  const int major = static_cast<uint8_t>(content[6]);
  size_t headerBytes = 0, start = 0;
  if (major == 1) {
    headerBytes = static_cast<uint8_t>(content[8]) | (static_cast<size_t>(static_cast<uint8_t>(content[9])) << 8);
    start = 10;
  } else if (major == 2 || major == 3) {
    if (content.size() < 12) throw npyError(path, "its header is truncated");
    for (int b = 0; b < 4; ++b) headerBytes |= static_cast<size_t>(static_cast<uint8_t>(content[8 + b])) << (8 * b);
    start = 12;
  } else {
    throw npyError(path, fmt::format("format version {} is not one of 1, 2, 3", major));
  }
  if (headerBytes > content.size() - start) throw npyError(path, "its header is truncated");
  const std::string header = content.substr(start, headerBytes);
  NpyArray array;
  std::string descr = field(header, "descr", path);
  if (descr.size() >= 2 && descr.front() == '\'' && descr.back() == '\'') descr = descr.substr(1, descr.size() - 2);
  if (descr.size() == 3 && descr[0] == '|' && descr[2] == '1') descr[0] = '<';
  if (itemBytes(descr) == 0) throw npyError(path, fmt::format("its dtype {} is not a little-endian integer", descr));
  array.descr = descr;
  if (field(header, "fortran_order", path) != "False") throw npyError(path, "it is in Fortran order");
  array.shape = parseShape(field(header, "shape", path), path);
  const size_t dataStart = start + headerBytes;
  int64_t elements = 1;
  for (int64_t d : array.shape)
    if (__builtin_mul_overflow(elements, d, &elements)) throw npyError(path, "its shape's element count overflows");
  if (elements < 0 || static_cast<uint64_t>(elements) > (content.size() - dataStart) / itemBytes(descr) ||
      content.size() - dataStart != static_cast<size_t>(elements) * itemBytes(descr))
    throw npyError(path, fmt::format("its shape asks for {} elements of {} bytes, the file holds {} bytes of data",
                                     elements, itemBytes(descr), content.size() - dataStart));
  array.bytes.assign(content.begin() + static_cast<std::ptrdiff_t>(dataStart), content.end());
  return array;
}

void writeNpy(const std::string& path, const std::string& descr, const std::vector<int64_t>& shape, const void* data) {
  const int item = itemBytes(descr);
  if (item == 0) throw ConfigError(fmt::format("{}: dtype {} is not a little-endian integer", path, descr));
  int64_t elements = 1;
  for (int64_t d : shape) elements *= d;
  // NumPy's repr of the shape: "()", "(5,)", "(3, 2)".
  std::string tuple = shape.size() == 1 ? fmt::format("({},)", shape[0]) : fmt::format("({})", fmt::join(shape, ", "));
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr, tuple);
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string file(kNpyMagic, 6);
  file += '\x01';
  file += '\x00';
  file += static_cast<char>(header.size() & 0xff);
  file += static_cast<char>(header.size() >> 8);
  file += header;
  const std::string partial = path + ".partial";
  Fd fd(::open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  auto fail = [&](int error) {
    ::unlink(partial.c_str());
    return IoError(fmt::format("{}: cannot be written ({})", partial, std::strerror(error)));
  };
  if (!fd.valid()) throw IoError(fmt::format("{}: cannot be created ({})", partial, std::strerror(errno)));
  if (int error = fd.writeAll(file.data(), file.size())) throw fail(error);
  if (int error = fd.writeAll(data, static_cast<size_t>(elements) * item)) throw fail(error);
  if (int error = fd.close()) throw fail(error);
  if (::rename(partial.c_str(), path.c_str()) != 0) throw fail(errno);
}

template <typename T>
void writeNpy(const std::string& path, std::span<const T> values, std::vector<int64_t> shape) {
  static_assert(std::is_integral_v<T>);
  if (shape.empty()) shape = {static_cast<int64_t>(values.size())};
  writeNpy(path, fmt::format("<{}{}", std::is_signed_v<T> ? 'i' : 'u', sizeof(T)), shape, values.data());
}

template void writeNpy<int16_t>(const std::string&, std::span<const int16_t>, std::vector<int64_t>);
template void writeNpy<int32_t>(const std::string&, std::span<const int32_t>, std::vector<int64_t>);
template void writeNpy<int64_t>(const std::string&, std::span<const int64_t>, std::vector<int64_t>);
template void writeNpy<uint32_t>(const std::string&, std::span<const uint32_t>, std::vector<int64_t>);

}  // namespace bulkhead::data
