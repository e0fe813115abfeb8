#pragma once
// Internal to the gloo backend: the communicator over a connected Gloo context
// (initWorld and split build theirs here; tests hand it a context over a
// transport of their own). Backend-internal: it includes Gloo's headers.

#include <gloo/context.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/communicator.h"
#include "runtime/gloo/gloo_context.h"

namespace bulkhead::gloo {

// The communicator `name` over `context`, whose pairs are connected. `factory`
// connects the groups split from it; `members` are the world ranks of the
// group, in its rank order.
CommunicatorPtr makeCommunicator(std::shared_ptr<::gloo::Context> context, ContextFactory factory, std::string name,
                                 std::vector<int> members);

}  // namespace bulkhead::gloo
