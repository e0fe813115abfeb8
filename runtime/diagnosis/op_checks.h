#pragma once
// Argument checks and fingerprints shared by every backend: bad input is a
// ConfigError on the calling rank before any communication starts.

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <string>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/errors.h"

namespace bulkhead::checks {

// What a backend accepts and how it names itself in messages.
struct BackendRules {
  c10::DeviceType device;  // kCPU for mpi, kCUDA for nccl
  std::initializer_list<c10::ScalarType> dtypes;
};

ErrorContext context(const Communicator& comm, const std::string& expected = {});
std::string describeGroup(const Communicator& comm);  // "world (ranks 0,1,2,3)"

// Defined, contiguous, on the backend's device, of a supported dtype.
void tensor(const Communicator& comm, const BackendRules& rules, const at::Tensor& t, const char* role);
void sameDtype(const Communicator& comm, const at::Tensor& a, const at::Tensor& b);
void numel(const Communicator& comm, const at::Tensor& t, int64_t expected, const char* role, const char* why);
void peer(const Communicator& comm, int peer, const char* role);
// Resolves all-to-all splits for `t` (rows on dim 0): empty means equal splits.
// Length must be size(), entries non-negative, sum equal to t.size(0).
std::vector<int64_t> splits(const Communicator& comm, const at::Tensor& t, std::vector<int64_t> splits,
                            const char* role);
// What a rank sends to itself is what it receives from itself: the one pair
// of an all-to-all that one rank can check alone.
void selfSplit(const Communicator& comm, const std::vector<int64_t>& sendSplits,
               const std::vector<int64_t>& recvSplits);
void sameRowShape(const Communicator& comm, const at::Tensor& send, const at::Tensor& recv);
// Elements per row of a tensor split on dim 0 (1 for 0-d and 1-d tensors).
int64_t rowElements(const at::Tensor& t);

Fingerprint fingerprint(OpType op, const at::Tensor& t);

// The checks every backend runs before an operation, by operation.
void allReduceArgs(const Communicator& comm, const BackendRules& rules, const at::Tensor& tensor, ReduceOp op);
void allGatherArgs(const Communicator& comm, const BackendRules& rules, const at::Tensor& input,
                   const at::Tensor& output);
void reduceScatterArgs(const Communicator& comm, const BackendRules& rules, const at::Tensor& input,
                       const at::Tensor& output, ReduceOp op);
// Returns the resolved send and recv splits (empty lists mean equal splits).
std::pair<std::vector<int64_t>, std::vector<int64_t>> allToAllArgs(const Communicator& comm, const BackendRules& rules,
                                                                   const at::Tensor& send, const at::Tensor& recv,
                                                                   std::vector<int64_t> sendSplits,
                                                                   std::vector<int64_t> recvSplits);

}  // namespace bulkhead::checks
