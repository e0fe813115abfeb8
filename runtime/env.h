#pragma once
// The registry of every BULKHEAD_* environment knob (docs/design.md#deadlines).
// Each knob is declared once, in env.cc, with its default and a line of help;
// the README lists them all (a test keeps the two in step). A knob's value is
// read from the environment once, on first use.

#include <cstdint>
#include <string>
#include <vector>

namespace bulkhead::env {

class Knob {
 public:
  constexpr Knob(const char* name, const char* defaultValue, const char* help)
      : name_(name), defaultValue_(defaultValue), help_(help) {}

  const char* name() const { return name_; }
  const char* defaultValue() const { return defaultValue_; }
  const char* help() const { return help_; }
  bool isSet() const;  // set in the environment (even if equal to the default)

  // Typed reads; a value that does not parse is a ConfigError naming the knob.
  std::string text() const;
  double seconds() const;  // a positive number of seconds
  int64_t integer() const;
  bool flag() const;  // 1/0, true/false, yes/no, on/off

 private:
  const char* name_;
  const char* defaultValue_;
  const char* help_;
};

extern const Knob kLogLevel;
extern const Knob kBackend;
extern const Knob kBootstrap;
extern const Knob kInitTimeout;
extern const Knob kCollectiveTimeout;
extern const Knob kCheckpointTimeout;
extern const Knob kShutdownTimeout;
extern const Knob kAbortGrace;
extern const Knob kLedgerCapacity;
extern const Knob kStoreToken;
extern const Knob kStoreHost;
extern const Knob kStoreAddr;
extern const Knob kRunId;
extern const Knob kHeartbeat;
extern const Knob kNodeRelay;
extern const Knob kStrict;
extern const Knob kPeerAllReduce;
extern const Knob kPeerAllReduceBytes;
extern const Knob kGroupedProducts;
extern const Knob kLedgerDump;
extern const Knob kFault;
extern const Knob kStoreMaxMessage;
extern const Knob kCheckpointThreads;
extern const Knob kCheckpointNice;
extern const Knob kCheckpointFault;

// Every knob, in the order the README lists them.
const std::vector<const Knob*>& all();

// Tests only: forget cached values so the next read sees the environment again.
void forgetCachedValues();

}  // namespace bulkhead::env
