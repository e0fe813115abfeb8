// The rendezvous store at job scale: N simulated ranks, each with a client
// (and connection) of its own, publish what the monitor publishes (one record:
// heartbeat time and ledger heads) every heartbeat period, while one reader
// does the diagnosis read of every rank's record in one request. The server
// runs in a child process, so its CPU time is its own.
//
// With --ranks-per-node K above 1 (8 by default) the ranks form nodes of K, as
// the monitor does: each rank writes its record into its node's relay segment
// (shared memory), and each node's leader forwards the node's records in one
// multiSet. With K = 1 every rank sets its own record.
//
//   bulkhead-store-scale-bench [--ranks 1024,2048,4096,8192,16384] [--seconds 20] [--ranks-per-node 8]
//
// Per N: ranks connected, the server's CPU share, and the p50/p99/max of a
// publish round (every rank's record reaches the store once) and of a
// diagnosis read.
//
// With --rendezvous: N simulated ranks join through the store bootstrap's
// roster (launch/bootstrap.h, arriveAtRoster and awaitRoster, the code
// joinStore runs): every rank arrives, then every rank awaits the roster.
// Per N: the seconds to connect, to arrive and to receive the roster, and the
// store process's CPU time.

#include <fmt/format.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "launch/bootstrap.h"
#include "launch/cli.h"
#include "runtime/diagnosis/monitor_record.h"
#include "runtime/diagnosis/node_relay.h"
#include "runtime/store/tcp_store.h"

namespace {

using namespace bulkhead;
using Clock = std::chrono::steady_clock;

struct Options {
  std::vector<int> ranks = {1024, 2048, 4096, 8192, 16384};
  double seconds = 20;
  double heartbeat = 0.5;
  int threads = 64;         // client threads; each drives ranks / threads simulated ranks
  int maxConnections = 0;   // the server's cap; 0: none (its default)
  int ranksPerNode = 8;     // 1: no relay
  int recordBytes = 256;    // a ledger record's size: heads and newest entries of one group
  bool rendezvous = false;  // time the store bootstrap's roster instead of heartbeats
};

struct Percentiles {
  double p50 = 0, p99 = 0, max = 0;
};

Percentiles percentiles(std::vector<double> values) {
  if (values.empty()) return {};
  std::sort(values.begin(), values.end());
  auto at = [&](double q) { return values[std::min(values.size() - 1, static_cast<size_t>(q * values.size()))]; };
  return {at(0.5), at(0.99), values.back()};
}

// utime + stime of a process, in seconds.
double cpuSeconds(pid_t pid) {
  std::ifstream stat(fmt::format("/proc/{}/stat", pid));
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  std::istringstream fields(text.substr(text.rfind(')') + 2));
  std::string skip;
  for (int i = 0; i < 11; ++i) fields >> skip;  // state .. cmajflt
  double user = 0, system = 0;
  fields >> user >> system;
  return (user + system) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// The server in a child process, on a free port; returns its pid and port.
std::pair<pid_t, uint16_t> startServer(const std::string& token, int maxConnections) {
  int ends[2];
  if (pipe(ends) != 0) throw std::runtime_error("pipe");
  pid_t pid = fork();
  if (pid == 0) {
    close(ends[0]);
    TcpStoreServer server(
        TcpStoreOptions{.host = "127.0.0.1", .port = 0, .token = token, .maxConnections = maxConnections});
    uint16_t port = server.port();
    [[maybe_unused]] ssize_t written = write(ends[1], &port, sizeof(port));
    close(ends[1]);
    pause();  // until the parent's SIGTERM
    _exit(0);
  }
  close(ends[1]);
  uint16_t port = 0;
  if (read(ends[0], &port, sizeof(port)) != sizeof(port)) throw std::runtime_error("the server did not start");
  close(ends[0]);
  return {pid, port};
}

// Nodes of `perNode` simulated ranks: each node's leader creates its relay
// segment, and each rank maps it for itself, as the ranks of a node would.
struct Relays {
  std::vector<std::unique_ptr<NodeRelay>> leaders, members;
  std::vector<std::vector<uint64_t>> seen;
};

Relays makeRelays(int ranks, int perNode) {
  Relays relays;
  if (perNode < 2) return relays;
  for (int first = 0; first < ranks; first += perNode) {
    relays.leaders.push_back(NodeRelay::create(std::min(perNode, ranks - first), 4096));
    for (int r = first; r < std::min(first + perNode, ranks); ++r)
      relays.members.push_back(NodeRelay::open(relays.leaders.back()->name()));
    relays.leaders.back()->unlink();
  }
  relays.seen.resize(relays.leaders.size());
  return relays;
}

// body(i) for every i in [0, count), spread over `threads` threads.
void forEachIndex(int count, int threads, const std::function<void(int)>& body) {
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (int i = t; i < count; i += threads) body(i);
    });
  for (auto& thread : pool) thread.join();
}

