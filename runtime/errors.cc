#include "runtime/errors.h"

#include <fmt/format.h>

namespace bulkhead {
namespace {

std::string describe(const char* kind, const std::string& message, const ErrorContext& context) {
  std::string where;
  if (context.rank >= 0) where += fmt::format("rank {}", context.rank);
  if (!context.group.empty()) where += fmt::format("{}group {}", where.empty() ? "" : ", ", context.group);
  std::string text =
      where.empty() ? fmt::format("{}: {}", kind, message) : fmt::format("{} [{}]: {}", kind, where, message);
  if (!context.expected.empty()) text += fmt::format(" (expected: {})", context.expected);
  return text;
}

}  // namespace

Error::Error(const char* kind, const std::string& message, ErrorContext context)
    : std::runtime_error(describe(kind, message, context)),
      kind_(kind),
      message_(message),
      context_(std::move(context)) {}

TimeoutError::TimeoutError(const std::string& message, ErrorContext context, uint64_t sequence, std::string diagnosis)
    : Error("TimeoutError", message, std::move(context)), sequence_(sequence), diagnosis_(std::move(diagnosis)) {}

}  // namespace bulkhead
