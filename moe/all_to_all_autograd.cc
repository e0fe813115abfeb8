#include "moe/all_to_all_autograd.h"

#include "moe/gather_sum.h"
#include "parallel/tensor_parallel.h"
#include "runtime/errors.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <numeric>
#include <string>
#include <utility>

namespace bulkhead::moe {
namespace {

using torch::autograd::Node;
using torch::autograd::variable_list;

// CPU results are complete only once waited for; CUDA results are ordered on
// the stream (see the header).
void settle(const WorkPtr& work, const at::Tensor& result, Deadline deadline) {
  if (!result.is_cuda()) work->wait(deadline);
}

std::vector<int64_t> rowShape(const at::Tensor& tensor, int64_t rows) {
  std::vector<int64_t> shape = tensor.sizes().vec();
  shape[0] = rows;
  return shape;
}

int64_t total(const std::vector<int64_t>& splits) { return std::accumulate(splits.begin(), splits.end(), int64_t{0}); }

// A gradient that never arrived (an unused output) still takes part in the
// backward collective, as zeros.
at::Tensor materialize(const at::Tensor& grad, const std::vector<int64_t>& shape, const at::TensorOptions& options) {
  return grad.defined() ? grad : at::zeros(shape, options);
}

// Records `node` as the producer of `output`, with `input` as its only input.
at::Tensor attach(std::shared_ptr<Node> node, const at::Tensor& input, at::Tensor output) {
  if (!torch::autograd::GradMode::is_enabled() || !input.requires_grad()) return output;
  node->set_next_edges(torch::autograd::collect_next_edges(input));
  torch::autograd::set_history(output, node);
  return output;
}

struct AllToAllBackward : Node {
  CommunicatorPtr group;
  std::vector<int64_t> sendSplits, recvSplits, outputShape;
  at::TensorOptions options;
  Timeout timeout;
  std::string name() const override { return "bulkhead::AllToAllBackward"; }
  variable_list apply(variable_list&& grads) override {
    parallel::refuseDoubleBackward("bulkhead::AllToAllBackward");  // on every rank alike, before the exchange
    at::Tensor grad = materialize(grads[0], outputShape, options);
    return {exchangeRows(*group, grad, recvSplits, sendSplits, timeout)};
  }
};

struct RoutedBackward : Node {
  CommunicatorPtr group;
  std::vector<int64_t> sendSplits, recvSplits;
  at::Tensor tokenTable, weightTable;
  std::vector<int64_t> rowsShape, weightsShape;
  at::TensorOptions rowOptions, weightOptions;
  Timeout timeout;
  std::string name() const override { return "bulkhead::RoutedExchangeBackward"; }
  variable_list apply(variable_list&& grads) override {
    parallel::refuseDoubleBackward("bulkhead::RoutedExchangeBackward");
    at::Tensor rows =
        exchangeRows(*group, materialize(grads[0], rowsShape, rowOptions), recvSplits, sendSplits, timeout);
    at::Tensor weights =
        exchangeRows(*group, materialize(grads[1], weightsShape, weightOptions), recvSplits, sendSplits, timeout);
    return {gatherSum(rows, tokenTable, at::Tensor()), gatherSum(weights, weightTable, at::Tensor())};
  }
};

template <typename T>
std::shared_ptr<T> makeNode() {
  return std::shared_ptr<T>(new T(), torch::autograd::deleteNode);
}

}  // namespace

at::Tensor exchangeRows(Communicator& group, const at::Tensor& input, const std::vector<int64_t>& sendSplits,
                        const std::vector<int64_t>& recvSplits, Timeout timeout) {
  at::Tensor send = input.contiguous();
  // A group of one (ep 1) sends its rows to itself: no collective, no copy
  // (every caller only reads what comes back).
  if (group.size() == 1) return send;
  at::Tensor recv = at::empty(rowShape(send, total(recvSplits)), send.options());
  const Deadline deadline = parallel::collectiveDeadline(timeout);
  settle(group.allToAll(send, recv, sendSplits, recvSplits, {.deadline = deadline}), recv, deadline);
  return recv;
}

RoutedLayout::RoutedLayout(const at::Tensor& tokens, at::ScalarType side, int64_t sideColumns)
    : tokenType(tokens.scalar_type()), sideType(side), columns(sideColumns) {
  const int64_t sideElement = static_cast<int64_t>(c10::elementSize(sideType));
  rowBytes = tokens.size(1) * tokens.element_size();
  sideOffset = (rowBytes + sideElement - 1) / sideElement * sideElement;
  width = (sideOffset + 2 * columns * sideElement + 15) / 16 * 16;
}

RoutedRows RoutedLayout::parts(const at::Tensor& bytes) const {
  const int64_t half = columns * static_cast<int64_t>(c10::elementSize(sideType));
  return {.rows = bytes.narrow(1, 0, rowBytes).view(tokenType),
          .weights = bytes.narrow(1, sideOffset, half).view(sideType),
          .ids = bytes.narrow(1, sideOffset + half, half).view(sideType)};
}

RoutedRows exchangeRouted(const CommunicatorPtr& group, const RoutedSend& send, const std::vector<int64_t>& sendSplits,
                          const std::vector<int64_t>& recvSplits, Timeout timeout) {
  const RoutedLayout& layout = send.layout;
  if (send.bytes.dim() != 2 || send.bytes.size(1) != layout.width || send.bytes.scalar_type() != at::kByte ||
      send.weights.dim() != 2 || send.weights.size(1) != layout.columns ||
      send.weights.scalar_type() != layout.sideType || send.tokens.scalar_type() != layout.tokenType) {
    throw ConfigError(
        fmt::format("routed exchange on {}: bytes [{}], tokens [{}] and weights [{}] do not fit a "
                    "layout of {}-byte rows with {} weights",
                    group->name(), fmt::join(send.bytes.sizes(), ", "), fmt::join(send.tokens.sizes(), ", "),
                    fmt::join(send.weights.sizes(), ", "), layout.width, layout.columns),
        {.rank = group->rank(),
         .group = group->name(),
         .expected = "bytes [rows, width] packed from tokens [T, H] and weights [S, m] of the layout"});
  }
  RoutedRows arrived = layout.parts(exchangeRows(*group, send.bytes, sendSplits, recvSplits, timeout));
  const bool tracked =
      torch::autograd::GradMode::is_enabled() && (send.tokens.requires_grad() || send.weights.requires_grad());
  if (!tracked) return arrived;
  auto node = makeNode<RoutedBackward>();
  node->group = group;
  node->sendSplits = sendSplits;
  node->recvSplits = recvSplits;
  node->tokenTable = send.tokenTable;
  node->weightTable = send.weightTable;
  node->rowsShape = arrived.rows.sizes().vec();
  node->weightsShape = arrived.weights.sizes().vec();
  node->rowOptions = send.tokens.options();
  node->weightOptions = send.weights.options();
  node->timeout = timeout;
  node->set_next_edges(torch::autograd::collect_next_edges(send.tokens, send.weights));
  torch::autograd::set_history(arrived.rows, node);
  torch::autograd::set_history(arrived.weights, node);
  return arrived;
}

at::Tensor allToAll(const CommunicatorPtr& group, const at::Tensor& input, const std::vector<int64_t>& sendSplits,
                    const std::vector<int64_t>& recvSplits, Timeout timeout) {
  // A fresh tensor for the autograd history, also where the group of one returns its input.
  at::Tensor output = group->size() == 1 ? input.detach().clone()
                                         : exchangeRows(*group, input.detach(), sendSplits, recvSplits, timeout);
  auto node = makeNode<AllToAllBackward>();
  node->group = group;
  node->sendSplits = sendSplits;
  node->recvSplits = recvSplits;
  node->timeout = timeout;
  node->outputShape = output.sizes().vec();
  node->options = output.options();
  return attach(std::move(node), input, std::move(output));
}

}  // namespace bulkhead::moe
