#pragma once
// The all-to-all of the MoE layer as an autograd operation (the expert-tp
// collectives are parallel/tensor_parallel.h's). Its backward is itself a
// collective on the same communicator, so forward and backward run
// the same collectives on every rank of the group, whatever it holds (zero
// rows included, and outputs whose gradient never arrives, which count as
// zeros).
//
// Completion: a CPU (MPI) result is waited for before it is returned; a CUDA
// result is ordered on the current stream and not waited for by the host (the
// communicator's watchdog enforces its deadline). Every operation runs under
// the communicator's default deadline (BULKHEAD_COLLECTIVE_TIMEOUT from the
// call, or `timeout` from the call when given), forward and backward alike.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "runtime/communicator.h"

namespace bulkhead::moe {

// Rows of `input` to ranks by sendSplits; the result holds the rows received,
// recvSplits[r] from rank r. Backward: the same exchange with splits swapped.
using Timeout = std::optional<std::chrono::milliseconds>;

at::Tensor allToAll(const CommunicatorPtr& group, const at::Tensor& input, const std::vector<int64_t>& sendSplits,
                    const std::vector<int64_t>& recvSplits, Timeout timeout = std::nullopt);

// The same exchange without autograd (counts, routing metadata).
at::Tensor exchangeRows(Communicator& group, const at::Tensor& input, const std::vector<int64_t>& sendSplits,
                        const std::vector<int64_t>& recvSplits, Timeout timeout = std::nullopt);

}  // namespace bulkhead::moe
