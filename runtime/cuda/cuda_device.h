#pragma once
// The one CUDA device guard: sets the current device for a scope and restores
// the caller's, used wherever Bulkhead issues CUDA runtime calls on a device
// that may not be the current one (the NCCL backend, checkpoint staging).
// Defined where Bulkhead links the CUDA runtime (builds with NCCL).

namespace bulkhead::cuda {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool changed_ = false;
};

}  // namespace bulkhead::cuda
