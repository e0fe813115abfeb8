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
// The backward's gradients carry no graph: a double backward (create_graph)
// raises ConfigError, on every rank alike, before the exchange.

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

// The dispatch's exchange: tokens and their routing in one collective. Each
// row travels as raw bytes (RoutedLayout): a token, its combine weights and
// its local expert ids; the results are views into the one receive buffer.
struct RoutedRows {
  at::Tensor rows;     // [R, H], the tokens' dtype
  at::Tensor weights;  // [R, m]
  at::Tensor ids;      // [R, m], the weights' dtype
};

// Where a routed row's parts sit in its bytes: the token, then `columns`
// weights and `columns` ids of the side type, each part at its element
// alignment, the row padded to 16 bytes so every part of every row stays
// aligned.
struct RoutedLayout {
  RoutedLayout(const at::Tensor& tokens, at::ScalarType sideType, int64_t columns);
  // Dtype views of a [rows, width] byte buffer (views autograd does not track).
  RoutedRows parts(const at::Tensor& bytes) const;

  at::ScalarType tokenType, sideType;
  int64_t columns, rowBytes, sideOffset, width;
};

// What a routed exchange sends: `bytes` [rows, layout.width], packed from
// tokens [T, H] and weights [S, m] (the side type, with autograd). For the
// backward, the tables follow gatherRows' contract: row tokenTable[t, c]
// carries token t and row weightTable[s, c] carries weights' row s. The
// gradients of the rows and of the weights go back in two exchanges, and are
// summed per token and per weight row without atomics.
struct RoutedSend {
  at::Tensor bytes;
  RoutedLayout layout;
  at::Tensor tokens, tokenTable, weights, weightTable;
};
RoutedRows exchangeRouted(const CommunicatorPtr& group, const RoutedSend& send, const std::vector<int64_t>& sendSplits,
                          const std::vector<int64_t>& recvSplits, Timeout timeout = std::nullopt);

// The same exchange without autograd (counts, routing metadata).
at::Tensor exchangeRows(Communicator& group, const at::Tensor& input, const std::vector<int64_t>& sendSplits,
                        const std::vector<int64_t>& recvSplits, Timeout timeout = std::nullopt);

}  // namespace bulkhead::moe
