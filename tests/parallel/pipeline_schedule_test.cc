// Pipeline schedules' grouped exchanges, modelled with NCCL's semantics: per
// ordered pair of ranks, sends and receives match in issue order and must
// carry the same message, and each rank's groups, run one at a time, never
// wait on one another in a cycle (every schedule, P <= 8, V <= 4, M <= 16).
// The checker is shown to catch both faults, and pipelineUnits to split
// exactly pipelineSteps.
#include "parallel/pipeline_schedule.h"

#include <fmt/format.h>

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "runtime/errors.h"
#include "tests/support/catch_compat.h"
#include "tests/support/text.h"

using namespace bulkhead;
using namespace bulkhead::parallel;

namespace {

// One send or receive of a grouped exchange.
struct Op {
  bool send = true;
  int peer = 0;
  bool forward = true;  // F (activations) or B (gradients)
  int stage = 0;        // the sending stage
  int microBatch = 0;
  bool header = false;  // the header ahead of a chunk's first activations of a run (GPUs)
};
using Group = std::vector<Op>;
using RankGroups = std::vector<Group>;  // one rank's groups in issue order

std::string idOf(const Op& op) {
  return fmt::format("{}{}({}, {})", op.header ? "header of " : "", op.forward ? 'F' : 'B', op.stage, op.microBatch);
}

// With headers: before a group that sends or receives a chunk's first
// forward activations, a group of their headers alone, as on GPUs.
RankGroups withHeaders(const RankGroups& groups, int P) {
  RankGroups out;
  std::set<std::pair<bool, int>> headed;  // (sending, receiving chunk)
  for (const Group& group : groups) {
    Group headers;
    for (const Op& op : group) {
      if (!op.forward || !headed.insert({op.send, (op.stage + 1) / P}).second) continue;
      Op header = op;
      header.header = true;
      headers.push_back(header);
    }
    if (!headers.empty()) out.push_back(std::move(headers));
    out.push_back(group);
  }
  return out;
}

// One rank's groups as the pipeline issues them: before unit u, the sends of
// unit u - 1 and the receives of unit u; split: the forward-direction ops,
// then the backward-direction ones. Messages to this rank itself go through
// its mailbox (parallel/pipeline_channel.cc), in no group.
RankGroups groupsOf(PipelineSchedule schedule, int P, int V, int M, int rank) {
  const auto units = pipelineUnits(schedule, {.stages = P, .rank = rank, .virtualStages = V, .microBatches = M});
  const int last = P * V - 1;
  auto sendsOf = [&](const std::vector<PipelineStep>& unit, Group& ops) {
    for (const PipelineStep& s : unit) {
      const int g = s.chunk * P + rank;
      if (s.forward && g < last) ops.push_back({true, (g + 1) % P, true, g, s.microBatch});
      if (!s.forward && g > 0) ops.push_back({true, (g - 1) % P, false, g, s.microBatch});
    }
  };
  auto receivesOf = [&](const std::vector<PipelineStep>& unit, Group& ops) {
    for (const PipelineStep& s : unit) {
      const int g = s.chunk * P + rank;
      if (s.forward && g > 0) ops.push_back({false, (g - 1) % P, true, g - 1, s.microBatch});
      if (!s.forward && g < last) ops.push_back({false, (g + 1) % P, false, g + 1, s.microBatch});
    }
  };
  const bool split = schedule == PipelineSchedule::Interleaved;
  RankGroups groups;
  for (size_t u = 0; u <= units.size(); ++u) {
    Group ops;
    if (u > 0) sendsOf(units[u - 1], ops);
    if (u < units.size()) receivesOf(units[u], ops);
    std::erase_if(ops, [&](const Op& op) { return op.peer == rank; });
    for (int pass = 0; pass < (split ? 2 : 1); ++pass) {
      Group group;
      for (const Op& op : ops)
        if (!split || op.forward == (pass == 0)) group.push_back(op);
      if (!group.empty()) groups.push_back(std::move(group));
    }
  }
  return groups;
}

// Where an op sits: its rank and the index of its group there.
struct Place {
  int rank = 0;
  size_t group = 0;
};

// Pairs each op with its counterpart (k-th send a -> b with the k-th receive
// on b from a); `waits[r][i]` gets, for each op of rank r's group i, the
// place of its counterpart. Returns the first mismatch, else "".
std::string matchOps(const std::vector<RankGroups>& ranks, std::vector<std::vector<std::vector<Place>>>& waits) {
  // (sender, receiver) -> the sends / the receives of that pair, in issue order.
  std::map<std::pair<int, int>, std::vector<std::pair<Place, const Op*>>> sends, receives;
  std::map<const Op*, int> within;  // an op's place among its group's ops of the same pair and kind
  for (int r = 0; r < static_cast<int>(ranks.size()); ++r)
    for (size_t i = 0; i < ranks[r].size(); ++i) {
      std::map<std::pair<bool, int>, int> counts;
      for (const Op& op : ranks[r][i]) {
        if (op.peer < 0 || op.peer >= static_cast<int>(ranks.size()))
          return fmt::format("rank {} names rank {}, outside the pipeline", r, op.peer);
        auto& list = op.send ? sends[{r, op.peer}] : receives[{op.peer, r}];
        list.push_back({Place{r, i}, &op});
        within[&op] = counts[{op.send, op.peer}]++;
      }
    }
  waits.assign(ranks.size(), {});
  for (size_t r = 0; r < ranks.size(); ++r) waits[r].resize(ranks[r].size());
  for (const auto& [pair, sent] : sends) {
    const auto& received = receives[pair];
    if (sent.size() != received.size())
      return fmt::format("count mismatch: rank {} sends {} messages to rank {}, which receives {}", pair.first,
                         sent.size(), pair.second, received.size());
    for (size_t k = 0; k < sent.size(); ++k) {
      const auto& [from, sendOp] = sent[k];
      const auto& [to, receiveOp] = received[k];
      if (idOf(*sendOp) != idOf(*receiveOp))
        return fmt::format("order mismatch: rank {}'s send #{} to rank {} is {}, but that rank's receive #{} is {}",
                           pair.first, k, pair.second, idOf(*sendOp), k, idOf(*receiveOp));
      // NCCL pairs a pair's operations by their place in the group as well.
      if (within[sendOp] != within[receiveOp])
        return fmt::format(
            "group mismatch: rank {}'s send #{} to rank {} is its group's #{} to that rank, the "
            "receive its group's #{}",
            pair.first, k, pair.second, within[sendOp], within[receiveOp]);
      waits[from.rank][from.group].push_back(to);
      waits[to.rank][to.group].push_back(from);
    }
  }
  for (const auto& [pair, received] : receives)
    if (!received.empty() && sends[pair].empty())
      return fmt::format("count mismatch: rank {} receives {} messages from rank {}, which sends none", pair.second,
                         received.size(), pair.first);
  return "";
}

// Checks order, then runs the groups: a rank leaves its current group once
// every counterpart's rank has reached the group holding it. "" when every
// rank gets through every group, else the first problem.
std::string checkExchanges(const std::vector<RankGroups>& ranks) {
  std::vector<std::vector<std::vector<Place>>> waits;
  if (std::string problem = matchOps(ranks, waits); !problem.empty()) return problem;
  std::vector<size_t> at(ranks.size(), 0);
  auto ready = [&](size_t r) {
    for (const Place& p : waits[r][at[r]])
      if (at[p.rank] < p.group) return false;
    return true;
  };
  for (bool moved = true; moved;) {
    moved = false;
    for (size_t r = 0; r < ranks.size(); ++r)
      while (at[r] < ranks[r].size() && ready(r)) {
        ++at[r];
        moved = true;
      }
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (at[r] == ranks[r].size()) continue;
    std::string ops;
    for (const Op& op : ranks[r][at[r]])
      ops += fmt::format(" {} {} {} rank {};", op.send ? "send" : "recv", idOf(op), op.send ? "to" : "from", op.peer);
    return fmt::format("deadlock: rank {} is stuck in group {} of {}:{}", r, at[r], ranks[r].size(), ops);
  }
  return "";
}

std::string checkSchedule(PipelineSchedule schedule, int P, int V, int M, bool headers) {
  std::vector<RankGroups> ranks;
  for (int r = 0; r < P; ++r)
    ranks.push_back(headers ? withHeaders(groupsOf(schedule, P, V, M, r), P) : groupsOf(schedule, P, V, M, r));
  return checkExchanges(ranks);
}

// Steps as text, e.g. "F0.1 B0.0": direction, chunk, micro-batch.
std::string textOf(const std::vector<PipelineStep>& steps) {
  std::string text;
  for (const PipelineStep& s : steps)
    text += fmt::format("{}{}{}.{}", text.empty() ? "" : " ", s.forward ? 'F' : 'B', s.chunk, s.microBatch);
  return text;
}

using bulkhead::testing::contains;

}  // namespace

