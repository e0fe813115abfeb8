#include "parallel/pipeline.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/autograd.h>

#include <map>
#include <tuple>

#include "runtime/errors.h"

namespace bulkhead::parallel {
namespace {

constexpr int64_t kMagic = 0x42484b5049504531;  // "BHKPIPE1"
constexpr int kHeaderWords = 16, kDims = 8, kMaxDims = kHeaderWords - kDims;

enum Direction : int64_t { Forward = 0, Backward = 1 };
const char* describe(Direction d) { return d == Forward ? "forward activations" : "backward gradients"; }

// What travels ahead of each tensor.
struct Header {
  Direction direction = Forward;
  int64_t fromStage = 0, toChunk = 0, microBatch = 0, run = 0;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};

// Messages of one step: which tensor a receiving chunk waits for.
using Key = std::tuple<int64_t, int64_t, int64_t>;  // direction, receiving chunk, micro-batch

std::string shapeText(at::ScalarType dtype, const std::vector<int64_t>& shape) {
  return fmt::format("{} [{}]", c10::toString(dtype), fmt::join(shape, ", "));
}

// The pp group's traffic seen from one rank: sends keep their tensors until
// the end of the run; receives read a peer's messages in order into a mailbox.
class Channel {
 public:
  Channel(Communicator& pp, const PipelineOptions& options, int64_t run) : pp_(pp), options_(options), run_(run) {}

  void send(int peer, const Header& header, at::Tensor tensor) {
    if (peer == pp_.rank()) {  // pp = 1: chunk to chunk on this rank
      mailbox_[{header.direction, header.toChunk, header.microBatch}] = std::move(tensor);
      return;
    }
    prune();
    tensor = tensor.contiguous();
    if (static_cast<int>(tensor.dim()) > kMaxDims)
      throw ConfigError(fmt::format("pipeline: a {}-dimensional activation is more than the {} dimensions a message "
                                    "carries",
                                    tensor.dim(), kMaxDims),
                        {.rank = pp_.rank(), .group = pp_.name()});
    std::vector<int64_t> words(kHeaderWords, 0);
    words[0] = kMagic;
    words[1] = header.direction;
    words[2] = header.fromStage;
    words[3] = header.toChunk;
    words[4] = header.microBatch;
    words[5] = static_cast<int64_t>(tensor.scalar_type());
    words[6] = tensor.dim();
    words[7] = run_;
    for (int64_t d = 0; d < tensor.dim(); ++d) words[kDims + d] = tensor.size(d);
    at::Tensor head = at::tensor(words, at::kLong).to(pp_.device());
    const std::string label = fmt::format("stage {} micro-batch {} {}", header.fromStage, header.microBatch,
                                          header.direction == Forward ? "forward" : "backward");
    // The Work keeps its tensor until the send completes (the communicator's contract).
    pending_.push_back(pp_.send(head, peer, {.deadline = deadline(), .label = label + " header"}));
    pending_.push_back(pp_.send(tensor, peer, {.deadline = deadline(), .label = label}));
  }

  // The tensor of `key` from `peer`, reading the peer's messages until it comes.
  at::Tensor take(int peer, const Key& key, int myStage, int fromStage) {
    for (;;) {
      if (auto it = mailbox_.find(key); it != mailbox_.end()) {
        at::Tensor tensor = std::move(it->second);
        mailbox_.erase(it);
        return tensor;
      }
      receiveNext(peer, key, myStage, fromStage);
    }
  }

  // Waits for every send of this run; a message nobody took is a desync.
  void finish() {
    for (auto& work : pending_) work->wait();
    pending_.clear();
    if (!mailbox_.empty()) {
      auto [direction, chunk, microBatch] = mailbox_.begin()->first;
      throw DesyncError(fmt::format("pipeline: {} message(s) arrived that no step of this run took, the first "
                                    "micro-batch {}'s {} for chunk {}: the stages run different schedules",
                                    mailbox_.size(), microBatch, describe(static_cast<Direction>(direction)), chunk),
                        {.rank = pp_.rank(), .group = pp_.name(), .expected = "the same schedule on every stage"});
    }
  }

 private:
  std::optional<Deadline> deadline() const {
    if (!options_.timeoutSeconds) return std::nullopt;
    return Deadline::afterSeconds(*options_.timeoutSeconds);
  }

  // Lets go of completed sends (raising the error one ended with).
  void prune() {
    std::vector<WorkPtr> still;
    for (auto& work : pending_) {
      if (!work->isCompleted())
        still.push_back(std::move(work));
      else if (work->exception())
        std::rethrow_exception(work->exception());
    }
    pending_ = std::move(still);
  }

