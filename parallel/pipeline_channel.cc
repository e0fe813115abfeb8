#include "parallel/pipeline_channel.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "runtime/diagnosis/fatal_exit.h"
#include "runtime/errors.h"

namespace bulkhead::parallel::detail {
namespace {

constexpr int64_t kMagic = 0x42484b5049504531;  // "BHKPIPE1"
constexpr int kHeaderWords = 16, kDims = 8, kMaxDims = kHeaderWords - kDims;

const char* describe(Direction d) { return d == Forward ? "forward activations" : "backward gradients"; }

std::string shapeText(at::ScalarType dtype, const std::vector<int64_t>& shape) {
  return fmt::format("{} [{}]", c10::toString(dtype), fmt::join(shape, ", "));
}

Key keyOf(const Message& m) { return {m.direction, m.toChunk, m.microBatch}; }

bool inDirection(const Message& m, std::optional<Direction> only) { return !only || m.direction == *only; }

}  // namespace

Channel::Channel(Communicator& pp, const PipelineOptions& options, int64_t run, std::optional<c10::Stream> stream)
    : pp_(pp), options_(options), run_(run), stream_(stream), hostHeaders_(pp.device().is_cpu()) {}

std::string Channel::describe(const Message& m, bool sending) const {
  if (sending)
    return fmt::format("stage {} sends micro-batch {}'s {} to stage {}", m.fromStage, m.microBatch,
                       detail::describe(m.direction), m.toStage);
  return fmt::format("stage {} receives micro-batch {}'s {} from stage {}", m.toStage, m.microBatch,
                     detail::describe(m.direction), m.fromStage);
}

void Channel::post(const Message& message, at::Tensor tensor) {
  if (message.peer == pp_.rank()) {  // pp = 1: chunk to chunk on this rank
    mailbox_[keyOf(message)] = std::move(tensor);
    return;
  }
  tensor = tensor.contiguous();
  if (static_cast<int>(tensor.dim()) > kMaxDims)
    throw ConfigError(fmt::format("pipeline: a {}-dimensional activation is more than the {} dimensions a message "
                                  "carries",
                                  tensor.dim(), kMaxDims),
                      {.rank = pp_.rank(), .group = pp_.name()});
  outgoing_.emplace_back(message, std::move(tensor));
}

void Channel::expect(const Message& message, const at::Tensor& like) {
  if (message.peer == pp_.rank()) return;  // its sender put it in the mailbox
  incoming_.push_back({message, like});
}

bool Channel::headed(const Message& m, bool sending) const {
  if (hostHeaders_) return true;
  if (m.direction == Backward || (options_.activationShape && options_.activationDtype)) return false;
  return sending ? sentSpec_.count(m.toChunk) == 0 : receivedSpec_.count(m.toChunk) == 0;
}

void Channel::exchange(bool split) {
  if (split) {
    exchangeDirection(Forward);
    exchangeDirection(Backward);
  } else {
    exchangeDirection(std::nullopt);
  }
  outgoing_.clear();
  incoming_.clear();
}

void Channel::exchangeDirection(std::optional<Direction> only) {
  std::vector<std::pair<Message, at::Tensor>> sends;
  std::vector<const Expected*> receiving;
  std::vector<std::string> parts;
  std::vector<int> peers;
  for (const auto& [message, tensor] : outgoing_) {
    if (!inDirection(message, only)) continue;
    sends.emplace_back(message, tensor);
    parts.push_back(describe(message, true));
    peers.push_back(message.peer);
  }
  for (const Expected& expected : incoming_) {
    if (!inDirection(expected.message, only)) continue;
    receiving.push_back(&expected);
    parts.push_back(describe(expected.message, false));
    peers.push_back(expected.message.peer);
  }
  if (sends.empty() && receiving.empty()) return;
  const std::string what = fmt::format("{}", fmt::join(parts, "; "));
  if (hostHeaders_)
    exchangeOnHost(sends, receiving, what, peers);
  else
    exchangeOnDevice(sends, receiving, what, peers);
}

// CPU backends: sends (each header, then its tensor) go without waiting for
// their receivers, as MPI's and Gloo's sends can; each message's header is
// received and read before its tensor, in the order the peer sent them.
void Channel::exchangeOnHost(const std::vector<std::pair<Message, at::Tensor>>& sends,
                             const std::vector<const Expected*>& receiving, const std::string& what,
                             const std::vector<int>& peers) {
  std::vector<PeerOp> ops, data;
  for (const auto& [message, tensor] : sends) {
    addSend(ops, data, message, tensor);
    ops.insert(ops.end(), std::make_move_iterator(data.begin()), std::make_move_iterator(data.end()));
    data.clear();
  }
  if (!ops.empty()) issue(std::move(ops), what, peers);
  for (const Expected* e : receiving) {
    at::Tensor head = at::empty({kHeaderWords}, at::kLong);
    issue({{PeerOp::Kind::Recv, head, e->message.peer, describe(e->message, false) + " (header)"}}, what, peers);
    settle(pending_.back());
    const Spec spec = readHeader(head, *e);
    issue({receive(*e, at::empty(spec.shape, at::TensorOptions(spec.dtype).device(pp_.device())))}, what, peers);
    settle(pending_.back());
  }
}

// GPUs: one grouped exchange, preceded by a grouped exchange of the headers
// where a chunk's first activations of the run go. Both ends group alike:
// NCCL pairs a pair's sends and receives by their place in the group too.
void Channel::exchangeOnDevice(const std::vector<std::pair<Message, at::Tensor>>& sends,
                               const std::vector<const Expected*>& receiving, const std::string& what,
                               const std::vector<int>& peers) {
  std::vector<PeerOp> headers, ops;
  for (const auto& [message, tensor] : sends) addSend(headers, ops, message, tensor);
  std::vector<at::Tensor> heads;
  for (const Expected* e : receiving) {
    heads.emplace_back();
    if (!headed(e->message, false)) continue;
    heads.back() = at::empty({kHeaderWords}, at::TensorOptions(at::kLong).device(pp_.device()));
    headers.push_back({PeerOp::Kind::Recv, heads.back(), e->message.peer, describe(e->message, false) + " (header)"});
  }
  const bool readHeaders = std::any_of(heads.begin(), heads.end(), [](const at::Tensor& t) { return t.defined(); });
  if (!headers.empty()) issue(std::move(headers), what, peers);
  if (readHeaders) settle(pending_.back());
  for (size_t i = 0; i < receiving.size(); ++i) {
    const Expected& e = *receiving[i];
    if (!heads[i].defined()) {
      ops.push_back(receive(e, allocate(e)));
      continue;
    }
    const Spec spec = readHeader(heads[i], e);
    ops.push_back(receive(e, at::empty(spec.shape, at::TensorOptions(spec.dtype).device(pp_.device()))));
  }
  if (!ops.empty()) issue(std::move(ops), what, peers);
  // The current stream reads what came only once it is there (take()).
  auto received = std::make_shared<c10::Event>(pp_.device().type());
  received->record(*stream_);
  for (const Expected* e : receiving) arrived_[e->message.direction] = received;
}

PeerOp Channel::receive(const Expected& e, at::Tensor into) {
  mailbox_[keyOf(e.message)] = into;
  return {PeerOp::Kind::Recv, std::move(into), e.message.peer, describe(e.message, false)};
}

void Channel::addSend(std::vector<PeerOp>& heads, std::vector<PeerOp>& data, const Message& m,
                      const at::Tensor& tensor) {
  const std::string label = describe(m, true);
  std::vector<int64_t> shape = tensor.sizes().vec();
  if (headed(m, true)) {
    at::Tensor head = at::empty({kHeaderWords}, at::TensorOptions(at::kLong).pinned_memory(!hostHeaders_));
    int64_t* w = head.data_ptr<int64_t>();
    std::fill(w, w + kHeaderWords, 0);
    w[0] = kMagic;
    w[1] = m.direction;
    w[2] = m.fromStage;
    w[3] = m.toChunk;
    w[4] = m.microBatch;
    w[5] = static_cast<int64_t>(tensor.scalar_type());
    w[6] = tensor.dim();
    w[7] = run_;
    std::copy(shape.begin(), shape.end(), w + kDims);
    if (!hostHeaders_) {
      head = head.to(pp_.device(), /*non_blocking=*/true);
      sentSpec_[m.toChunk] = {tensor.scalar_type(), shape};
    }
    heads.push_back({.kind = PeerOp::Kind::Send, .tensor = head, .peer = m.peer, .label = label + " (header)"});
  } else if (m.direction == Forward) {
    // The receiver allocates what the run agreed on (or activationShape says): nothing else may go.
    const auto agreed = sentSpec_.find(m.toChunk);
    Spec expected{
        options_.activationDtype.value_or(agreed != sentSpec_.end() ? agreed->second.dtype : at::kFloat),
        options_.activationShape ? options_.activationShape(static_cast<int>(m.microBatch)) : agreed->second.shape};
    if (expected.dtype != tensor.scalar_type() || expected.shape != shape)
      senderDesync(m, expected, tensor,
                   options_.activationShape ? "activationShape" : "its first micro-batch of this run");
  }
  data.push_back({.kind = PeerOp::Kind::Send, .tensor = tensor, .peer = m.peer, .label = label});
}

at::Tensor Channel::allocate(const Expected& e) {
  if (e.like.defined()) return at::empty(e.like.sizes(), e.like.options());
  const auto agreed = receivedSpec_.find(e.message.toChunk);
  const bool known = agreed != receivedSpec_.end();
  const at::ScalarType dtype = options_.activationDtype.value_or(known ? agreed->second.dtype : at::kFloat);
  std::vector<int64_t> shape = options_.activationShape
                                   ? options_.activationShape(static_cast<int>(e.message.microBatch))
                                   : (known ? agreed->second.shape : std::vector<int64_t>{});
  return at::empty(shape, at::TensorOptions(dtype).device(pp_.device()));
}

Channel::Spec Channel::readHeader(const at::Tensor& head, const Expected& e) {
  const Message& m = e.message;
  at::Tensor host;
  if (stream_) {
    const c10::StreamGuard onStream(*stream_);
    host = head.cpu();
  } else {
    host = head;
  }
  const int64_t* w = host.data_ptr<int64_t>();
  auto expecting = [&] {
    return fmt::format("pipeline stage {} (rank {} of {}) waited for micro-batch {}'s {} from stage {}", m.toStage,
                       pp_.rank(), pp_.name(), m.microBatch, detail::describe(m.direction), m.fromStage);
  };
  if (w[0] != kMagic || w[6] < 0 || w[6] > kMaxDims || (w[1] != Forward && w[1] != Backward))
    throw DesyncError(fmt::format("{}, but rank {} sent something that is not a pipeline message (another "
                                  "operation on this group at the same time?)",
                                  expecting(), m.peer),
                      {.rank = pp_.rank(), .group = pp_.name()});
  const auto direction = static_cast<Direction>(w[1]);
  const int64_t fromStage = w[2], toChunk = w[3], microBatch = w[4], run = w[7];
  if (run != run_ || fromStage != m.fromStage || direction != m.direction || toChunk != m.toChunk ||
      microBatch != m.microBatch)
    throw DesyncError(fmt::format("{}, but rank {} sent micro-batch {}'s {} from stage {} of run {} (this is run "
                                  "{}): the stages run different schedules, skipped a message, or a run was repeated "
                                  "after an error",
                                  expecting(), m.peer, microBatch, detail::describe(direction), fromStage, run, run_),
                      {.rank = pp_.rank(), .group = pp_.name()});
  Spec sent{static_cast<at::ScalarType>(w[5]), std::vector<int64_t>(w + kDims, w + kDims + w[6])};
  lastFrom_[m.peer] = fmt::format("micro-batch {}'s {}", microBatch, detail::describe(direction));
  if (direction == Forward) {
    const bool dtypeOk = !options_.activationDtype || *options_.activationDtype == sent.dtype;
    const auto want = options_.activationShape ? options_.activationShape(static_cast<int>(microBatch)) : sent.shape;
    if (!dtypeOk || want != sent.shape) {
      const auto dtype = options_.activationDtype.value_or(sent.dtype);
      throw DesyncError(fmt::format("pipeline stage {} expected micro-batch {}'s forward activations from stage {} "
                                    "as {}, but stage {} sent {}",
                                    m.toStage, microBatch, fromStage, shapeText(dtype, want), fromStage,
                                    shapeText(sent.dtype, sent.shape)),
                        {.rank = pp_.rank(), .group = pp_.name(), .expected = shapeText(dtype, want)});
    }
  }
  if (!hostHeaders_) receivedSpec_[m.toChunk] = sent;  // the run's agreed activations for this chunk
  return sent;
}

WorkPtr Channel::issue(std::vector<PeerOp> ops, const std::string& what, std::vector<int> peers) {
  // Completed exchanges go (their tensors with them); a failed one raises.
  std::erase_if(pending_, [&](Issued& p) {
    if (!p.work->isCompleted()) return false;
    if (auto error = p.work->exception()) rethrowFrom(p, error);
    return true;
  });
  WorkPtr work;
  const CallOptions options{.deadline = options_.timeoutSeconds
                                            ? std::optional(Deadline::afterSeconds(*options_.timeoutSeconds))
                                            : std::nullopt};
  try {
    if (!stream_) {
      work = pp_.sendRecv(std::move(ops), options);
    } else {
      const c10::impl::VirtualGuardImpl device(pp_.device().type());
      c10::Event ready(pp_.device().type());
      ready.record(device.getStream(pp_.device()));
      ready.block(*stream_);
      const c10::StreamGuard onStream(*stream_);
      work = pp_.sendRecv(std::move(ops), options);
    }
  } catch (const CommError&) {
    // The group was aborted: an earlier exchange's failure says why.
    for (Issued& p : pending_)
      if (p.work->isCompleted() && p.work->exception()) rethrowFrom(p, p.work->exception());
    throw;
  }
  pending_.push_back({work, what, std::move(peers)});
  return work;
}

void Channel::settle(Issued& issued) {
  try {
    issued.work->wait();
  } catch (...) {
    rethrowFrom(issued, std::current_exception());
  }
}

void Channel::rethrowFrom(const Issued& issued, std::exception_ptr error) {
  std::vector<std::string> last;
  for (int peer : issued.peers)
    last.push_back(fmt::format("rank {}: {}", peer, lastFrom_.count(peer) ? lastFrom_[peer] : "none"));
  std::sort(last.begin(), last.end());
  last.erase(std::unique(last.begin(), last.end()), last.end());
  const std::string head =
      fmt::format("pipeline exchange of rank {} of {} did not finish ({}); the last message from each peer: {}",
                  pp_.rank(), pp_.name(), issued.what, fmt::join(last, ", "));
  try {
    std::rethrow_exception(error);
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("{}. A stage it waits on never took part: {}", head, e.message()),
                       {.rank = pp_.rank(), .group = pp_.name(), .expected = issued.what}, e.sequence(), e.diagnosis());
  } catch (const DesyncError& e) {
    throw DesyncError(fmt::format("{}: {}", head, e.message()), {.rank = pp_.rank(), .group = pp_.name()});
  } catch (const CommError& e) {
    throw CommError(fmt::format("{}: the exchange failed (a message of another size means a stage skipped or "
                                "reordered a send): {}",
                                head, e.message()),
                    {.rank = pp_.rank(), .group = pp_.name()});
  }
}

