#include "parallel/pipeline.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/autograd.h>

#include <map>

#include "parallel/pipeline_channel.h"
#include "runtime/env.h"
#include "runtime/errors.h"

namespace bulkhead::parallel {
namespace {

using detail::Backward;
using detail::Forward;

// What one micro-batch of one chunk keeps between its forward and backward.
struct Held {
  at::Tensor input, output, auxLoss;
};

// One run on one rank: the steps' compute, and the messages they need and make.
class RunState {
 public:
  RunState(Communicator& pp, const PipelineOptions& options, const std::vector<PipelineChunk>& chunks,
           detail::Channel& channel, bool forwardOnly = false)
      : forwardOnly_(forwardOnly),
        pp_(pp),
        options_(options),
        chunks_(chunks),
        channel_(channel),
        P_(pp.size()),
        r_(pp.rank()),
        lastStage_(P_ * static_cast<int>(chunks.size()) - 1),
        scale_(options.lossScale > 0 ? options.lossScale : 1.0 / options.microBatches),
        losses_(options.microBatches) {}

  // Asks the channel for what `step` receives.
  void expect(const PipelineStep& step) {
    const int stage = step.chunk * P_ + r_, m = step.microBatch;
    if (step.forward && stage > 0) {
      channel_.expect(message(Forward, stage - 1, stage, m));
    } else if (!step.forward && stage < lastStage_) {
      channel_.expect(message(Backward, stage + 1, stage, m), held_.at({step.chunk, m}).output);
    }
  }

  // A step's compute, announced to onStep once its input is there (the
  // current stream waits for it first), so a trace shows the wait as idle.
  void compute(const PipelineStep& step) {
    if (step.forward)
      forward(step);
    else
      backward(step);
    if (options_.onStep) options_.onStep(step, false);
  }

  PipelineResult finish() {
    PipelineResult result;
    result.maxLiveActivations = maxLive_;
    if (r_ == P_ - 1) result.losses = at::stack(losses_);  // the last stage lives on the last rank
    return result;
  }

 private:
  // The message from stage `from` to stage `to` of micro-batch m.
  detail::Message message(detail::Direction direction, int from, int to, int m) const {
    return {.direction = direction,
            .fromStage = from,
            .toStage = to,
            .toChunk = to / P_,
            .microBatch = m,
            .peer = to % P_ == r_ ? from % P_ : to % P_};
  }

  void forward(const PipelineStep& step) {
    const int stage = step.chunk * P_ + r_, m = step.microBatch;
    at::Tensor input;
    if (stage > 0) input = channel_.take({Forward, step.chunk, m}, stage).detach().requires_grad_(!forwardOnly_);
    if (options_.onStep) options_.onStep(step, true);
    PipelineOutput out = chunks_[step.chunk].forward(m, input);
    at::Tensor& output = out.output;
    if (stage == lastStage_) {
      if (output.numel() != 1)
        throw ConfigError(fmt::format("pipeline: the last stage's forward returned {} values for micro-batch {}, "
                                      "not its loss",
                                      output.numel(), m),
                          {.rank = r_, .group = pp_.name(), .expected = "a scalar loss"});
      losses_[m] = output.detach().to(at::kDouble).reshape({});
    } else {
      channel_.post(message(Forward, stage, stage + 1, m), output.detach());
    }
    if (forwardOnly_) return;
    held_[{step.chunk, m}] = {input, output, out.auxLoss};
    maxLive_ = std::max(maxLive_, static_cast<int>(held_.size()));
  }

  void backward(const PipelineStep& step) {
    const int stage = step.chunk * P_ + r_, m = step.microBatch;
    auto it = held_.find({step.chunk, m});
    Held h = std::move(it->second);
    held_.erase(it);
    const bool aux = h.auxLoss.defined() && h.auxLoss.requires_grad();
    at::Tensor grad;
    if (stage != lastStage_) grad = channel_.take({Backward, step.chunk, m}, stage);
    if (options_.onStep) options_.onStep(step, true);
    if (stage == lastStage_) {
      ((aux ? h.output + h.auxLoss : h.output) * scale_).backward();
    } else {
      if (aux)
        torch::autograd::backward({h.output, h.auxLoss}, {grad, at::full_like(h.auxLoss, scale_)});
      else
        torch::autograd::backward({h.output}, {grad});
    }
    if (stage > 0) {
      at::Tensor grad = h.input.grad().defined() ? h.input.grad() : at::zeros_like(h.input);
      channel_.post(message(Backward, stage, stage - 1, m), grad);
    }
  }

