#pragma once
// Internals shared by the tensor-parallel layers (not installed API): the
// group carried through autograd contexts, and the raw collectives.

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "parallel/tensor_parallel.h"

namespace bulkhead::parallel::detail {

// A TpGroup as an IValue (autograd contexts hold only IValues), and back.
c10::IValue holdGroup(const TpGroup& group);
TpGroup heldGroup(const c10::IValue& value);

// ConfigError when `tensor` is not on the group's device.
void checkDevice(const at::Tensor& tensor, const TpGroup& group, const char* what);
// In place when `tensor` is contiguous (else on a contiguous copy, returned).
at::Tensor allReduce(at::Tensor tensor, const TpGroup& group, ReduceOp op = ReduceOp::Sum);
at::Tensor allGatherLastDim(const at::Tensor& input, const TpGroup& group);
at::Tensor ownBlockLastDim(const at::Tensor& input, const TpGroup& group);

}  // namespace bulkhead::parallel::detail
