#include "optim/parameter_checks.h"

#include <fmt/format.h>

#include <set>
#include <string>

#include "runtime/errors.h"

namespace bulkhead::optim::detail {

void checkParameters(const std::vector<parallel::Parameter>& params, c10::Device device, int rank, const char* who) {
  std::set<std::string> names;
  for (const parallel::Parameter& p : params) {
    ErrorContext context{.rank = rank,
                         .expected = "defined, contiguous parameters on " + device.str() +
                                     " with a ShardInfo of one offset per dimension and unique names"};
    if (!p.tensor.defined() || !p.tensor.is_contiguous() || p.tensor.device() != device)
      throw ConfigError(
          fmt::format("{}: parameter {} must be a defined, contiguous tensor on {}", who, p.name, device.str()),
          context);
    if (p.shard.globalShape.size() != static_cast<size_t>(p.tensor.dim()) ||
        p.shard.offsets.size() != p.shard.globalShape.size())
      throw ConfigError(fmt::format("{}: parameter {} has {} dimensions but its ShardInfo has a global shape of {} "
                                    "and {} offsets; set its shard (ShardInfo::whole for an unsplit tensor)",
                                    who, p.name, p.tensor.dim(), p.shard.globalShape.size(), p.shard.offsets.size()),
                        context);
    if (!names.insert(p.name).second)
      throw ConfigError(
          fmt::format("{}: parameter name {} appears twice; names are global checkpoint keys", who, p.name), context);
  }
}

}  // namespace bulkhead::optim::detail
