// The Hopper grouped-product kernels (moe/cuda/grouped_gemm_kernels.h) as a
// PyTorch extension, for bench/grouped_products_ext.py: forward(x, w, ends),
// dgrad(dy, w, ends) and wgrad(dy, x, ends) on contiguous bf16 CUDA tensors.
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#include "moe/cuda/grouped_gemm_kernels.h"

namespace {

using bulkhead::moe::cuda::GroupedProduct;

at::Tensor run(GroupedProduct product, const at::Tensor& a, const at::Tensor& b, const at::Tensor& ends) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && ends.is_contiguous(), "contiguous operands");
  const auto call = bulkhead::moe::cuda::groupedGemmCall(
      product, a.size(0), a.size(1), b.size(1), b.dim() > 2 ? b.size(2) : 0, static_cast<int>(ends.size(0)),
      ends.data_ptr<int32_t>(), at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(bulkhead::moe::cuda::groupedGemmApplies(call.args), "the kernels do not serve these shapes here");
  at::Tensor out = at::empty(at::IntArrayRef(call.outShape, call.outDims), a.options());
  bulkhead::moe::cuda::groupedGemm(call.args, a.data_ptr(), b.data_ptr(), out.data_ptr());
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& ends) {
    return run(GroupedProduct::Forward, x, w, ends);
  });
  m.def("dgrad", [](const at::Tensor& dy, const at::Tensor& w, const at::Tensor& ends) {
    return run(GroupedProduct::Dgrad, dy, w, ends);
  });
  m.def("wgrad", [](const at::Tensor& dy, const at::Tensor& x, const at::Tensor& ends) {
    return run(GroupedProduct::Wgrad, dy, x, ends);
  });
}
