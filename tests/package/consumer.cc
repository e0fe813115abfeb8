// Built against an installed Bulkhead: init, an all-reduce, shutdown.
#include <ATen/ATen.h>

#include <cstdio>

#include "launch/init.h"

int main() {
  return bulkhead::guardedMain([] {
    auto runtime = bulkhead::init({.backend = bulkhead::Backend::Mpi});
    at::Tensor t = at::full({3}, runtime->world().rank() + 1.0);
    runtime->world().allReduce(t)->wait();
    int n = runtime->world().size();
    bool ok = at::equal(t, at::full({3}, n * (n + 1) / 2.0));
    if (runtime->world().rank() == 0) std::printf("consumer: %d ranks, all-reduce %s\n", n, ok ? "ok" : "WRONG");
    return ok ? 0 : 1;
  });
}