void Channel::senderDesync(const Message& m, const Spec& expected, const at::Tensor& tensor,
                           const std::string& source) {
  DesyncError error(fmt::format("pipeline stage {} (rank {} of {}) would send micro-batch {}'s forward activations "
                                "to stage {} as {}, but stage {} expects {} (from {}); nothing was sent",
                                m.fromStage, pp_.rank(), pp_.name(), m.microBatch, m.toStage,
                                shapeText(tensor.scalar_type(), tensor.sizes().vec()), m.toStage,
                                shapeText(expected.dtype, expected.shape), source),
                    {.rank = pp_.rank(), .group = pp_.name(), .expected = shapeText(expected.dtype, expected.shape)});
  // Its receiver cannot tell without a header: the job ends from here.
  fatal::raise(std::make_exception_ptr(error), error.what());
  pp_.abort(error.message());
  throw error;
}

at::Tensor Channel::take(const Key& key, int myStage) {
  if (auto& event = arrived_[std::get<0>(key)]) {
    const c10::impl::VirtualGuardImpl device(pp_.device().type());
    event->block(device.getStream(pp_.device()));
    event.reset();
  }
  auto it = mailbox_.find(key);
  if (it == mailbox_.end()) {
    auto [direction, chunk, microBatch] = key;
    throw DesyncError(fmt::format("pipeline stage {} found no micro-batch {}'s {} for chunk {}: the schedule's "
                                  "exchanges and steps disagree",
                                  myStage, microBatch, detail::describe(static_cast<Direction>(direction)), chunk),
                      {.rank = pp_.rank(), .group = pp_.name()});
  }
  at::Tensor tensor = std::move(it->second);
  mailbox_.erase(it);
  return tensor;
}

void Channel::finish() {
  for (Issued& issued : pending_) settle(issued);
  pending_.clear();
  if (!mailbox_.empty()) {
    auto [direction, chunk, microBatch] = mailbox_.begin()->first;
    throw DesyncError(
        fmt::format("pipeline: {} message(s) arrived that no step of this run took, the first "
                    "micro-batch {}'s {} for chunk {}: the stages run different schedules",
                    mailbox_.size(), microBatch, detail::describe(static_cast<Direction>(direction)), chunk),
        {.rank = pp_.rank(), .group = pp_.name(), .expected = "the same schedule on every stage"});
  }
}

}  // namespace bulkhead::parallel::detail
