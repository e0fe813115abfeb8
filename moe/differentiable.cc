#include "moe/differentiable.h"

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
    at::Tensor grad = materialize(grads[0], outputShape, options);
    return {exchangeRows(*group, grad, recvSplits, sendSplits, timeout)};
  }
};

// Where a routed row's parts sit in its bytes: the token, then the weights
// and the ids (each at its element alignment), padded to 16 bytes so every
// part of every row stays aligned.
struct RoutedLayout {
  int64_t rowBytes, sideOffset, sideBytes, width;

  RoutedLayout(const at::Tensor& tokens, const at::Tensor& weights) {
    const int64_t sideElement = weights.element_size();
    rowBytes = tokens.size(1) * tokens.element_size();
    sideOffset = (rowBytes + sideElement - 1) / sideElement * sideElement;
    sideBytes = 2 * weights.size(1) * sideElement;
    width = (sideOffset + sideBytes + 15) / 16 * 16;
  }

  // Views of a [rows, width] byte buffer. Each part is a dtype view of a byte
  // slice (a view autograd does not track), so the results can take the
  // exchange's own gradient node.
  RoutedRows parts(const at::Tensor& bytes, at::ScalarType tokenType, at::ScalarType sideType) const {
    const int64_t half = sideBytes / 2;
    return {.rows = bytes.narrow(1, 0, rowBytes).view(tokenType),
            .weights = bytes.narrow(1, sideOffset, half).view(sideType),
            .ids = bytes.narrow(1, sideOffset + half, half).view(sideType)};
  }
};

struct RoutedBackward : Node {
  CommunicatorPtr group;
  std::vector<int64_t> sendSplits, recvSplits;
  at::Tensor tokenTable;
  std::vector<int64_t> rowsShape, weightsShape;
  at::TensorOptions rowOptions, weightOptions;
  Timeout timeout;
  std::string name() const override { return "bulkhead::RoutedExchangeBackward"; }
  variable_list apply(variable_list&& grads) override {
    at::Tensor rows = exchangeRows(*group, materialize(grads[0], rowsShape, rowOptions), recvSplits, sendSplits, timeout);
    at::Tensor weights =
        exchangeRows(*group, materialize(grads[1], weightsShape, weightOptions), recvSplits, sendSplits, timeout);
    return {gatherSum(rows, tokenTable, at::Tensor()), weights};
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
  at::Tensor recv = at::empty(rowShape(send, total(recvSplits)), send.options());
  const Deadline deadline = parallel::collectiveDeadline(timeout);
  settle(group.allToAll(send, recv, sendSplits, recvSplits, {.deadline = deadline}), recv, deadline);
  return recv;
}

RoutedRows exchangeRouted(const CommunicatorPtr& group, const at::Tensor& tokens, const at::Tensor& rowToken,
                          const at::Tensor& tokenTable, const at::Tensor& weights, const at::Tensor& ids,
                          const std::vector<int64_t>& sendSplits, const std::vector<int64_t>& recvSplits,
                          Timeout timeout) {
  if (ids.sizes() != weights.sizes() || ids.scalar_type() != weights.scalar_type() || tokens.dim() != 2 ||
      weights.dim() != 2 || rowToken.size(0) != weights.size(0)) {
    throw ConfigError(fmt::format("routed exchange on {}: tokens [{}], {} rows of weights [{}] and ids [{}] do not fit",
                                  group->name(), fmt::join(tokens.sizes(), ", "), rowToken.size(0),
                                  fmt::join(weights.sizes(), ", "), fmt::join(ids.sizes(), ", ")),
                      {.rank = group->rank(), .group = group->name(),
                       .expected = "tokens [T, H]; weights and ids [rows, m] of one dtype, one per row sent"});
  }
  const RoutedLayout layout(tokens, weights);
  const at::ScalarType tokenType = tokens.scalar_type(), sideType = weights.scalar_type();
  at::Tensor send = at::empty({rowToken.size(0), layout.width}, tokens.options().dtype(at::kByte));
  {
    const torch::autograd::AutoGradMode untracked(false);
    RoutedRows outgoing = layout.parts(send, tokenType, sideType);
    at::index_select_out(outgoing.rows, tokens.detach(), 0, rowToken);  // gathered straight into the send buffer
    outgoing.weights.copy_(weights.detach());
    outgoing.ids.copy_(ids);
  }
  RoutedRows arrived = layout.parts(exchangeRows(*group, send, sendSplits, recvSplits, timeout), tokenType, sideType);
  const bool tracked =
      torch::autograd::GradMode::is_enabled() && (tokens.requires_grad() || weights.requires_grad());
  if (!tracked) return arrived;
  auto node = makeNode<RoutedBackward>();
  node->group = group;
  node->sendSplits = sendSplits;
  node->recvSplits = recvSplits;
  node->tokenTable = tokenTable;
  node->rowsShape = arrived.rows.sizes().vec();
  node->weightsShape = arrived.weights.sizes().vec();
  node->rowOptions = tokens.options();
  node->weightOptions = weights.options();
  node->timeout = timeout;
  node->set_next_edges(torch::autograd::collect_next_edges(tokens, weights));
  torch::autograd::set_history(arrived.rows, node);
  torch::autograd::set_history(arrived.weights, node);
  return arrived;
}

at::Tensor allToAll(const CommunicatorPtr& group, const at::Tensor& input, const std::vector<int64_t>& sendSplits,
                    const std::vector<int64_t>& recvSplits, Timeout timeout) {
  at::Tensor output = exchangeRows(*group, input.detach(), sendSplits, recvSplits, timeout);
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