struct Row {
  int ranks = 0, connected = 0;
  double cpuShare = 0;
  Percentiles publish, diagnosis;
  int lateRounds = 0, rounds = 0;
};

Row run(int ranks, const Options& options) {
  const std::string token = "scale-bench";
  auto [server, port] = startServer(token, options.maxConnections);
  Row row{.ranks = ranks};
  std::vector<std::unique_ptr<TcpStoreClient>> clients(ranks);
  std::vector<char> ok(ranks, 0);
  const std::string record(options.recordBytes, 'r');
  auto forEachOf = [&](int count, const std::function<void(int)>& body) { forEachIndex(count, options.threads, body); };
  auto forEach = [&](const std::function<void(int)>& body) { forEachOf(ranks, body); };
  forEach([&](int r) {
    try {
      clients[r] = std::make_unique<TcpStoreClient>(
          TcpStoreOptions{.host = "127.0.0.1", .port = port, .token = token, .rank = r});
      clients[r]->set(monitor_record::stateKey(r), "t 0\n", Deadline::afterSeconds(30));
      ok[r] = 1;
    } catch (const std::exception&) {
    }
  });
  row.connected = static_cast<int>(std::count(ok.begin(), ok.end(), 1));
  Relays relays = makeRelays(ranks, options.ranksPerNode);

  std::vector<std::string> keys;
  for (int r = 0; r < ranks; ++r) keys.push_back(monitor_record::stateKey(r));
  std::atomic<bool> done{false};
  std::vector<double> reads;
  std::thread reader([&] {
    TcpStoreClient client(TcpStoreOptions{.host = "127.0.0.1", .port = port, .token = token});
    while (!done) {
      auto start = Clock::now();
      try {
        client.multiGet(keys, Deadline::afterSeconds(30));
        reads.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
      } catch (const std::exception&) {
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
    }
  });

  const double cpuBefore = cpuSeconds(server);
  const auto begin = Clock::now();
  std::vector<double> rounds;
  const auto period = std::chrono::duration<double>(options.heartbeat);
  while (Clock::now() - begin < std::chrono::duration<double>(options.seconds)) {
    auto start = Clock::now();
    const int64_t now =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
            .count();
    const std::string text = fmt::format("t {}\ng world\n", now) + record;
    forEach([&](int r) {
      if (!ok[r]) return;
      try {
        if (relays.members.empty())
          return clients[r]->set(monitor_record::stateKey(r), text, Deadline::afterSeconds(10));
        relays.members[r]->write(r % options.ranksPerNode, r, text);
      } catch (const std::exception&) {
        ok[r] = 0;
      }
    });
    forEachOf(static_cast<int>(relays.leaders.size()), [&](int node) {
      const int leader = node * options.ranksPerNode;
      if (!ok[leader]) return;
      try {
        std::vector<std::pair<std::string, std::string>> pairs;
        for (auto& changed : relays.leaders[node]->changed(relays.seen[node]))
          pairs.emplace_back(monitor_record::stateKey(changed.worldRank), std::move(changed.text));
        clients[leader]->multiSet(pairs, Deadline::afterSeconds(10));
      } catch (const std::exception&) {
        ok[leader] = 0;
      }
    });
    double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    rounds.push_back(ms);
    row.lateRounds += ms > options.heartbeat * 1e3;
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(period));
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - begin).count();
  row.cpuShare = (cpuSeconds(server) - cpuBefore) / elapsed;
  done = true;
  reader.join();
  row.rounds = static_cast<int>(rounds.size());
  row.publish = percentiles(rounds);
  row.diagnosis = percentiles(reads);
  clients.clear();
  kill(server, SIGTERM);
  waitpid(server, nullptr, 0);
  return row;
}

// Connects one client per simulated rank, `threads` at a time; returns how many connected.
int connectClients(std::vector<std::unique_ptr<TcpStoreClient>>& clients, uint16_t port, const std::string& token,
                   int threads) {
  std::atomic<int> connected{0};
  forEachIndex(static_cast<int>(clients.size()), threads, [&](int r) {
    try {
      clients[r] = std::make_unique<TcpStoreClient>(
          TcpStoreOptions{.host = "127.0.0.1", .port = port, .token = token, .rank = r});
      clients[r]->connect(Deadline::afterSeconds(60));
      ++connected;
    } catch (const std::exception&) {
    }
  });
  return connected;
}

struct RendezvousRow {
  int ranks = 0, connected = 0, joined = 0;
  double connectSeconds = 0, arriveSeconds = 0, rosterSeconds = 0, serverCpuSeconds = 0;
};

