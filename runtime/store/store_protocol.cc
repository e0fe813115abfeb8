#include "runtime/store/store_protocol.h"

#include <fmt/format.h>

#include <limits>

#include "runtime/errors.h"

namespace bulkhead::store_protocol {
namespace {

void appendLittleEndian(std::string& bytes, uint64_t value, int width) {
  for (int i = 0; i < width; ++i) bytes.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

uint64_t readLittleEndian(std::string_view bytes) {
  uint64_t value = 0;
  for (size_t i = 0; i < bytes.size(); ++i) value |= uint64_t(static_cast<unsigned char>(bytes[i])) << (8 * i);
  return value;
}

[[noreturn]] void malformed(const std::string& why) {
  throw CommError(fmt::format("malformed store message: {}", why),
                  {.expected = "a frame of the Bulkhead store protocol"});
}

}  // namespace

const char* toString(Op op) {
  switch (op) {
    case Op::Hello:
      return "hello";
    case Op::Set:
      return "set";
    case Op::Get:
      return "get";
    case Op::TryGet:
      return "tryGet";
    case Op::MultiGet:
      return "multiGet";
    case Op::Add:
      return "add";
    case Op::CompareSet:
      return "compareSet";
    case Op::Wait:
      return "wait";
    case Op::Erase:
      return "erase";
    case Op::MultiSet:
      return "multiSet";
    case Op::SetAndGather:
      return "setAndGather";
  }
  return "unknown";
}

FrameWriter::FrameWriter() { bytes_.resize(kHeaderBytes); }

FrameWriter& FrameWriter::u8(uint8_t value) {
  bytes_.push_back(static_cast<char>(value));
  return *this;
}

FrameWriter& FrameWriter::u32(uint32_t value) {
  appendLittleEndian(bytes_, value, 4);
  return *this;
}

FrameWriter& FrameWriter::i64(int64_t value) {
  appendLittleEndian(bytes_, static_cast<uint64_t>(value), 8);
  return *this;
}

FrameWriter& FrameWriter::str(std::string_view value) {
  if (value.size() > std::numeric_limits<uint32_t>::max())
    throw ConfigError(fmt::format("a store string of {} bytes does not fit in one message", value.size()));
  u32(static_cast<uint32_t>(value.size()));
  bytes_.append(value);
  return *this;
}

std::string FrameWriter::finish() {
  if (bodySize() > std::numeric_limits<uint32_t>::max())
    throw ConfigError(fmt::format("a store message of {} bytes does not fit in one frame", bodySize()));
  std::string header;
  appendLittleEndian(header, kMagic, 4);
  appendLittleEndian(header, bodySize(), 4);
  bytes_.replace(0, kHeaderBytes, header);
  return std::move(bytes_);
}

std::string_view FrameReader::take(size_t size) {
  if (size > body_.size() - offset_)
    malformed(fmt::format("a field of {} bytes at offset {} runs past the end of a {}-byte body", size, offset_,
                          body_.size()));
  std::string_view field = body_.substr(offset_, size);
  offset_ += size;
  return field;
}

uint8_t FrameReader::u8() { return static_cast<uint8_t>(take(1)[0]); }
uint32_t FrameReader::u32() { return static_cast<uint32_t>(readLittleEndian(take(4))); }
int64_t FrameReader::i64() { return static_cast<int64_t>(readLittleEndian(take(8))); }

std::string FrameReader::str() {
  uint32_t size = u32();
  return std::string(take(size));
}

uint32_t FrameReader::count(size_t minItemBytes) {
  uint32_t items = u32();
  if (minItemBytes > 0 && items > (body_.size() - offset_) / minItemBytes)
    malformed(fmt::format("{} items cannot fit in the {} bytes left", items, body_.size() - offset_));
  return items;
}

void FrameReader::expectEnd() const {
  if (offset_ != body_.size())
    malformed(fmt::format("{} bytes left over after the last field", body_.size() - offset_));
}

std::optional<uint32_t> bodyLength(std::string_view header) {
  if (header.size() < kHeaderBytes || readLittleEndian(header.substr(0, 4)) != kMagic) return std::nullopt;
  return static_cast<uint32_t>(readLittleEndian(header.substr(4, 4)));
}

std::string refusalFrame(Refusal reason, std::string_view text) {
  return FrameWriter().u8(static_cast<uint8_t>(Status::Refused)).u8(static_cast<uint8_t>(reason)).str(text).finish();
}

bool sameToken(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;  // the length is not what a token keeps secret
  unsigned char difference = 0;
  for (size_t i = 0; i < a.size(); ++i)
    difference |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i]);
  return difference == 0;
}

}  // namespace bulkhead::store_protocol
