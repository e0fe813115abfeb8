#include "runtime/gloo/gloo_check.h"

#include <fmt/format.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>

#include <string>

namespace bulkhead::gloo {
namespace {

// Gloo reports an expired timeout as an IoException whose text says so.
bool mentionsTimeout(const std::string& text) {
  return text.find("Timed out") != std::string::npos || text.find("timed out") != std::string::npos ||
         text.find("Timeout") != std::string::npos;
}

// A CommError that remembers it was Gloo's timeout.
class GlooTimeout : public CommError {
 public:
  using CommError::CommError;
};

// A CommError that remembers a peer's connection closed.
class GlooPeerLost : public CommError {
 public:
  using CommError::CommError;
};

}  // namespace

void guarded(const char* what, const ErrorContext& context, const std::function<void()>& call) {
  try {
    call();
  } catch (const Error&) {
    throw;
  } catch (const ::gloo::IoException& e) {
    if (mentionsTimeout(e.what())) throw GlooTimeout(fmt::format("gloo {} timed out: {}", what, e.what()), context);
    throw GlooPeerLost(
        fmt::format("gloo {} failed (a peer closed its connection or the network failed): {}", what, e.what()),
        context);
  } catch (const ::gloo::Exception& e) {
    throw CommError(fmt::format("gloo {} failed: {}", what, e.what()), context);
  } catch (const ::gloo::EnforceNotMet& e) {
    throw CommError(fmt::format("gloo {} failed a check: {}", what, e.what()), context);
  }
}

namespace {

// Whether `error` holds an exception of type T.
template <typename T>
bool holds(const std::exception_ptr& error) {
  if (!error) return false;
  try {
    std::rethrow_exception(error);
  } catch (const T&) {
    return true;
  } catch (...) {
    return false;
  }
}

}  // namespace

bool isGlooTimeout(const std::exception_ptr& error) { return holds<GlooTimeout>(error); }
bool isGlooPeerLost(const std::exception_ptr& error) { return holds<GlooPeerLost>(error); }

}  // namespace bulkhead::gloo
