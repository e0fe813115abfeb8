#include "runtime/diagnosis/op_checks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace bulkhead::checks {

ErrorContext context(const Communicator& comm, const std::string& expected) {
  int worldRank = comm.members().empty() ? comm.rank() : comm.members().at(comm.rank());
  return {.rank = worldRank, .group = comm.name(), .expected = expected};
}

std::string describeGroup(const Communicator& comm) {
  return fmt::format("{} (ranks {})", comm.name(), fmt::join(comm.members(), ","));
}

void tensor(const Communicator& comm, const BackendRules& rules, const at::Tensor& t, const char* role) {
  if (!t.defined()) throw ConfigError(fmt::format("{}: the {} tensor is undefined", comm.name(), role), context(comm));
  if (t.device().type() != rules.device)
    throw ConfigError(fmt::format("the {} tensor is on {}, but the {} backend works on {} tensors; move it with .to()",
                                  role, t.device().str(), comm.backend(), c10::DeviceTypeName(rules.device, true)),
                      context(comm, c10::DeviceTypeName(rules.device, true)));
  if (std::find(rules.dtypes.begin(), rules.dtypes.end(), t.scalar_type()) == rules.dtypes.end()) {
    std::vector<std::string> names;
    for (auto d : rules.dtypes) names.emplace_back(dtypeName(d));
    throw ConfigError(fmt::format("the {} tensor has dtype {}, which the {} backend does not support", role,
                                  dtypeName(t.scalar_type()), comm.backend()),
                      context(comm, fmt::format("one of {}", fmt::join(names, ", "))));
  }
  if (!t.is_contiguous())
    throw ConfigError(fmt::format("the {} tensor is not contiguous; pass tensor.contiguous()", role),
                      context(comm, "a contiguous tensor"));
}

void sameDtype(const Communicator& comm, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type())
    throw ConfigError(
        fmt::format("input is {} but output is {}", dtypeName(a.scalar_type()), dtypeName(b.scalar_type())),
        context(comm, "input and output of the same dtype"));
}

void numel(const Communicator& comm, const at::Tensor& t, int64_t expected, const char* role, const char* why) {
  if (t.numel() != expected)
    throw ConfigError(fmt::format("the {} tensor has {} elements; {}", role, t.numel(), why),
                      context(comm, fmt::format("{} elements", expected)));
}

void peer(const Communicator& comm, int peer, const char* role) {
  if (peer < 0 || peer >= comm.size())
    throw ConfigError(fmt::format("{} {} is not a rank of {}", role, peer, describeGroup(comm)),
                      context(comm, fmt::format("a {} in [0, {})", role, comm.size())));
}

int64_t rowElements(const at::Tensor& t) {
  int64_t elements = 1;
  for (int64_t d = 1; d < t.dim(); ++d) elements *= t.size(d);
  return elements;
}

std::vector<int64_t> splits(const Communicator& comm, const at::Tensor& t, std::vector<int64_t> splits,
                            const char* role) {
  int64_t rows = t.dim() == 0 ? 1 : t.size(0);
  if (splits.empty()) {
    if (rows % comm.size() != 0)
      throw ConfigError(fmt::format("{} has {} rows, which do not split evenly over {} ranks; pass split sizes", role,
                                    rows, comm.size()),
                        context(comm, fmt::format("rows divisible by {}", comm.size())));
    return std::vector<int64_t>(comm.size(), rows / comm.size());
  }
  if (static_cast<int>(splits.size()) != comm.size())
    throw ConfigError(
        fmt::format("{} split sizes has {} entries for a group of {} ranks", role, splits.size(), comm.size()),
        context(comm, fmt::format("{} split sizes, one per rank", comm.size())));
  int64_t total = 0;
  for (size_t r = 0; r < splits.size(); ++r) {
    if (splits[r] < 0)
      throw ConfigError(fmt::format("{} split size for rank {} is negative ({})", role, r, splits[r]),
                        context(comm, "split sizes >= 0"));
    total += splits[r];
  }
  if (total != rows)
    throw ConfigError(fmt::format("{} split sizes [{}] add up to {} rows, but the tensor has {}", role,
                                  fmt::join(splits, ","), total, rows),
                      context(comm, fmt::format("split sizes adding up to {}", rows)));
  return splits;
}

