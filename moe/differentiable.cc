#include "moe/differentiable.h"

#include "parallel/tensor_parallel.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>

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
