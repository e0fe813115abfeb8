#include "parallel/topology_checks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>

namespace bulkhead::parallel {
namespace {

// The first group that shows a problem and how many groups show it.
struct Finding {
  int count = 0;
  std::string first;
  void add(std::string detail) {
    if (count++ == 0) first = std::move(detail);
  }
  std::string others() const {
    return count > 1 ? fmt::format(" ({} more {} the same)", count - 1, count == 2 ? "group does" : "groups do") : "";
  }
};

std::string groupText(GroupKind kind, size_t index, const std::vector<int>& group) {
  return fmt::format("{}[{}] (ranks {})", toString(kind), index, fmt::join(group, ","));
}

}  // namespace

std::vector<std::string> checkGroupTopology(GroupKind kind, const std::vector<std::vector<int>>& groups,
                                            const TopologyOptions& options) {
  std::vector<std::string> warnings;
  if (groups.empty()) return warnings;
  const char* name = toString(kind);
  size_t size = groups.front().size();
  if (size > 1 && (size & (size - 1)) != 0)
    warnings.push_back(fmt::format(
        "{} groups have {} ranks, not a power of two: collective algorithms, NVLink domains (2, 4 or 8 GPUs) and "
        "hidden or expert counts divide best by powers of two; prefer a {} size of 1, 2, 4 or 8",
        name, size, name));

  int perNode = options.ranksPerNode;
  Finding spans, partial, noNvlink;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::vector<int>& group = groups[g];
    std::map<int, int> onNode;  // node -> members of this group there
    if (perNode > 0)
      for (int r : group) ++onNode[r / perNode];
    if (onNode.size() > 1) {
      std::vector<int> nodes, partly;
      for (auto [node, count] : onNode) {
        nodes.push_back(node);
        if (count < perNode) partly.push_back(node);
      }
      if (partly.empty())
        spans.add(fmt::format("{} spans nodes {}", groupText(kind, g, group), fmt::join(nodes, ",")));
      else
        partial.add(fmt::format("{} spans nodes {} and takes only part of node{} {}", groupText(kind, g, group),
                                fmt::join(nodes, ","), partly.size() > 1 ? "s" : "", fmt::join(partly, ",")));
    }
    if (options.nvlink) {
      std::string missing;
      for (size_t i = 0; i < group.size() && missing.empty(); ++i)
        for (size_t j = i + 1; j < group.size() && missing.empty(); ++j) {
          int a = group[i], b = group[j];
          bool sameNode = perNode <= 0 || a / perNode == b / perNode;
          if (sameNode && !options.nvlink(a, b))
            missing = fmt::format("{}: ranks {} and {} share a node but have no NVLink path", groupText(kind, g, group),
                                  a, b);
        }
      if (!missing.empty()) noNvlink.add(std::move(missing));
    }
  }
  if (spans.count > 0)
    warnings.push_back(fmt::format(
        "{}{}: every {} collective crosses the inter-node network, far slower than NVLink; keep {} within a node "
        "({} ranks per node) or put {} first in the order string",
        spans.first, spans.others(), name, name, perNode, name));
  if (partial.count > 0)
    warnings.push_back(fmt::format(
        "{}{}: such a group shares nodes with other groups and its collectives cross the inter-node network; make "
        "{} a divisor of the ranks per node ({}) so each group fits inside one node",
        partial.first, partial.others(), name, perNode));
  if (noNvlink.count > 0)
    warnings.push_back(
        fmt::format("{}{}: its traffic goes over PCIe or the host; check `nvidia-smi topo -m`, or choose an order or "
                    "CUDA_VISIBLE_DEVICES so that {} groups take GPUs linked by NVLink",
                    noNvlink.first, noNvlink.others(), name));
  return warnings;
}

std::vector<std::string> checkTopology(const Layout& layout, const TopologyOptions& options) {
  std::vector<std::string> warnings;
  for (GroupKind kind : {GroupKind::Tp, GroupKind::Ep}) {
    auto found = checkGroupTopology(kind, layout.groups(kind), options);
    warnings.insert(warnings.end(), found.begin(), found.end());
  }
  return warnings;
}

}  // namespace bulkhead::parallel