void selfSplit(const Communicator& comm, const std::vector<int64_t>& sendSplits,
               const std::vector<int64_t>& recvSplits) {
  int me = comm.rank();
  if (sendSplits[me] != recvSplits[me])
    throw ConfigError(fmt::format("all-to-all sends {} rows from rank {} to itself but expects {} back", sendSplits[me],
                                  me, recvSplits[me]),
                      context(comm, "send split == recv split for this rank's own pair"));
}

void sameRowShape(const Communicator& comm, const at::Tensor& send, const at::Tensor& recv) {
  bool same = send.dim() == recv.dim();
  for (int64_t d = 1; same && d < send.dim(); ++d) same = send.size(d) == recv.size(d);
  if (!same)
    throw ConfigError(fmt::format("send has shape [{}] but recv [{}]: rows differ", fmt::join(send.sizes(), ","),
                                  fmt::join(recv.sizes(), ",")),
                      context(comm, "send and recv tensors with the same shape past dim 0"));
}

Fingerprint fingerprint(OpType op, const at::Tensor& t) {
  Fingerprint fp{.op = op};
  if (t.defined()) {
    fp.dtype = t.scalar_type();
    fp.numel = t.numel();
    fp.shape.assign(t.sizes().begin(), t.sizes().end());
  }
  return fp;
}

namespace {
void floatingForAvg(const Communicator& comm, const at::Tensor& t, ReduceOp op) {
  if (op == ReduceOp::Avg && c10::isIntegralType(t.scalar_type(), /*includeBool=*/true))
    throw ConfigError("avg is defined for floating-point tensors; reduce integers with sum and divide",
                      context(comm, "a floating-point dtype for avg"));
}
}  // namespace

void allReduceArgs(const Communicator& comm, const BackendRules& rules, const at::Tensor& tensor, ReduceOp op) {
  checks::tensor(comm, rules, tensor, "all-reduce");
  floatingForAvg(comm, tensor, op);
}

void allGatherArgs(const Communicator& comm, const BackendRules& rules, const at::Tensor& input,
                   const at::Tensor& output) {
  checks::tensor(comm, rules, input, "all-gather input");
  checks::tensor(comm, rules, output, "all-gather output");
  sameDtype(comm, input, output);
  numel(comm, output, input.numel() * comm.size(), "all-gather output", "it must hold size() inputs");
}

void reduceScatterArgs(const Communicator& comm, const BackendRules& rules, const at::Tensor& input,
                       const at::Tensor& output, ReduceOp op) {
  checks::tensor(comm, rules, input, "reduce-scatter input");
  checks::tensor(comm, rules, output, "reduce-scatter output");
  sameDtype(comm, input, output);
  numel(comm, input, output.numel() * comm.size(), "reduce-scatter input", "it must hold size() outputs");
  floatingForAvg(comm, input, op);
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> allToAllArgs(const Communicator& comm, const BackendRules& rules,
                                                                   const at::Tensor& send, const at::Tensor& recv,
                                                                   std::vector<int64_t> sendSplits,
                                                                   std::vector<int64_t> recvSplits) {
  checks::tensor(comm, rules, send, "all-to-all send");
  checks::tensor(comm, rules, recv, "all-to-all recv");
  sameDtype(comm, send, recv);
  sameRowShape(comm, send, recv);
  sendSplits = splits(comm, send, std::move(sendSplits), "all-to-all send");
  recvSplits = splits(comm, recv, std::move(recvSplits), "all-to-all recv");
  selfSplit(comm, sendSplits, recvSplits);
  return {std::move(sendSplits), std::move(recvSplits)};
}

}  // namespace bulkhead::checks
