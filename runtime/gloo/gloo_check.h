#pragma once
// The one place where Gloo's exceptions become Bulkhead errors.
// Backend-internal: only runtime/gloo includes Gloo's headers.

#include <exception>
#include <functional>

#include "runtime/errors.h"

namespace bulkhead::gloo {

// Runs `call` (a Gloo operation) and converts what Gloo throws:
// gloo::IoException to CommError (or `onTimeout`'s error when Gloo timed
// out), gloo::EnforceNotMet and other gloo::Exception to CommError, naming
// `what`. Bulkhead errors pass through unchanged.
void guarded(const char* what, const ErrorContext& context, const std::function<void()>& call);

// True when `error` came from a Gloo call that ran out of its timeout.
bool isGlooTimeout(const std::exception_ptr& error);
// True when `error` came from a Gloo call whose peer closed its connection
// (the peer process died or aborted).
bool isGlooPeerLost(const std::exception_ptr& error);

}  // namespace bulkhead::gloo