  void receiveNext(int peer, const Key& key, int myStage, int fromStage) {
    auto [direction, chunk, microBatch] = key;
    auto expecting = [&] {
      return fmt::format("pipeline stage {} (rank {} of {}) waited for micro-batch {}'s {} from stage {}", myStage,
                         pp_.rank(), pp_.name(), microBatch, describe(static_cast<Direction>(direction)), fromStage);
    };
    const std::string label =
        fmt::format("stage {} micro-batch {} {}", myStage, microBatch, direction == Forward ? "forward" : "backward");
    auto received = [&](const at::Tensor& tensor, const std::string& what) {
      try {
        pp_.recv(tensor, peer, {.deadline = deadline(), .label = what})->wait();
      } catch (const TimeoutError& e) {
        const std::string last = lastFrom_.count(peer) ? lastFrom_[peer] : "none";
        throw TimeoutError(fmt::format("{}: stage {} never sent it (its last message to stage {}: {}). {}", expecting(),
                                       fromStage, myStage, last, e.message()),
                           {.rank = pp_.rank(),
                            .group = pp_.name(),
                            .expected = fmt::format("micro-batch {} from stage {}", microBatch, fromStage)},
                           e.sequence(), e.diagnosis());
      } catch (const CommError& e) {
        throw CommError(fmt::format("{}: receiving it failed (a message of another size from stage {} means it "
                                    "skipped or reordered a send): {}",
                                    expecting(), fromStage, e.message()),
                        {.rank = pp_.rank(), .group = pp_.name()});
      }
    };
    at::Tensor head = at::empty({kHeaderWords}, at::TensorOptions(at::kLong).device(pp_.device()));
    received(head, label + " header (next message)");
    head = head.cpu();
    const int64_t* w = head.data_ptr<int64_t>();
    if (w[0] != kMagic || w[6] < 0 || w[6] > kMaxDims || (w[1] != Forward && w[1] != Backward))
      throw DesyncError(fmt::format("{}, but rank {} sent something that is not a pipeline message (another "
                                    "operation on this group at the same time?)",
                                    expecting(), peer),
                        {.rank = pp_.rank(), .group = pp_.name()});
    Header h{.direction = static_cast<Direction>(w[1]),
             .fromStage = w[2],
             .toChunk = w[3],
             .microBatch = w[4],
             .run = w[7],
             .dtype = static_cast<at::ScalarType>(w[5]),
             .shape = std::vector<int64_t>(w + kDims, w + kDims + w[6])};
    const Key arrived{h.direction, h.toChunk, h.microBatch};
    // The stage that feeds (direction, chunk) here: the previous one forward, the next one backward.
    const int64_t receiver = h.toChunk * pp_.size() + pp_.rank();
    const int64_t sender = h.direction == Forward ? receiver - 1 : receiver + 1;
    if (h.run != run_ || h.fromStage != sender || mailbox_.count(arrived))
      throw DesyncError(fmt::format("{}, but rank {} sent micro-batch {}'s {} from stage {} of run {} (this is run "
                                    "{}{}): the stages run different schedules, or a run was repeated after an error",
                                    expecting(), peer, h.microBatch, describe(h.direction), h.fromStage, h.run, run_,
                                    mailbox_.count(arrived) ? ", and that message came twice" : ""),
                        {.rank = pp_.rank(), .group = pp_.name()});
    if (h.direction == Forward) checkActivation(h, myStage);
    at::Tensor tensor = at::empty(h.shape, at::TensorOptions(h.dtype).device(pp_.device()));
    received(tensor, fmt::format("from stage {} micro-batch {} {}", h.fromStage, h.microBatch,
                                 h.direction == Forward ? "forward" : "backward"));
    lastFrom_[peer] = fmt::format("micro-batch {}'s {}", h.microBatch, describe(h.direction));
    mailbox_[arrived] = std::move(tensor);
  }

  void checkActivation(const Header& h, int myStage) {
    const bool dtypeOk = !options_.activationDtype || *options_.activationDtype == h.dtype;
    const bool shapeOk =
        !options_.activationShape || options_.activationShape(static_cast<int>(h.microBatch)) == h.shape;
    if (dtypeOk && shapeOk) return;
    const auto dtype = options_.activationDtype.value_or(h.dtype);
    const auto shape = options_.activationShape ? options_.activationShape(static_cast<int>(h.microBatch)) : h.shape;
    throw DesyncError(fmt::format("pipeline stage {} expected micro-batch {}'s forward activations from stage {} as "
                                  "{}, but stage {} sent {}",
                                  myStage, h.microBatch, h.fromStage, shapeText(dtype, shape), h.fromStage,
                                  shapeText(h.dtype, h.shape)),
                      {.rank = pp_.rank(), .group = pp_.name(), .expected = shapeText(dtype, shape)});
  }

