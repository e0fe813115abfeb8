// bulkhead-store: the rendezvous store as a process of its own, outside the
// job, so that losing any training process never loses the store. Ranks reach
// it through BULKHEAD_STORE_ADDR=host:port with the same BULKHEAD_STORE_TOKEN
// and a run id (BULKHEAD_RUN_ID, or the launcher's job id) that keeps each
// run's keys apart; see docs/launching.md.
//
//   BULKHEAD_STORE_TOKEN=secret bulkhead-store [--host 0.0.0.0] [--port 29500]
//
// Prints "bulkhead-store listening on HOST:PORT" once it serves (--port 0: a
// free port), then serves until SIGINT or SIGTERM, and exits 0.

#include <fmt/format.h>
#include <signal.h>

#include <cstdio>
#include <string>

#include "launch/cli.h"
#include "launch/init.h"
#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/store/tcp_store.h"

using namespace bulkhead;

int main(int argc, char** argv) {
  cli::App app("The rendezvous store as a process outside the job (ranks reach it through BULKHEAD_STORE_ADDR).",
               "bulkhead-store");
  std::string host = "0.0.0.0";
  int port = 29500;
  app.add_option("--host", host, "address to listen on (0.0.0.0: every interface)");
  app.add_option("--port", port, "port to listen on (0: a free one, printed)")->check(CLI::Range(0, 65535));
  if (auto code = cli::parse(app, argc, argv)) return *code;
  return guardedMain([&] {
    const std::string token = env::kStoreToken.text();
    if (token.empty())
      throw ConfigError(fmt::format("{} is not set: start the store with the secret every rank of the job exports",
                                    env::kStoreToken.name()),
                        {.expected = fmt::format("{} set", env::kStoreToken.name())});
    // The signals wait for sigwait below, in no thread of the server.
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, nullptr);
    TcpStoreServer server(TcpStoreOptions{.host = host, .port = static_cast<uint16_t>(port), .token = token});
    fmt::print("bulkhead-store listening on {}:{}\n", host, server.port());
    std::fflush(stdout);
    int signal = 0;
    sigwait(&stop, &signal);
    fmt::print("bulkhead-store: {} received, stopping\n", signal == SIGINT ? "SIGINT" : "SIGTERM");
    std::fflush(stdout);
    return 0;
  });
}