// Every rank arrives, then every rank awaits the roster: how long each half
// takes with `threads` client threads driving the simulated ranks.
RendezvousRow runRendezvous(int ranks, const Options& options) {
  const std::string token = "rendezvous-bench";
  auto [server, port] = startServer(token, options.maxConnections);
  RendezvousRow row{.ranks = ranks};
  std::vector<std::unique_ptr<TcpStoreClient>> clients(ranks);
  auto seconds = [](Clock::time_point since) { return std::chrono::duration<double>(Clock::now() - since).count(); };
  auto start = Clock::now();
  row.connected = connectClients(clients, port, token, options.threads);
  row.connectSeconds = seconds(start);
  const double cpuBefore = cpuSeconds(server);
  const Deadline deadline = Deadline::afterSeconds(120);
  std::atomic<int> joined{0};
  auto half = [&](bool arrive) {
    forEachIndex(ranks, options.threads, [&](int r) {
      if (!clients[r]) return;
      const launch::WorldInfo world{.rank = r, .size = ranks};
      try {
        if (arrive) {
          launch::arriveAtRoster(*clients[r], world, deadline);
        } else {
          launch::awaitRoster(*clients[r], world, deadline);
          ++joined;
        }
      } catch (const std::exception& e) {
        fmt::print(stderr, "rank {}: {}\n", r, e.what());
      }
    });
  };
  start = Clock::now();
  half(true);
  row.arriveSeconds = seconds(start);
  start = Clock::now();
  half(false);
  row.rosterSeconds = seconds(start);
  row.joined = joined;
  row.serverCpuSeconds = cpuSeconds(server) - cpuBefore;
  clients.clear();
  kill(server, SIGTERM);
  waitpid(server, nullptr, 0);
  return row;
}

void printRendezvous(const Options& options) {
  fmt::print(
      "store bootstrap roster: {} client threads, {} CPUs; each rank arrives (add, set, get of the first "
      "arrival; the last also waits for and reads every record), then awaits the roster (one get)\n",
      options.threads, std::thread::hardware_concurrency());
  fmt::print(
      "| ranks | connected | joined | connect s | arrive s | roster s | arrive + roster s | server CPU s |\n"
      "|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (int ranks : options.ranks) {
    const RendezvousRow row = runRendezvous(ranks, options);
    fmt::print("| {} | {} | {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} |\n", row.ranks, row.connected, row.joined,
               row.connectSeconds, row.arriveSeconds, row.rosterSeconds, row.arriveSeconds + row.rosterSeconds,
               row.serverCpuSeconds);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  cli::App app(
      "The rendezvous store at job scale: N simulated ranks publishing heartbeats and ledger records, and "
      "a diagnosis read of all of them.",
      "bulkhead-store-scale-bench");
  Options options;
  app.add_option("--ranks", options.ranks, "simulated ranks, comma-separated")->delimiter(',');
  app.add_option("--seconds", options.seconds, "seconds of publishing per N")->check(cli::positive());
  app.add_option("--heartbeat", options.heartbeat, "seconds between a rank's publications")->check(cli::positive());
  app.add_option("--threads", options.threads, "client threads driving the simulated ranks")->check(cli::positive());
  app.add_option("--ranks-per-node", options.ranksPerNode, "ranks per simulated node relay (1: none)")
      ->check(cli::positive());
  app.add_option("--record-bytes", options.recordBytes, "bytes of ledger state in each record")->check(cli::positive());
  app.add_option("--max-connections", options.maxConnections, "the server's connection cap (0: none)")
      ->check(cli::nonNegative());
  app.add_flag("--rendezvous", options.rendezvous,
               "time the store bootstrap's roster (every rank joins once) instead of heartbeats");
  if (auto code = cli::parse(app, argc, argv)) return *code;
  if (options.rendezvous) {
    printRendezvous(options);
    return 0;
  }
  fmt::print(
      "store scale: {} s per N, a record every {} s per rank (heartbeat time + {} B of ledger state), {}, {} "
      "client threads, {} CPUs\n",
      options.seconds, options.heartbeat, options.recordBytes,
      options.ranksPerNode > 1 ? fmt::format("relayed per node of {} ranks", options.ranksPerNode)
                               : std::string("one request per rank"),
      options.threads, std::thread::hardware_concurrency());
  fmt::print(
      "| ranks | connected | server CPU | publish round p50 / p99 / max ms | rounds over the period | "
      "diagnosis read p50 / p99 / max ms |\n|---:|---:|---:|---|---:|---|\n");
  for (int ranks : options.ranks) {
    Row row = run(ranks, options);
    fmt::print("| {} | {} | {:.0f}% | {:.1f} / {:.1f} / {:.1f} | {} of {} | {:.1f} / {:.1f} / {:.1f} |\n", row.ranks,
               row.connected, 100 * row.cpuShare, row.publish.p50, row.publish.p99, row.publish.max, row.lateRounds,
               row.rounds, row.diagnosis.p50, row.diagnosis.p99, row.diagnosis.max);
    std::fflush(stdout);
  }
  return 0;
}