  Communicator& pp_;
  const PipelineOptions& options_;
  std::map<Key, at::Tensor> mailbox_;
  int64_t run_;
  std::map<int, std::string> lastFrom_;
  std::vector<WorkPtr> pending_;
};

// What one micro-batch of one chunk keeps between its forward and backward.
struct Held {
  at::Tensor input, output, auxLoss;
};

}  // namespace

Pipeline::Pipeline(CommunicatorPtr pp, PipelineOptions options) : pp_(std::move(pp)), options_(std::move(options)) {
  if (!pp_) throw ConfigError("pipeline: no pp communicator", {.expected = "the pp group (ProcessGroups::pp())"});
  // NCCL runs a send until its peer receives, in stream order: the schedule's
  // send-then-receive between two neighbours needs them grouped
  // (ncclGroupStart/End), which the communicator does not offer yet.
  if (pp_->size() > 1 && std::string(pp_->backend()) == "nccl")
    throw ConfigError(fmt::format("pipeline: {} runs on the nccl backend, whose sends and receives are not grouped "
                                  "yet, so a schedule could stall on them; run pipelines of more than one stage "
                                  "with the mpi backend (--backend mpi)",
                                  pp_->name()),
                      {.rank = pp_->rank(), .group = pp_->name(), .expected = "the mpi backend for pp > 1"});
}

PipelineResult Pipeline::run(const std::vector<PipelineChunk>& chunks) {
  const int P = pp_->size(), r = pp_->rank(), V = static_cast<int>(chunks.size()), M = options_.microBatches;
  if (V < 1) throw ConfigError("pipeline: no chunk to run", {.rank = r, .group = pp_->name()});
  const auto steps = pipelineSteps(options_.schedule, {.stages = P, .rank = r, .virtualStages = V, .microBatches = M});
  const int lastStage = P * V - 1, next = (r + 1) % P, previous = (r + P - 1) % P;
  const double scale = options_.lossScale > 0 ? options_.lossScale : 1.0 / M;
  Channel channel(*pp_, options_, runs_++);
  std::map<std::pair<int, int>, Held> held;  // (chunk, micro-batch)
  PipelineResult result;
  std::vector<at::Tensor> losses(M);

  for (const PipelineStep& step : steps) {
    const int stage = step.chunk * P + r, m = step.microBatch;
    if (step.forward) {
      at::Tensor input;
      if (stage > 0) {
        input = channel.take(previous, {Forward, step.chunk, m}, stage, stage - 1).detach().requires_grad_(true);
      }
      PipelineOutput out = chunks[step.chunk].forward(m, input);
      at::Tensor& output = out.output;
      if (stage == lastStage) {
        if (output.numel() != 1)
          throw ConfigError(fmt::format("pipeline: the last stage's forward returned {} values for micro-batch {}, "
                                        "not its loss",
                                        output.numel(), m),
                            {.rank = r, .group = pp_->name(), .expected = "a scalar loss"});
        losses[m] = output.detach().to(at::kDouble).reshape({});
      } else {
        const int toChunk = r == P - 1 ? step.chunk + 1 : step.chunk;
        channel.send(next, {.direction = Forward, .fromStage = stage, .toChunk = toChunk, .microBatch = m},
                     output.detach());
      }
      held[{step.chunk, m}] = {input, output, out.auxLoss};
      result.maxLiveActivations = std::max(result.maxLiveActivations, static_cast<int>(held.size()));
      continue;
    }
    auto it = held.find({step.chunk, m});
    Held h = std::move(it->second);
    held.erase(it);
    const bool aux = h.auxLoss.defined() && h.auxLoss.requires_grad();
    if (stage == lastStage) {
      ((aux ? h.output + h.auxLoss : h.output) * scale).backward();
    } else {
      at::Tensor grad = channel.take(next, {Backward, step.chunk, m}, stage, stage + 1);
      if (aux)
        torch::autograd::backward({h.output, h.auxLoss}, {grad, at::full_like(h.auxLoss, scale)});
      else
        torch::autograd::backward({h.output}, {grad});
    }
    if (stage > 0) {
      const int toChunk = r == 0 ? step.chunk - 1 : step.chunk;
      at::Tensor grad = h.input.grad().defined() ? h.input.grad() : at::zeros_like(h.input);
      channel.send(previous, {.direction = Backward, .fromStage = stage, .toChunk = toChunk, .microBatch = m}, grad);
    }
  }
  channel.finish();
  if (r == P - 1) {  // the last stage lives on the last rank
    result.losses = at::stack(losses);
  }
  return result;
}

}  // namespace bulkhead::parallel
