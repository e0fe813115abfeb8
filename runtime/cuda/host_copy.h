#pragma once
// A copy of a small tensor to the host that, on a GPU, runs behind the work
// already queued on the current stream and lets the host wait for it alone,
// not for work queued after it (a dispatch's packing, the optimizer's update,
// the next step). A CPU source is used as it is. For counts and scalars the
// host must read while the device goes on.

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <optional>
#include <string>

#include "runtime/communicator.h"
#include "runtime/deadline.h"

namespace bulkhead {

class HostCopy {
 public:
  // `what` names the value in a TimeoutError ("the step's gradient norm").
  HostCopy(const at::Tensor& source, std::string what);

  // Whether the copy has landed (a CPU source: always).
  bool ready() const;
  // The value on the host once the copy has landed. `work`, where given, is
  // the collective that produced the source: it must complete too, and its
  // error, or its timeout, is what a failure raises. Otherwise TimeoutError
  // past `deadline`. Polls by yielding for the first millisecond (the copy
  // usually lands within it, and a sleep would add the timer's slack), then
  // backs off, leaving the core to others while a slow peer is awaited.
  at::Tensor get(Deadline deadline, Work* work = nullptr) const;

 private:
  at::Tensor source_, host_;
  std::optional<c10::Event> copied_;
  std::string what_;
};

}  // namespace bulkhead
