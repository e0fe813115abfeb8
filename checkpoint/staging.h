#pragma once
// Host memory for async saves, and the copies into it.
//
// HostBuffer: one growing buffer, reused from save to save (a save waits for
// the previous one, so one is enough). Page-locked through CUDA when the
// tensors it receives live on a GPU, so device-to-host copies run at full
// speed and asynchronously; plain page-aligned memory otherwise.
//
// Stager: copies byte ranges of tensors into host memory. CPU tensors: memcpy
// on worker threads. CUDA tensors: cudaMemcpyAsync on a side stream that first
// waits for the tensor's current stream (so the copy sees every update queued
// before save()); the training stream is never blocked. finish() returns when
// every copy has landed, bounded by a deadline (CUDA events are polled).
// Without CUDA in libtorch, CUDA tensors cannot exist and only the CPU path is
// compiled.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "runtime/deadline.h"

namespace bulkhead::checkpoint {

class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer();

  // At least `bytes`, page-locked when `pinned` and CUDA can pin (else plain).
  // Keeps the current memory when it is large enough and pinned as asked;
  // contents are not kept when it grows. IoError when memory runs out.
  uint8_t* reserve(size_t bytes, bool pinned, int rank);
  uint8_t* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  bool pinned() const { return pinned_; }

 private:
  void release();
  uint8_t* data_ = nullptr;
  size_t capacity_ = 0;
  bool pinned_ = false;
};

class Stager {
 public:
  explicit Stager(int threads);
  Stager(const Stager&) = delete;
  Stager& operator=(const Stager&) = delete;
  ~Stager();

  // Queues a copy of bytes [offset, offset + bytes) of `tensor` (contiguous)
  // to `destination`. CUDA copies start at once; CPU copies run in finish().
  void copy(const at::Tensor& tensor, int64_t offset, int64_t bytes, uint8_t* destination);
  // Waits for every queued copy. TimeoutError when the deadline passes first
  // (the copies may still land later: do not reuse the memory then).
  void finish(Deadline deadline, int rank);
  // True when any tensor given to copy() so far was on a GPU.
  static bool anyCuda(const std::vector<at::Tensor>& tensors);

 private:
  struct CpuCopy {
    const uint8_t* source;
    uint8_t* destination;
    int64_t bytes;
  };
  struct Device;  // a GPU's side stream and events (staging.cc)
  int threads_;
  std::vector<CpuCopy> cpu_;
  std::vector<at::Tensor> keepAlive_;
  std::vector<std::unique_ptr<Device>> devices_;
  std::vector<bool> started_;  // per device: ordered after the current stream in this batch
};

// Page-locked landing buffers for loads into CUDA tensors: two per reader
// thread, so a thread reads its next chunk while the previous one goes up.
// Each thread uploads on a stream of its own, ordered after the device's
// current stream (so the load sees every earlier use of the targets). Only
// constructed where CUDA tensors exist.
class DeviceLanding {
 public:
  DeviceLanding(int device, int threads, size_t bufferBytes, int rank);
  DeviceLanding(const DeviceLanding&) = delete;
  DeviceLanding& operator=(const DeviceLanding&) = delete;
  ~DeviceLanding();

  // Thread `worker`'s next buffer (4096-aligned), once the upload from it
  // issued two acquires ago has landed; TimeoutError past the deadline.
  uint8_t* acquire(int worker, Deadline deadline);
  // Queues a copy of `bytes` from inside the buffer `worker` acquired last to
  // `target` (device memory of this landing's device).
  void upload(int worker, void* target, const uint8_t* source, size_t bytes);
  // Waits until every upload has landed; TimeoutError past the deadline.
  void finish(Deadline deadline);
  int device() const { return device_; }

 private:
  struct Lane;  // a thread's buffers, stream and events (staging.cc)
  int device_;
  int rank_;
  size_t bufferBytes_;
  std::vector<std::unique_ptr<Lane>> lanes_;
};

// Copies each host tensor into its CUDA tensor (non-blocking, on the current
// stream) and waits, bounded by the deadline, until all have landed. Nothing
// to do without CUDA tensors.
void uploadToDevices(const std::vector<std::pair<at::Tensor, at::Tensor>>& copies, Deadline deadline, int rank);

}  // namespace bulkhead::checkpoint