  const bool forwardOnly_;
  Communicator& pp_;
  const PipelineOptions& options_;
  const std::vector<PipelineChunk>& chunks_;
  detail::Channel& channel_;
  const int P_, r_, lastStage_;
  const double scale_;
  std::map<std::pair<int, int>, Held> held_;  // (chunk, micro-batch)
  std::vector<at::Tensor> losses_;
  int maxLive_ = 0;
};

// The forward-only schedule: unit t holds (chunk c, micro-batch t - c P - r) of every chunk where that
// micro-batch exists, chunks in order, so each pair of ranks sends and receives in the same order.
std::vector<std::vector<PipelineStep>> forwardUnits(int P, int r, int V, int M) {
  std::vector<std::vector<PipelineStep>> units(static_cast<size_t>(M + V * P - 1));
  for (int t = 0; t < static_cast<int>(units.size()); ++t)
    for (int c = 0; c < V; ++c)
      if (const int m = t - c * P - r; m >= 0 && m < M)
        units[t].push_back({.forward = true, .chunk = c, .microBatch = m});
  return units;
}

}  // namespace

Pipeline::Pipeline(CommunicatorPtr pp, PipelineOptions options) : pp_(std::move(pp)), options_(std::move(options)) {
  if (!pp_) throw ConfigError("pipeline: no pp communicator", {.expected = "the pp group (ProcessGroups::pp())"});
  // One stream for the pipeline's life: the caching allocator keeps its
  // blocks per stream, so a new stream each run would allocate afresh.
  const c10::Device device = pp_->device();
  if (pp_->size() > 1 && !device.is_cpu()) {
    stream_ = c10::impl::VirtualGuardImpl(device.type()).getStreamFromGlobalPool(device);
    // Already done where ProcessGroups made the group; a group from elsewhere
    // must not meet its first connection inside a schedule's exchange.
    warmPipelineLinks(*pp_, int64_t{8} << 20,
                      Deadline::afterSeconds(options_.timeoutSeconds.value_or(env::kInitTimeout.seconds())));
  }
}

void warmPipelineLinks(Communicator& pp, int64_t bytes, Deadline deadline) {
  const int n = pp.size(), me = pp.rank();
  if (n < 2) return;
  const auto options = at::TensorOptions(at::kFloat).device(pp.device());
  const int64_t numel = std::max<int64_t>(1, bytes / 4);
  at::Tensor out = at::ones({numel}, options), in = at::empty({numel}, options);
  for (int direction : {+1, -1}) {
    const int to = (me + direction + n) % n, from = (me - direction + n) % n;
    pp.sendRecv({{PeerOp::Kind::Send, out, to, "pipeline warm-up"}, {PeerOp::Kind::Recv, in, from, "pipeline warm-up"}},
                {.deadline = deadline})
        ->wait(deadline);
  }
}

PipelineResult Pipeline::run(const std::vector<PipelineChunk>& chunks) {
  const int P = pp_->size(), r = pp_->rank(), V = static_cast<int>(chunks.size()), M = options_.microBatches;
  if (V < 1) throw ConfigError("pipeline: no chunk to run", {.rank = r, .group = pp_->name()});
  const auto units = pipelineUnits(options_.schedule, {.stages = P, .rank = r, .virtualStages = V, .microBatches = M});
  // Interleaving exchanges each direction on its own (Megatron-LM's
  // overlapped p2p): a unit's forward then runs while its backward's
  // messages move. pipeline_schedule_test checks either way for deadlocks.
  const bool split = options_.schedule == PipelineSchedule::Interleaved;
  detail::Channel channel(*pp_, options_, runs_++, stream_);
  RunState state(*pp_, options_, chunks, channel);
  for (size_t u = 0; u <= units.size(); ++u) {
    if (u < units.size())
      for (const PipelineStep& step : units[u]) state.expect(step);
    channel.exchange(split);  // the previous unit's sends with this unit's receives
    if (u == units.size()) break;
    for (const PipelineStep& step : units[u]) state.compute(step);
  }
  channel.finish();
  return state.finish();
}

PipelineResult Pipeline::evaluate(const std::vector<PipelineChunk>& chunks) {
  const int P = pp_->size(), r = pp_->rank(), V = static_cast<int>(chunks.size()), M = options_.microBatches;
  if (V < 1) throw ConfigError("pipeline: no chunk to run", {.rank = r, .group = pp_->name()});
  c10::NoGradGuard noGrad;
  const auto units = forwardUnits(P, r, V, M);
  detail::Channel channel(*pp_, options_, runs_++, stream_);
  RunState state(*pp_, options_, chunks, channel, /*forwardOnly=*/true);
  for (size_t u = 0; u <= units.size(); ++u) {
    if (u < units.size())
      for (const PipelineStep& step : units[u]) state.expect(step);
    channel.exchange(/*split=*/false);
    if (u == units.size()) break;
    for (const PipelineStep& step : units[u]) state.compute(step);
  }
  channel.finish();
  return state.finish();
}

}  // namespace bulkhead::parallel