TEST_CASE("every schedule's grouped exchanges match in order and never deadlock", "[pipeline_schedule]") {
  int checked = 0;
  for (PipelineSchedule schedule :
       {PipelineSchedule::AllForwardAllBackward, PipelineSchedule::OneFOneB, PipelineSchedule::Interleaved})
    for (int P = 1; P <= 8; ++P)
      for (int V = 1; V <= (schedule == PipelineSchedule::OneFOneB ? 1 : 4); ++V)
        for (int M = 1; M <= 16; ++M) {
          INFO(fmt::format("{} P={} V={} M={}", toString(schedule), P, V, M));
          try {
            pipelineSteps(schedule, {.stages = P, .rank = 0, .virtualStages = V, .microBatches = M});
          } catch (const ConfigError&) {
            continue;  // a shape the schedule refuses
          }
          REQUIRE(checkSchedule(schedule, P, V, M, false) == "");
          REQUIRE(checkSchedule(schedule, P, V, M, true) == "");  // GPUs: a first micro-batch's header ahead
          ++checked;
        }
  CHECK(checked > 500);
}

TEST_CASE("the exchange checker finds order mismatches and deadlocks", "[pipeline_schedule]") {
  // P = 2, V = 1, M = 2: stage 0 on rank 0, stage 1 on rank 1.
  const Op sendF00{true, 1, true, 0, 0}, sendF01{true, 1, true, 0, 1};
  const Op recvF00{false, 0, true, 0, 0}, recvF01{false, 0, true, 0, 1};
  const Op sendB10{true, 0, false, 1, 0}, recvB10{false, 1, false, 1, 0};

  SECTION("in one group each, the same messages are fine") {
    CHECK(checkExchanges({{{sendF00}, {recvB10}}, {{recvF00}, {sendB10}}}) == "");
    CHECK(checkExchanges({{{sendF00, recvB10}}, {{sendB10, recvF00}}}) == "");
  }
  SECTION("receives in the other order than the sends") {
    const std::string problem = checkExchanges({{{sendF00, sendF01}}, {{recvF01, recvF00}}});
    INFO(problem);
    CHECK(contains(problem, "order"));
  }
  SECTION("a receive the peer never sends") {
    const std::string problem = checkExchanges({{{sendF00}}, {{recvF00, recvF01}}});
    INFO(problem);
    CHECK(contains(problem, "count"));
  }
  SECTION("a pair grouped differently on its two ends") {
    const Op sendH00{true, 1, true, 0, 0, true}, recvH00{false, 0, true, 0, 0, true};
    const std::string problem = checkExchanges({{{sendH00, sendF00}}, {{recvH00}, {recvF00}}});
    INFO(problem);
    CHECK(contains(problem, "group mismatch"));
  }
  SECTION("each rank sends first, its receive in a later group") {
    const std::string problem = checkExchanges({{{sendF00}, {recvB10}}, {{sendB10}, {recvF00}}});
    INFO(problem);
    CHECK(contains(problem, "deadlock"));
  }
}

