#include "runtime/cuda/cuda_device.h"

#include <cuda_runtime.h>

namespace bulkhead::cuda {

DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) changed_ = cudaSetDevice(device) == cudaSuccess;
}

DeviceGuard::~DeviceGuard() {
  if (changed_) cudaSetDevice(previous_);
}

}  // namespace bulkhead::cuda
