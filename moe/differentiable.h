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

// The dispatch's exchange: tokens and their routing in one collective. Row i
// sent is tokens[rowToken[i]] followed by weights[i] (combine weights, with
// autograd) and ids[i] (local expert ids, same dtype and shape as weights, no
// autograd); the rows travel as raw bytes and the results are views into the
// one receive buffer. tokenTable follows gatherRows' contract (the rows
// reading each token), for the backward: the gradients of the rows and of the
// weights go back in two exchanges, and the rows' gradients are summed per
// token without atomics.
struct RoutedRows {
  at::Tensor rows;     // [R, H], the tokens' dtype
  at::Tensor weights;  // [R, m]
  at::Tensor ids;      // [R, m]
};
RoutedRows exchangeRouted(const CommunicatorPtr& group, const at::Tensor& tokens, const at::Tensor& rowToken,
                          const at::Tensor& tokenTable, const at::Tensor& weights, const at::Tensor& ids,
                          const std::vector<int64_t>& sendSplits, const std::vector<int64_t>& recvSplits,
                          Timeout timeout = std::nullopt);

// The same exchange without autograd (counts, routing metadata).
at::Tensor exchangeRows(Communicator& group, const at::Tensor& input, const std::vector<int64_t>& sendSplits,
                        const std::vector<int64_t>& recvSplits, Timeout timeout = std::nullopt);

}  // namespace bulkhead::moe
