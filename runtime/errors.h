#pragma once
// The one hierarchy of Bulkhead errors (docs/design.md#errors).
// Every error carries the rank that saw it, the group it concerns (empty when
// none applies) and what was expected; what() says what happened, where, and
// what to do next. Backend return codes are converted in exactly one place per
// library (runtime/mpi/mpi_check.h, runtime/nccl/nccl_check.h, HDF5 in checkpoint/).

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace bulkhead {

struct ErrorContext {
  int rank = -1;         // the rank that raised it; -1 before the world is known
  std::string group;     // e.g. "ep[1]"; empty when no group applies
  std::string expected;  // what the caller or the contract expected
};

class Error : public std::runtime_error {
 public:
  Error(const std::string& message, ErrorContext context = {}) : Error("Error", message, std::move(context)) {}
  int rank() const { return context_.rank; }
  const std::string& group() const { return context_.group; }
  const std::string& expected() const { return context_.expected; }
  // The message without the rank/group prefix.
  const std::string& message() const { return message_; }
  // Process exit code for a job that stops on this error: 2 config, 3 timeout,
  // 4 desync, 5 comm, 6 io, 7 checkpoint.
  virtual int exitCode() const { return 1; }
  const char* kind() const { return kind_; }

 protected:
  Error(const char* kind, const std::string& message, ErrorContext context);

 private:
  const char* kind_;
  std::string message_;
  ErrorContext context_;
};

// A bad parallel layout, a bad argument, an unusable environment. Raised before
// any communication starts.
class ConfigError : public Error {
 public:
  ConfigError(const std::string& message, ErrorContext context = {})
      : Error("ConfigError", message, std::move(context)) {}
  int exitCode() const override { return 2; }
};

// A deadline passed. Holds the diagnosis: the operation, its sequence number
// and, once the ledger diagnosis runs, which ranks lag.
class TimeoutError : public Error {
 public:
  TimeoutError(const std::string& message, ErrorContext context, uint64_t sequence = 0, std::string diagnosis = {});
  uint64_t sequence() const { return sequence_; }
  const std::string& diagnosis() const { return diagnosis_; }
  int exitCode() const override { return 3; }

 private:
  uint64_t sequence_;
  std::string diagnosis_;
};

// Ranks of one group issued different collectives at the same sequence number.
class DesyncError : public Error {
 public:
  DesyncError(const std::string& message, ErrorContext context = {})
      : Error("DesyncError", message, std::move(context)) {}
  int exitCode() const override { return 4; }
};

// The communication backend failed (MPI, NCCL, CUDA), or a communicator was
// used after it was aborted.
class CommError : public Error {
 public:
  CommError(const std::string& message, ErrorContext context = {}) : Error("CommError", message, std::move(context)) {}
  int exitCode() const override { return 5; }
};

class IoError : public Error {
 public:
  IoError(const std::string& message, ErrorContext context = {}) : Error("IoError", message, std::move(context)) {}
  int exitCode() const override { return 6; }
};

// A missing, partial, corrupt or incompatible checkpoint.
class CheckpointError : public Error {
 public:
  CheckpointError(const std::string& message, ErrorContext context = {})
      : Error("CheckpointError", message, std::move(context)) {}
  int exitCode() const override { return 7; }
};

}  // namespace bulkhead
