#include "parallel/process_groups.h"

#include "runtime/nccl/nccl_backend.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>

#include "parallel/pipeline.h"
#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"
#include "runtime/nccl/nccl_backend.h"

namespace bulkhead::parallel {
namespace {

using Clock = std::chrono::steady_clock;

double msSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

std::string membersText(const std::vector<int>& members) {
  constexpr size_t kShown = 16;
  if (members.size() <= kShown) return fmt::format("{}", fmt::join(members, ","));
  std::vector<int> head(members.begin(), members.begin() + kShown);
  return fmt::format("{},... ({} ranks)", fmt::join(head, ","), members.size());
}

// Rethrows a failure of `step` on the group of `kind` as the same error type,
// naming the group and its members, and keeping the communicator's message
// (through the monitor, it names the unresponsive ranks).
[[noreturn]] void fail(const std::string& step, GroupKind kind, const std::string& group,
                       const std::vector<int>& members, int rank) {
  auto message = [&](const Error& e) {
    return fmt::format(
        "building process groups: {} of {} group {} (ranks {}) failed{}: {} -- every rank must create the same "
        "groups, in the same order, within BULKHEAD_INIT_TIMEOUT: look for the ranks named above (stalled, "
        "crashed, or started with another layout), or raise BULKHEAD_INIT_TIMEOUT if bootstrap is only slow",
        step, toString(kind), group, membersText(members),
        e.group().empty() || e.group() == group ? "" : fmt::format(" on {}", e.group()), e.message());
  };
  ErrorContext context{.rank = rank, .group = group, .expected = fmt::format("{} to complete", step)};
  try {
    throw;
  } catch (const TimeoutError& e) {
    throw TimeoutError(message(e), context, e.sequence(), e.diagnosis());
  } catch (const CommError& e) {
    throw CommError(message(e), context);
  } catch (const DesyncError& e) {
    throw DesyncError(message(e), context);
  }
}

// The operations `kind` carries, once, at `bytes` per rank, under `deadline`.
void warm(Communicator& comm, GroupKind kind, int64_t bytes, Deadline deadline) {
  const int n = comm.size();
  auto options = at::TensorOptions().dtype(at::kFloat).device(comm.device());
  int64_t numel = std::max<int64_t>(1, bytes / 4);
  if (kind == GroupKind::Ep) {
    int64_t row = std::max<int64_t>(1, numel / n);
    at::Tensor send = at::ones({n, row}, options), recv = at::empty({n, row}, options);
    comm.allToAll(send, recv, {}, {}, {.deadline = deadline})->wait(deadline);
  } else if (kind == GroupKind::Pp) {
    warmPipelineLinks(comm, bytes, deadline);
  } else {
    at::Tensor tensor = at::ones({numel}, options);
    comm.allReduce(tensor, {.deadline = deadline})->wait(deadline);
  }
}

}  // namespace

ProcessGroups ProcessGroups::create(CommunicatorPtr world, const LayoutOptions& layoutOptions,
                                    ProcessGroupOptions options) {
  if (!world) throw ConfigError("ProcessGroups::create needs the world communicator, got none");
  return create(world, Layout::create(world->size(), layoutOptions), std::move(options));
}

ProcessGroups ProcessGroups::create(CommunicatorPtr world, const Layout& layout, ProcessGroupOptions options) {
  if (!world) throw ConfigError("ProcessGroups::create needs the world communicator, got none");
  int rank = world->rank();
  if (layout.worldSize() != world->size())
    throw ConfigError(fmt::format("the layout is for {} ranks but the world has {}; build it with "
                                  "Layout::create(world->size(), ...)",
                                  layout.worldSize(), world->size()),
                      {.rank = rank, .group = world->name(), .expected = "layout.worldSize() == world->size()"});
  if (options.warmupBytes < 0)
    throw ConfigError(fmt::format("warm-up bytes must be >= 0, got {}", options.warmupBytes), {.rank = rank});
  Deadline deadline = options.deadline.value_or(Deadline::afterSeconds(env::kInitTimeout.seconds()));

  ProcessGroups groups(world, layout);
  const auto& kinds = allGroupKinds();
  groups.groups_.resize(kinds.size());
  for (GroupKind kind : kinds) {
    int color = layout.groupIndex(kind, rank);
    GroupReport row{.kind = kind,
                    .name = color < 0 ? "-" : fmt::format("{}[{}]", toString(kind), color),
                    .members = layout.groupOf(kind, rank)};
    auto start = Clock::now();
    try {
      groups.groups_[static_cast<size_t>(kind)] = world->split(color, rank, toString(kind), {.deadline = deadline});
    } catch (const Error& e) {
      if (dynamic_cast<const ConfigError*>(&e)) throw;
      fail(fmt::format("creation (split of {})", world->name()), kind, row.name, row.members, rank);
    }
    row.createMs = msSince(start);
    groups.report_.push_back(std::move(row));
  }

  if (options.warmup) {
    for (GroupReport& row : groups.report_) {
      const CommunicatorPtr& comm = groups.get(row.kind);
      if (!comm || comm->size() < 2) continue;
      auto start = Clock::now();
      try {
        warm(*comm, row.kind, options.warmupBytes, deadline);
      } catch (const Error& e) {
        if (dynamic_cast<const ConfigError*>(&e)) throw;
        fail(row.kind == GroupKind::Ep   ? "warm-up all-to-all"
             : row.kind == GroupKind::Pp ? "warm-up send/recv"
                                         : "warm-up all-reduce",
             row.kind, row.name, row.members, rank);
      }
      row.warmMs = msSince(start);
    }
  }

  if (rank == 0) {
    log::info("groups", "built the process groups of rank 0:\n{}", groups.formatReport());
    if (world->device().is_cuda()) {
      NvlinkPredicate reachable = options.nvlink;
      int gpus = nccl::deviceCount();
      if (!reachable && options.localSize > 0 && gpus > 0)  // block placement, one GPU per local rank
        reachable = [local = options.localSize, gpus](int a, int b) {
          return nccl::peerAccess(a % local % gpus, b % local % gpus);
        };
      for (const std::string& warning : checkTopology(layout, {.ranksPerNode = options.localSize, .nvlink = reachable}))
        log::warn("groups", "{}", warning);
    }
  }
  return groups;
}

const CommunicatorPtr& ProcessGroups::get(GroupKind kind) const { return groups_.at(static_cast<size_t>(kind)); }

std::pair<int, int> ProcessGroups::pipelinePeers() const {
  std::vector<int> stages = layout_.groupOf(GroupKind::Pp, world_->rank());
  for (size_t i = 0; i < stages.size(); ++i)
    if (stages[i] == world_->rank()) return {i > 0 ? stages[i - 1] : -1, i + 1 < stages.size() ? stages[i + 1] : -1};
  return {-1, -1};
}

std::string ProcessGroups::formatReport() const {
  std::string text =
      fmt::format("{:<16} {:<20} {:>5} {:>10} {:>10}  {}", "kind", "group", "size", "create ms", "warm ms", "members");
  for (const GroupReport& row : report_)
    text +=
        fmt::format("\n{:<16} {:<20} {:>5} {:>10.2f} {:>10.2f}  {}", toString(row.kind), row.name, row.members.size(),
                    row.createMs, row.warmMs, row.members.empty() ? "-" : membersText(row.members));
  return text;
}

}  // namespace bulkhead::parallel
