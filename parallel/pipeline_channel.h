#pragma once
// Internal to parallel::Pipeline: the pp group's traffic seen from one rank
// during one run. The schedule fixes the order of every message, so each
// rank posts its receives in the order its peers send (pipelineUnits) and
// nothing is matched by reading it first.
//
// What travels:
// - On a CPU backend every tensor goes with a header (direction, stages,
//   micro-batch, run, dtype, shape), read on the host before the tensor is
//   received: reading it costs nothing there, and any mismatch is reported
//   by the stage that received it, naming both stages. Sends go at once,
//   without waiting for their receivers.
// - On a GPU backend an exchange is one grouped call, and a header goes only
//   with the first forward activation a chunk receives in a run (unless
//   activationShape and activationDtype give both), in a grouped call of its
//   own on both ends: it fixes that chunk's activation shape and dtype for
//   the run, so later messages cost no host sync. Gradients go back with
//   the shape of the activations they belong to. A sender whose tensor
//   differs from what its receiver will expect raises DesyncError naming
//   both stages and the micro-batch before sending anything, and ends the
//   job. Sends and receives run on a stream of their own; the current
//   stream waits for an exchange when a step takes what it brought, and the
//   host waits only for headers and at the end of the run.

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "parallel/pipeline.h"

namespace bulkhead::parallel::detail {

enum Direction : int64_t { Forward = 0, Backward = 1 };

// One tensor between two stages.
struct Message {
  Direction direction = Forward;
  int64_t fromStage = 0, toStage = 0, toChunk = 0, microBatch = 0;
  int peer = 0;  // the other end's rank in the pp group
};

// Which received tensor a step takes: direction, receiving chunk, micro-batch.
using Key = std::tuple<int64_t, int64_t, int64_t>;

class Channel {
 public:
  Channel(Communicator& pp, const PipelineOptions& options, int64_t run, std::optional<c10::Stream> stream);

  // Queues `tensor` for the next exchange (a message to this rank itself is
  // delivered at once).
  void post(const Message& message, at::Tensor tensor);
  // Asks for a message in the next exchange. `like`: a tensor of the shape
  // and dtype it has (a backward gradient's activations), else undefined.
  void expect(const Message& message, const at::Tensor& like = {});
  // Issues what was queued and asked for: one grouped exchange, or (split)
  // one for the forward direction and then one for the backward.
  void exchange(bool split);
  // The received tensor of `key`, ready on the current stream.
  at::Tensor take(const Key& key, int myStage);
  // Waits for every exchange of the run; a message nobody took is a desync.
  void finish();

 private:
  struct Expected {
    Message message;
    at::Tensor like;
  };
  struct Issued {  // an exchange in flight, and what it carried
    WorkPtr work;
    std::string what;
    std::vector<int> peers;
  };
  struct Spec {
    at::ScalarType dtype;
    std::vector<int64_t> shape;
  };

  void exchangeDirection(std::optional<Direction> only);
  void exchangeOnHost(const std::vector<std::pair<Message, at::Tensor>>& sends,
                      const std::vector<const Expected*>& receiving, const std::string& what,
                      const std::vector<int>& peers);
  void exchangeOnDevice(const std::vector<std::pair<Message, at::Tensor>>& sends,
                        const std::vector<const Expected*>& receiving, const std::string& what,
                        const std::vector<int>& peers);
  bool headed(const Message& message, bool sending) const;
  // A send's header (where one goes) into `heads`, its tensor into `data`.
  void addSend(std::vector<PeerOp>& heads, std::vector<PeerOp>& data, const Message& message, const at::Tensor& tensor);
  // The receive of `expected` into `into`, which the mailbox keeps for its step.
  PeerOp receive(const Expected& expected, at::Tensor into);
  at::Tensor allocate(const Expected& expected);
  // Checks a header against the message expected; what was sent.
  Spec readHeader(const at::Tensor& head, const Expected& expected);
  WorkPtr issue(std::vector<PeerOp> ops, const std::string& what, std::vector<int> peers);
  void settle(Issued& issued);
  [[noreturn]] void rethrowFrom(const Issued& issued, std::exception_ptr error);
  [[noreturn]] void senderDesync(const Message& message, const Spec& expected, const at::Tensor& tensor,
                                 const std::string& source);
  std::string describe(const Message& message, bool sending) const;

  Communicator& pp_;
  const PipelineOptions& options_;
  int64_t run_;
  std::optional<c10::Stream> stream_;  // GPU: where sends and receives run
  bool hostHeaders_;                   // every message with a header read on the host (CPU backends)
  std::vector<std::pair<Message, at::Tensor>> outgoing_;
  std::vector<Expected> incoming_;
  std::map<Key, at::Tensor> mailbox_;
  std::map<int64_t, Spec> sentSpec_, receivedSpec_;  // by receiving chunk: the run's agreed activations
  std::map<int, std::string> lastFrom_;              // by peer: the last message that came from it
  std::vector<Issued> pending_;
  // GPU: by direction, the event after the exchange that received the next
  // messages, which the current stream waits for when a step takes one.
  std::shared_ptr<c10::Event> arrived_[2];
};

}  // namespace bulkhead::parallel::detail
