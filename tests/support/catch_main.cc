// Unit tests: one process, no MPI.
#define CATCH_CONFIG_RUNNER
#include "tests/support/catch_compat.h"

int main(int argc, char** argv) { return Catch::Session().run(argc, argv); }
