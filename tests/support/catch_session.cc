// Catch2's implementation (v2 is header-only) and its session, in this one file.
#define CATCH_CONFIG_RUNNER
#include "tests/support/catch_session.h"
#include "tests/support/catch_compat.h"

namespace bulkhead::testing {

int runCatch(int argc, char** argv) { return Catch::Session().run(argc, argv); }

}  // namespace bulkhead::testing
