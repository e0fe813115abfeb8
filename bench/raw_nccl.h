#pragma once
// Bare NCCL on one communicator: the reference that bench/ measures Bulkhead
// against (its nccl backend, the MoE dispatcher). Calls are enqueued on the
// given stream exactly as NCCL does them: no ledger, no watchdog, no
// per-operation deadline. Only bootstrap is bounded. Not for training.
// This header does not include nccl.h; bench/raw_nccl.cc does.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/errors.h"

namespace bulkhead::nccl {

class RawNccl {
 public:
  // Over the ranks of `bootstrap` (a CPU communicator), on the current CUDA device.
  RawNccl(Communicator& bootstrap, Deadline deadline);
  ~RawNccl();
  RawNccl(const RawNccl&) = delete;
  RawNccl& operator=(const RawNccl&) = delete;

  // `stream`: a cudaStream_t (nullptr: the legacy default stream).
  void allReduceSum(const at::Tensor& tensor, void* stream) const;  // in place
  // sendRows[r] rows of `send` to rank r and recvRows[r] rows of `recv` from
  // rank r (rows along dim 0, contiguous), in one NCCL group.
  void exchangeRows(const at::Tensor& send, const at::Tensor& recv, const std::vector<int64_t>& sendRows,
                    const std::vector<int64_t>& recvRows, void* stream) const;

  static std::string version();  // e.g. "2.28.3"

 private:
  void* comm_;  // ncclComm_t
  int size_;
  ErrorContext context_;
};

}  // namespace bulkhead::nccl
