#include "checkpoint/staging.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "checkpoint/parallel_for.h"
#include "runtime/backoff.h"
#include "runtime/errors.h"
#include "runtime/log.h"

#if BULKHEAD_TORCH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include "runtime/cuda/cuda_device.h"
#endif

namespace bulkhead::checkpoint {
namespace {

constexpr size_t kRound = size_t{2} << 20;

#if BULKHEAD_TORCH_CUDA
void cudaCheck(cudaError_t rc, const char* what, int rank) {
  if (rc == cudaSuccess) return;
  throw IoError(fmt::format("{} failed: {} ({}); the save is abandoned and the previous checkpoint stays as it was",
                            what, cudaGetErrorString(rc), static_cast<int>(rc)),
                {.rank = rank, .expected = "device-to-host copies of the state dict"});
}
#endif

}  // namespace

HostBuffer::~HostBuffer() { release(); }

void HostBuffer::release() {
  if (!data_) return;
#if BULKHEAD_TORCH_CUDA
  if (pinned_)
    cudaFreeHost(data_);
  else
    std::free(data_);
#else
  std::free(data_);
#endif
  data_ = nullptr;
  capacity_ = 0;
  pinned_ = false;
}

uint8_t* HostBuffer::reserve(size_t bytes, bool pinned, int rank) {
  if (data_ && capacity_ >= bytes && (pinned_ || !pinned)) return data_;
  release();
  size_t size = (std::max<size_t>(bytes, 1) + kRound - 1) / kRound * kRound;
#if BULKHEAD_TORCH_CUDA
  if (pinned) {
    void* memory = nullptr;
    if (cudaHostAlloc(&memory, size, cudaHostAllocPortable) == cudaSuccess) {
      data_ = static_cast<uint8_t*>(memory);
      capacity_ = size;
      pinned_ = true;
      return data_;
    }
    cudaGetLastError();
    log::warn("checkpoint",
              "could not page-lock {:.2f} GiB of host memory; staging in pageable memory (slower "
              "device-to-host copies)",
              size / double(1ull << 30));
  }
#endif
  void* memory = nullptr;
  if (::posix_memalign(&memory, 4096, size) != 0)
    throw IoError(fmt::format("cannot allocate {:.2f} GiB of host memory to stage a checkpoint; free memory or save "
                              "fewer tensors per rank",
                              size / double(1ull << 30)),
                  {.rank = rank, .expected = "host memory for one copy of this rank's state dict"});
  data_ = static_cast<uint8_t*>(memory);
  capacity_ = size;
  pinned_ = false;
  return data_;
}

struct Stager::Device {
#if BULKHEAD_TORCH_CUDA
  int index = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;
  cudaEvent_t done = nullptr;
  ~Device() {
    cuda::DeviceGuard scope(index);
    if (ready) cudaEventDestroy(ready);
    if (done) cudaEventDestroy(done);
    if (stream) cudaStreamDestroy(stream);
  }
#endif
};

Stager::Stager(int threads) : threads_(std::max(1, threads)) {}
Stager::~Stager() = default;

bool Stager::anyCuda(const std::vector<at::Tensor>& tensors) {
  for (const auto& tensor : tensors)
    if (tensor.defined() && tensor.is_cuda()) return true;
  return false;
}

void Stager::copy(const at::Tensor& tensor, int64_t offset, int64_t bytes, uint8_t* destination) {
  if (bytes <= 0) return;
  if (keepAlive_.empty() || !keepAlive_.back().is_same(tensor)) keepAlive_.push_back(tensor);
  const uint8_t* source = static_cast<const uint8_t*>(tensor.data_ptr()) + offset;
  if (!tensor.is_cuda()) {
    cpu_.push_back({source, destination, bytes});
    return;
  }
#if BULKHEAD_TORCH_CUDA
  int index = tensor.device().index();
  if (static_cast<int>(devices_.size()) <= index) {
    devices_.resize(index + 1);
    started_.resize(index + 1, false);
  }
  cuda::DeviceGuard scope(index);
  if (!devices_[index]) {
    auto device = std::make_unique<Device>();
    device->index = index;
    cudaCheck(cudaStreamCreateWithFlags(&device->stream, cudaStreamNonBlocking), "creating the staging stream", -1);
    cudaCheck(cudaEventCreateWithFlags(&device->ready, cudaEventDisableTiming), "creating a staging event", -1);
    cudaCheck(cudaEventCreateWithFlags(&device->done, cudaEventDisableTiming), "creating a staging event", -1);
    devices_[index] = std::move(device);
  }
  Device& device = *devices_[index];
  if (!started_[index]) {
    // The side stream waits for everything queued on the current stream so far.
    cudaCheck(cudaEventRecord(device.ready, c10::cuda::getCurrentCUDAStream(index).stream()),
              "ordering the staging copies after the current stream", -1);
    cudaCheck(cudaStreamWaitEvent(device.stream, device.ready, 0), "ordering the staging copies", -1);
    started_[index] = true;
  }
  cudaCheck(cudaMemcpyAsync(destination, source, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, device.stream),
            "queueing a device-to-host copy", -1);
#else
  throw ConfigError("a CUDA tensor reached a checkpoint built without CUDA support");
#endif
}

void Stager::finish(Deadline deadline, int rank) {
  parallelFor(static_cast<int64_t>(cpu_.size()), threads_,
              [&](int64_t i) { std::memcpy(cpu_[i].destination, cpu_[i].source, cpu_[i].bytes); });
  cpu_.clear();
#if BULKHEAD_TORCH_CUDA
  auto started = Deadline::Clock::now();
  for (size_t index = 0; index < devices_.size(); ++index) {
    if (!started_[index]) continue;
    Device& device = *devices_[index];
    cuda::DeviceGuard scope(static_cast<int>(index));
    cudaCheck(cudaEventRecord(device.done, device.stream), "marking the end of the staging copies", rank);
    Backoff backoff(std::chrono::microseconds(500));
    for (;;) {
      cudaError_t rc = cudaEventQuery(device.done);
      if (rc == cudaSuccess) break;
      if (rc != cudaErrorNotReady) cudaCheck(rc, "device-to-host staging copies", rank);
      if (deadline.expired())
        throw TimeoutError(fmt::format("device-to-host staging copies on cuda:{} did not finish in {:.1f} s; the GPU "
                                       "may be hung or oversubscribed",
                                       index, secondsSince(started)),
                           {.rank = rank, .expected = "the staging copies within the checkpoint deadline"});
      backoff.pause(deadline);
    }
    started_[index] = false;
  }
#else
  (void)deadline;
  (void)rank;
#endif
  keepAlive_.clear();
}

struct DeviceLanding::Lane {
#if BULKHEAD_TORCH_CUDA
  int device = 0;
  uint8_t* buffers[2] = {nullptr, nullptr};
  cudaEvent_t uploaded[2] = {nullptr, nullptr};
  bool pending[2] = {false, false};
  int current = 1;
  cudaStream_t stream = nullptr;
  ~Lane() {
    cuda::DeviceGuard scope(device);
    for (int b = 0; b < 2; ++b) {
      // A copy still in flight (a load that failed or timed out) keeps its
      // buffer: leaked rather than freed under the copy.
      bool inFlight = pending[b] && cudaEventQuery(uploaded[b]) != cudaSuccess;
      if (uploaded[b]) cudaEventDestroy(uploaded[b]);
      if (buffers[b] && !inFlight) cudaFreeHost(buffers[b]);
    }
    if (stream) cudaStreamDestroy(stream);
    cudaGetLastError();
  }
#endif
};

#if BULKHEAD_TORCH_CUDA
namespace {
// Polls `event` until it has completed, bounded by the deadline.
void awaitEvent(cudaEvent_t event, Deadline deadline, int device, int rank) {
  auto started = Deadline::Clock::now();
  Backoff backoff(std::chrono::microseconds(50));
  for (;;) {
    cudaError_t rc = cudaEventQuery(event);
    if (rc == cudaSuccess) return;
    if (rc != cudaErrorNotReady) cudaCheck(rc, "host-to-device copies of a loaded checkpoint", rank);
    if (deadline.expired())
      throw TimeoutError(
          fmt::format("host-to-device copies on cuda:{} did not finish in {:.1f} s", device, secondsSince(started)),
          {.rank = rank, .expected = "the load within the checkpoint deadline"});
    backoff.pause(deadline);
  }
}
}  // namespace
#endif

DeviceLanding::DeviceLanding(int device, int threads, size_t bufferBytes, int rank)
    : device_(device), rank_(rank), bufferBytes_((bufferBytes + 4095) / 4096 * 4096) {
#if BULKHEAD_TORCH_CUDA
  cuda::DeviceGuard scope(device);
  cudaEvent_t ready = nullptr;
  cudaCheck(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), "creating an upload event", rank);
  std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, cudaError_t (*)(cudaEvent_t)> owned(ready, cudaEventDestroy);
  cudaCheck(cudaEventRecord(ready, c10::cuda::getCurrentCUDAStream(device).stream()), "ordering the uploads", rank);
  for (int t = 0; t < std::max(1, threads); ++t) {
    auto lane = std::make_unique<Lane>();
    lane->device = device;
    for (int b = 0; b < 2; ++b) {
      void* memory = nullptr;
      if (cudaHostAlloc(&memory, bufferBytes_, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        throw IoError(
            fmt::format("cannot page-lock {:.1f} MiB of host memory to load a checkpoint", bufferBytes_ / 1048576.0),
            {.rank = rank, .expected = "a few chunks of page-locked memory per reader thread"});
      }
      lane->buffers[b] = static_cast<uint8_t*>(memory);
      cudaCheck(cudaEventCreateWithFlags(&lane->uploaded[b], cudaEventDisableTiming), "creating an upload event", rank);
    }
    cudaCheck(cudaStreamCreateWithFlags(&lane->stream, cudaStreamNonBlocking), "creating an upload stream", rank);
    cudaCheck(cudaStreamWaitEvent(lane->stream, ready, 0), "ordering the uploads", rank);
    lanes_.push_back(std::move(lane));
  }
#else
  (void)threads;
  throw ConfigError("a CUDA tensor reached a checkpoint built without CUDA support", {.rank = rank});
#endif
}

DeviceLanding::~DeviceLanding() = default;

uint8_t* DeviceLanding::acquire(int worker, Deadline deadline) {
#if BULKHEAD_TORCH_CUDA
  Lane& lane = *lanes_.at(worker);
  lane.current ^= 1;
  if (lane.pending[lane.current]) {
    awaitEvent(lane.uploaded[lane.current], deadline, device_, rank_);
    lane.pending[lane.current] = false;
  }
  return lane.buffers[lane.current];
#else
  (void)worker;
  (void)deadline;
  return nullptr;
#endif
}

void DeviceLanding::upload(int worker, void* target, const uint8_t* source, size_t bytes) {
#if BULKHEAD_TORCH_CUDA
  Lane& lane = *lanes_.at(worker);
  cuda::DeviceGuard scope(device_);
  cudaCheck(cudaMemcpyAsync(target, source, bytes, cudaMemcpyHostToDevice, lane.stream), "queueing an upload", rank_);
  cudaCheck(cudaEventRecord(lane.uploaded[lane.current], lane.stream), "marking an upload", rank_);
  lane.pending[lane.current] = true;
#else
  (void)worker, (void)target, (void)source, (void)bytes;
#endif
}

void DeviceLanding::finish(Deadline deadline) {
#if BULKHEAD_TORCH_CUDA
  for (auto& lane : lanes_)
    for (int b = 0; b < 2; ++b)
      if (lane->pending[b]) {
        awaitEvent(lane->uploaded[b], deadline, device_, rank_);
        lane->pending[b] = false;
      }
#else
  (void)deadline;
#endif
}

void uploadToDevices(const std::vector<std::pair<at::Tensor, at::Tensor>>& copies, Deadline deadline, int rank) {
  if (copies.empty()) return;
#if BULKHEAD_TORCH_CUDA
  std::vector<int> devices;
  for (const auto& [device, host] : copies) {
    device.copy_(host, /*non_blocking=*/true);
    int index = device.device().index();
    if (std::find(devices.begin(), devices.end(), index) == devices.end()) devices.push_back(index);
  }
  for (int index : devices) {
    cuda::DeviceGuard scope(index);
    cudaEvent_t done = nullptr;
    cudaCheck(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "creating an upload event", rank);
    std::unique_ptr<std::remove_pointer_t<cudaEvent_t>, cudaError_t (*)(cudaEvent_t)> owned(done, cudaEventDestroy);
    cudaCheck(cudaEventRecord(done, c10::cuda::getCurrentCUDAStream(index).stream()), "marking the uploads", rank);
    awaitEvent(done, deadline, index, rank);
  }
#else
  (void)deadline;
  throw ConfigError("a CUDA tensor reached a checkpoint built without CUDA support", {.rank = rank});
#endif
}

}  // namespace bulkhead::checkpoint
