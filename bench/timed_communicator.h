#pragma once
// A communicator that times the all-to-alls passing through it, for the MoE
// bench: it wraps the ep group handed to a dispatcher, so the exchanges are
// timed inside a real dispatch and combine (their order, their neighbours
// on the stream), not re-enacted. Every call is forwarded unchanged.
//
// Timing: a pair of CUDA events on the call's stream (the current one, the
// default stream in the bench, where the caller names none). A pair spans
// the exchange on the GPU, including the time its kernel waits for the
// slower peer, and, where the stream was idle when the call came, the host's
// issue cost (ledger, NCCL calls) before the kernel starts.

#include <cuda_runtime_api.h>

#include <string>
#include <utility>
#include <vector>

#include "bench/bench_check.h"
#include "runtime/communicator.h"

namespace bulkhead::bench {

class TimedCommunicator final : public Communicator {
 public:
  explicit TimedCommunicator(CommunicatorPtr inner) : inner_(std::move(inner)) {}
  ~TimedCommunicator() override {
    release();
    for (auto [start, end] : spare_) {
      cudaEventDestroy(start);
      cudaEventDestroy(end);
    }
  }

  // Milliseconds spent in each all-to-all since the last call, in issue
  // order; waits for them to finish.
  std::vector<double> collect() {
    std::vector<double> times;
    for (auto [start, end] : pairs_) {
      BENCH_CHECK(cudaEventSynchronize(end));
      float ms = 0;
      BENCH_CHECK(cudaEventElapsedTime(&ms, start, end));
      times.push_back(ms);
    }
    release();
    return times;
  }

  WorkPtr allToAll(at::Tensor send, at::Tensor recv, std::vector<int64_t> sendSplits, std::vector<int64_t> recvSplits,
                   CallOptions options) override {
    std::pair<cudaEvent_t, cudaEvent_t> pair{};
    if (spare_.empty()) {  // events are reused, so the timed calls create none once warm
      BENCH_CHECK(cudaEventCreate(&pair.first));
      BENCH_CHECK(cudaEventCreate(&pair.second));
    } else {
      pair = spare_.back();
      spare_.pop_back();
    }
    pairs_.push_back(pair);
    auto stream = static_cast<cudaStream_t>(options.stream);
    BENCH_CHECK(cudaEventRecord(pair.first, stream));
    WorkPtr work =
        inner_->allToAll(std::move(send), std::move(recv), std::move(sendSplits), std::move(recvSplits), options);
    BENCH_CHECK(cudaEventRecord(pair.second, stream));
    return work;
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const std::string& name() const override { return inner_->name(); }
  const std::vector<int>& members() const override { return inner_->members(); }
  const char* backend() const override { return inner_->backend(); }
  c10::Device device() const override { return inner_->device(); }
  WorkPtr allReduce(at::Tensor tensor, ReduceOptions options) override { return inner_->allReduce(tensor, options); }
  WorkPtr allGather(at::Tensor input, at::Tensor output, CallOptions options) override {
    return inner_->allGather(input, output, options);
  }
  WorkPtr reduceScatter(at::Tensor input, at::Tensor output, ReduceOptions options) override {
    return inner_->reduceScatter(input, output, options);
  }
  WorkPtr broadcast(at::Tensor tensor, int root, CallOptions options) override {
    return inner_->broadcast(tensor, root, options);
  }
  WorkPtr barrier(CallOptions options) override { return inner_->barrier(options); }
  WorkPtr send(at::Tensor tensor, int peer, CallOptions options) override {
    return inner_->send(tensor, peer, options);
  }
  WorkPtr recv(at::Tensor tensor, int peer, CallOptions options) override {
    return inner_->recv(tensor, peer, options);
  }
  WorkPtr sendRecv(std::vector<PeerOp> ops, CallOptions options) override {
    return inner_->sendRecv(std::move(ops), options);
  }
  std::shared_ptr<Communicator> split(int color, int key, const std::string& name, SplitOptions options) override {
    return inner_->split(color, key, name, options);
  }
  void abort(const std::string& reason) override { inner_->abort(reason); }
  bool isAborted() const override { return inner_->isAborted(); }

 private:
  void release() {
    spare_.insert(spare_.end(), pairs_.begin(), pairs_.end());
    pairs_.clear();
  }

  CommunicatorPtr inner_;
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> pairs_, spare_;
};

}  // namespace bulkhead::bench