TEST_CASE("pipelineUnits covers pipelineSteps", "[pipeline_schedule]") {
  struct Shape {
    PipelineSchedule schedule;
    int P, V, M;
  };
  const std::vector<Shape> shapes = {
      {PipelineSchedule::AllForwardAllBackward, 4, 1, 6},
      {PipelineSchedule::AllForwardAllBackward, 2, 3, 4},
      {PipelineSchedule::OneFOneB, 4, 1, 8},
      {PipelineSchedule::OneFOneB, 4, 1, 2},
      {PipelineSchedule::OneFOneB, 1, 1, 3},
      {PipelineSchedule::Interleaved, 4, 2, 8},
      {PipelineSchedule::Interleaved, 3, 3, 6},
      {PipelineSchedule::Interleaved, 2, 2, 2},
  };
  for (const Shape& s : shapes)
    for (int r = 0; r < s.P; ++r) {
      INFO(fmt::format("{} P={} V={} M={} rank {}", toString(s.schedule), s.P, s.V, s.M, r));
      const PipelineShape shape{.stages = s.P, .rank = r, .virtualStages = s.V, .microBatches = s.M};
      const auto units = pipelineUnits(s.schedule, shape);
      std::vector<PipelineStep> flat;
      for (const auto& unit : units) {
        REQUIRE((unit.size() == 1 || unit.size() == 2));
        if (unit.size() == 2) CHECK((unit[0].forward && !unit[1].forward));
        flat.insert(flat.end(), unit.begin(), unit.end());
      }
      CHECK(textOf(flat) == textOf(pipelineSteps(s.schedule, shape)));
      CHECK(flat.size() == static_cast<size_t>(2 * s.V * s.M));
    }
}
