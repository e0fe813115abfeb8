#pragma once
// Catch2's session, compiled once for every test executable (catch_session.cc): a main calls this
// instead of defining CATCH_CONFIG_RUNNER, which with Catch2 v2 compiles all of Catch2 into its file.

namespace bulkhead::testing {

// Runs the test cases the command line selects; returns the number of failed ones (capped by Catch2).
int runCatch(int argc, char** argv);

}  // namespace bulkhead::testing
