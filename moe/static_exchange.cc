#include "moe/static_exchange.h"

#include <ATen/ATen.h>

#include <fmt/format.h>

#include <string>
#include <utility>
#include <vector>

#include "parallel/tensor_parallel.h"
#include "runtime/errors.h"

namespace bulkhead::moe {

StaticExchange::StaticExchange(CommunicatorPtr ep, int localExperts, Timeout timeout, std::string layerName)
    : ep_(std::move(ep)), localExperts_(localExperts), timeout_(timeout), layerName_(std::move(layerName)) {}

void StaticExchange::check(const at::Tensor& tokens, int64_t capacity, bool capturing) {
  if (ep_->size() == 1 || capturing || checked_.count(capacity) != 0) return;
  const at::Tensor mine = at::tensor({tokens.size(0), capacity}, at::kLong).to(tokens.device());
  at::Tensor all = at::empty({ep_->size() * 2}, mine.options());
  const Deadline deadline = parallel::collectiveDeadline(timeout_);
  ep_->allGather(mine, all, {.deadline = deadline})->wait(deadline);
  const at::Tensor host = all.to(at::kCPU);
  const int64_t* values = host.data_ptr<int64_t>();
  std::string ranks;
  bool equal = true;
  for (int r = 0; r < ep_->size(); ++r) {
    equal = equal && values[2 * r + 1] == capacity;
    ranks += fmt::format("{}rank {}: {} tokens, capacity {}", r == 0 ? "" : "; ", ep_->members()[r], values[2 * r],
                         values[2 * r + 1]);
  }
  if (!equal)
    throw ConfigError(fmt::format("MoE layer {}: static shapes at ep {} exchange every expert's capacity of rows "
                                  "with equal splits, so every rank of {} needs the same capacity ({}); give every "
                                  "rank batches of one size",
                                  layerName_, ep_->size(), ep_->name(), ranks),
                      {.rank = ep_->members()[ep_->rank()], .group = ep_->name(), .expected = "one capacity"});
  checked_.insert(capacity);
}

at::Tensor StaticExchange::swapBlocks(const at::Tensor& rows, int64_t a, int64_t b, int64_t capacity) {
  const int64_t hidden = rows.size(1);
  return rows.view({a, b, capacity, hidden}).transpose(0, 1).reshape({a * b * capacity, hidden});
}

std::vector<int64_t> StaticExchange::splits(int64_t capacity) const {
  return std::vector<int64_t>(static_cast<size_t>(ep_->size()), localExperts_ * capacity);
}

at::Tensor StaticExchange::toExperts(const at::Tensor& padded, int64_t capacity) const {
  const int64_t ep = ep_->size();
  if (ep == 1) return padded;
  // Arrives as [source, local expert, C, H]; the experts take [local expert, source, C, H].
  return swapBlocks(allToAll(ep_, padded, splits(capacity), splits(capacity), timeout_), ep, localExperts_, capacity);
}

at::Tensor StaticExchange::fromExperts(const at::Tensor& expertOutput, int64_t capacity) const {
  const int64_t ep = ep_->size();
  if (ep == 1) return expertOutput;
  return allToAll(ep_, swapBlocks(expertOutput, localExperts_, ep, capacity), splits(capacity), splits(capacity),
                  timeout_);
}

}  // namespace bulkhead::moe
