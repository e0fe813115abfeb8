#pragma once
// The TCP store's wire format, shared by the server and the client.
//
// Every message is one frame: an 8-byte header, then the body.
//   header: magic u32 ("BKST"), body length u32, both little-endian
//   request body: op u8, then the op's fields
//   reply body:   status u8, then the reply's fields (Refused: reason u8, text;
//                 TimedOut: the keys still missing, as a u32 count and strings)
// Fields: u8, u32 and i64 little-endian; a string is a u32 length and its
// bytes (binary-safe). A body longer than the receiver's maxMessageBytes is
// refused from its header, before anything is allocated for it.
//
// A connection opens with Hello (protocol version, token). The server answers
// each request with exactly one reply, in order. Get and Wait carry a timeout
// in milliseconds (kNoTimeout: none) and are answered when their keys exist,
// or with TimedOut when the timeout passes first.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace bulkhead::store_protocol {

constexpr uint32_t kMagic = 0x5453'4B42;  // "BKST" read as little-endian bytes
constexpr uint32_t kVersion = 1;
constexpr size_t kHeaderBytes = 8;

enum class Op : uint8_t { Hello = 1, Set, Get, TryGet, MultiGet, Add, CompareSet, Wait, Erase, MultiSet, SetAndGather };
constexpr uint32_t kNoTimeout = 0xffff'ffff;

enum class Status : uint8_t { Ok = 0, Refused = 1, TimedOut = 2 };
// Why a request was refused; the client maps each to an error type.
enum class Refusal : uint8_t { Unauthorized = 1, Malformed, TooLarge, NotAnInteger, BadRequest };

const char* toString(Op op);

// Builds one frame: fields are appended to the body; finish() writes the
// header and hands the frame over.
class FrameWriter {
 public:
  FrameWriter();
  FrameWriter& u8(uint8_t value);
  FrameWriter& u32(uint32_t value);
  FrameWriter& i64(int64_t value);
  FrameWriter& str(std::string_view value);
  size_t bodySize() const { return bytes_.size() - kHeaderBytes; }
  std::string finish();

 private:
  std::string bytes_;
};

// Reads the fields of one frame body. Any read past the end, or a length
// that does not fit in what is left, raises CommError ("malformed store
// message"); nothing is allocated beyond the body's own size.
class FrameReader {
 public:
  explicit FrameReader(std::string_view body) : body_(body) {}
  uint8_t u8();
  uint32_t u32();
  int64_t i64();
  std::string str();
  // A count of items, each at least `minItemBytes` long: refused when the rest
  // of the body cannot hold them.
  uint32_t count(size_t minItemBytes);
  // Raises CommError unless every byte was read.
  void expectEnd() const;

 private:
  std::string_view take(size_t size);
  std::string_view body_;
  size_t offset_ = 0;
};

// The body length a header announces, or nullopt when its magic is wrong.
std::optional<uint32_t> bodyLength(std::string_view header);

// A reply of status Refused.
std::string refusalFrame(Refusal reason, std::string_view text);

// Compares tokens in time that does not depend on where they differ.
bool sameToken(std::string_view a, std::string_view b);

}  // namespace bulkhead::store_protocol
