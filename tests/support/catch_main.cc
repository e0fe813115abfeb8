// Unit tests: one process, no MPI.
#include "tests/support/catch_compat.h"
#include "tests/support/catch_session.h"

int main(int argc, char** argv) { return bulkhead::testing::runCatch(argc, argv); }
