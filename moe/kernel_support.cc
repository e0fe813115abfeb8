#include "moe/kernel_support.h"

#if BULKHEAD_MOE_KERNELS
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace bulkhead::moe {

std::optional<cuda::Dtype> kernelDtype(c10::ScalarType type) {
  switch (type) {
    case c10::kFloat:
      return cuda::Dtype::Float32;
    case c10::kDouble:
      return cuda::Dtype::Float64;
    case c10::kBFloat16:
      return cuda::Dtype::BFloat16;
    case c10::kHalf:
      return cuda::Dtype::Float16;
    default:
      return std::nullopt;
  }
}

bool streamCapturing(const at::Tensor& on) {
#if BULKHEAD_MOE_KERNELS
  if (on.is_cuda()) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t rc =
        cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(on.device().index()).stream(), &status);
    return rc == cudaSuccess && status != cudaStreamCaptureStatusNone;
  }
#endif
  (void)on;
  return false;
}

}  // namespace bulkhead::moe
