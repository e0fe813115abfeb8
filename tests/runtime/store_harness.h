#pragma once
// Shared pieces of the store tests: one harness per Store implementation (a
// TCP server with its clients in this process, or a fresh temporary
// directory), random binary values, and timing of calls that must fail.

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>

#include "runtime/deadline.h"
#include "runtime/errors.h"
#include "runtime/store/file_store.h"
#include "runtime/store/tcp_store.h"
#include "tests/support/catch_compat.h"
#include "tests/support/temp_dir.h"

namespace bulkhead::testing {

using Clock = std::chrono::steady_clock;

// A deadline `value` seconds from now.
inline Deadline seconds(double value) { return Deadline::afterSeconds(value); }

// `size` random bytes; every 7th byte is '\0', so values always hold some.
inline std::string randomBytes(std::mt19937_64& rng, size_t size) {
  std::string bytes(size, '\0');
  for (size_t i = 0; i < size; ++i) bytes[i] = i % 7 == 3 ? '\0' : static_cast<char>(rng() & 0xff);
  return bytes;
}

// Printable random text (keys, tokens).
inline std::string randomWord(std::mt19937_64& rng, size_t size) {
  static const char* letters = "abcdefghijklmnopqrstuvwxyz0123456789";
  std::string word(size, 'x');
  for (char& c : word) c = letters[rng() % 36];
  return word;
}

// Runs `call`, which must raise E; returns the error and how long the call took.
template <typename E, typename Call>
std::pair<E, double> expectError(Call&& call) {
  auto started = Clock::now();
  try {
    call();
  } catch (const E& error) {
    return {error, secondsSince(started)};
  }
  FAIL("the call returned instead of raising the expected error");
  throw std::logic_error("unreachable");
}

struct TcpHarness {
  static constexpr const char* kind = "tcp";
  std::mt19937_64 rng{0x7c9a11};
  std::string token = randomWord(rng, 24);
  TcpStoreServer server{{.host = "127.0.0.1", .port = 0, .token = token}};

  TcpStoreOptions clientOptions() const { return {.host = "127.0.0.1", .port = server.port(), .token = token}; }
  std::shared_ptr<Store> client() { return std::make_shared<TcpStoreClient>(clientOptions()); }
};

struct FileHarness {
  static constexpr const char* kind = "file";
  TempDir directory{"bulkhead-store"};

  std::shared_ptr<Store> client() { return std::make_shared<FileStore>(directory.path()); }
};

}  // namespace bulkhead::testing
