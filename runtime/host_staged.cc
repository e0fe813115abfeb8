#include "runtime/host_staged.h"

#include <ATen/ATen.h>

#include <mutex>

namespace bulkhead {
namespace {

// The device work, and the copies back to the caller's CPU tensors once it
// has completed (once).
class StagedWork : public Work {
 public:
  StagedWork(WorkPtr inner, std::vector<std::pair<at::Tensor, at::Tensor>> results)
      : inner_(std::move(inner)), results_(std::move(results)) {}

  bool isCompleted() override {
    if (!inner_->isCompleted()) return false;
    if (!inner_->exception()) copyBack();
    return true;
  }
  void wait(std::optional<Deadline> deadline) override {
    inner_->wait(deadline);
    copyBack();
  }
  std::exception_ptr exception() const override { return inner_->exception(); }
  uint64_t sequence() const override { return inner_->sequence(); }

 private:
  void copyBack() {
    std::call_once(copied_, [&] {
      for (auto& [host, device] : results_) host.copy_(device.to(at::kCPU));
    });
  }

  WorkPtr inner_;
  std::vector<std::pair<at::Tensor, at::Tensor>> results_;  // (caller's CPU tensor, device tensor)
  std::once_flag copied_;
};

class HostStaged : public Communicator {
 public:
  // The device communicator numbers the operations: this one shows its ledger
  // (what monitors, dumps and checked regions read) instead of an empty one.
  explicit HostStaged(CommunicatorPtr device) : device_(std::move(device)) {
    ledger_ = std::const_pointer_cast<Ledger>(device_->sharedLedger());
  }

  int rank() const override { return device_->rank(); }
  int size() const override { return device_->size(); }
  const std::string& name() const override { return device_->name(); }
  const std::vector<int>& members() const override { return device_->members(); }
  const char* backend() const override { return device_->backend(); }
  c10::Device device() const override { return c10::Device(c10::kCPU); }
  bool isAborted() const override { return device_->isAborted(); }
  void abort(const std::string& reason) override { device_->abort(reason); }

  WorkPtr allReduce(at::Tensor tensor, ReduceOptions options) override {
    at::Tensor staged = up(tensor);
    return done(device_->allReduce(staged, options), {{tensor, staged}});
  }
  WorkPtr allGather(at::Tensor input, at::Tensor output, CallOptions options) override {
    at::Tensor out = up(output);
    return done(device_->allGather(up(input), out, options), {{output, out}});
  }
  WorkPtr reduceScatter(at::Tensor input, at::Tensor output, ReduceOptions options) override {
    at::Tensor out = up(output);
    return done(device_->reduceScatter(up(input), out, options), {{output, out}});
  }
  WorkPtr allToAll(at::Tensor send, at::Tensor recv, std::vector<int64_t> sendSplits, std::vector<int64_t> recvSplits,
                   CallOptions options) override {
    at::Tensor out = up(recv);
    return done(device_->allToAll(up(send), out, std::move(sendSplits), std::move(recvSplits), options), {{recv, out}});
  }
  WorkPtr broadcast(at::Tensor tensor, int root, CallOptions options) override {
    at::Tensor staged = up(tensor);
    return done(device_->broadcast(staged, root, options), {{tensor, staged}});
  }
  WorkPtr barrier(CallOptions options) override { return device_->barrier(options); }
  WorkPtr send(at::Tensor tensor, int peer, CallOptions options) override {
    return device_->send(up(tensor), peer, options);
  }
  WorkPtr recv(at::Tensor tensor, int peer, CallOptions options) override {
    at::Tensor staged = up(tensor);
    return done(device_->recv(staged, peer, options), {{tensor, staged}});
  }
  WorkPtr sendRecv(std::vector<PeerOp> ops, CallOptions options) override {
    std::vector<std::pair<at::Tensor, at::Tensor>> results;
    for (PeerOp& op : ops) {
      at::Tensor staged = up(op.tensor);
      if (op.kind == PeerOp::Kind::Recv && staged.defined()) results.emplace_back(op.tensor, staged);
      op.tensor = std::move(staged);
    }
    return done(device_->sendRecv(std::move(ops), options), std::move(results));
  }
  CommunicatorPtr split(int color, int key, const std::string& name, SplitOptions options) override {
    CommunicatorPtr child = device_->split(color, key, name, options);
    return child ? stagedOnHost(std::move(child)) : nullptr;
  }

 private:
  // The device copy of a CPU tensor; tensors on other devices go through
  // unchanged, so the device communicator's own checks name them.
  at::Tensor up(const at::Tensor& t) const { return t.defined() && t.device().is_cpu() ? t.to(device_->device()) : t; }
  static WorkPtr done(WorkPtr inner, std::vector<std::pair<at::Tensor, at::Tensor>> results) {
    return std::make_shared<StagedWork>(std::move(inner), std::move(results));
  }

  CommunicatorPtr device_;
};

}  // namespace

CommunicatorPtr stagedOnHost(CommunicatorPtr device) { return std::make_shared<HostStaged>(std::move(device)); }

}  // namespace bulkhead
