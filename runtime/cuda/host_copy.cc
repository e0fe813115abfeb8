#include "runtime/cuda/host_copy.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>

#include <chrono>
#include <thread>

#include "runtime/backoff.h"
#include "runtime/errors.h"

namespace bulkhead {

HostCopy::HostCopy(const at::Tensor& source, std::string what) : source_(source), what_(std::move(what)) {
  if (source.is_cpu()) return;
  host_ = at::empty(source.sizes(), source.options().device(at::kCPU).pinned_memory(true));
  host_.copy_(source, /*non_blocking=*/true);
  const c10::impl::VirtualGuardImpl device(source.device().type());
  copied_.emplace(source.device().type());
  copied_->record(device.getStream(source.device()));
}

bool HostCopy::ready() const { return !copied_ || copied_->query(); }

at::Tensor HostCopy::get(Deadline deadline, Work* work) const {
  if (copied_) {
    const auto spinUntil = Deadline::Clock::now() + std::chrono::milliseconds(1);
    Backoff backoff;
    while (!copied_->query()) {
      if (work && (deadline.expired() || work->exception())) work->wait(deadline);  // raises why
      if (deadline.expired())
        throw TimeoutError(fmt::format("{} did not reach the host by its deadline", what_),
                           {.expected = "the device work before the copy done within the deadline"});
      if (Deadline::Clock::now() < spinUntil)
        std::this_thread::yield();
      else
        backoff.pause(deadline);
    }
  }
  // On a GPU already complete, unless it failed: then this raises why. On a CPU, the wait for the value.
  if (work) work->wait(deadline);
  return copied_ ? host_ : source_;
}

}  // namespace bulkhead
