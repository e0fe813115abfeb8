#include "launch/rendezvous.h"

#include <ATen/ops/zeros.h>
#include <arpa/inet.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstring>
#include <random>
#include <sstream>

#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"
#include "runtime/store/prefix_store.h"

namespace bulkhead::launch {
namespace {

constexpr int64_t kAddressBytes = 1024;

std::string randomToken() {
  std::random_device entropy;
  std::string token;
  for (int i = 0; i < 4; ++i) token += fmt::format("{:08x}", entropy());
  return token;
}

// Where rank 0's store listens and the others connect.
std::string advertisedHost(const WorldInfo& world) {
  std::string configured = env::kStoreHost.text();
  if (!configured.empty()) return configured;
  bool oneNode = world.localSize > 0 && world.localSize == world.size;
  if (oneNode || world.size == 1) return "127.0.0.1";
  if (!world.masterAddr.empty()) return world.masterAddr;
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

}  // namespace

bool isNumericAddress(const std::string& host) {
  in_addr v4;
  in6_addr v6;
  return ::inet_pton(AF_INET, host.c_str(), &v4) == 1 || ::inet_pton(AF_INET6, host.c_str(), &v6) == 1;
}

namespace {

// "host:port" or "[v6]:port" into its parts; nullopt where it is neither.
std::optional<std::pair<std::string, uint16_t>> parseHostPort(const std::string& text) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) return std::nullopt;
  std::string host = text.substr(0, colon);
  if (host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  const std::string port = text.substr(colon + 1);
  if (host.empty() || port.find_first_not_of("0123456789") != std::string::npos || port.size() > 5) return std::nullopt;
  const int value = std::stoi(port);
  if (value < 1 || value > 65535) return std::nullopt;
  return std::pair{host, static_cast<uint16_t>(value)};
}

// BULKHEAD_RUN_ID, else Slurm's job id (and restart count), else torchrun's run id.
std::string runId(const EnvLookup& lookup) {
  if (std::string id = env::kRunId.text(); !id.empty()) return id;
  if (auto job = lookup("SLURM_JOB_ID"); job && !job->empty()) {
    auto restart = lookup("SLURM_RESTART_COUNT");
    return restart && !restart->empty() ? fmt::format("slurm-{}.{}", *job, *restart) : "slurm-" + *job;
  }
  if (auto id = lookup("TORCHELASTIC_RUN_ID"); id && !id->empty() && *id != "none") return "torchrun-" + *id;
  return "";
}

}  // namespace

std::optional<Rendezvous> joinOutsideStore(const WorldInfo& world, Deadline deadline, const EnvLookup& lookup) {
  const std::string address = env::kStoreAddr.text();
  if (address.empty()) return std::nullopt;
  const auto hostPort = parseHostPort(address);
  if (!hostPort)
    throw ConfigError(fmt::format("{}='{}' is not host:port (or [v6 address]:port)", env::kStoreAddr.name(), address),
                      {.rank = world.rank, .expected = "host:port of a running bulkhead-store"});
  const std::string token = env::kStoreToken.text();
  if (token.empty())
    throw ConfigError(fmt::format("{} is set but {} is not: export the token bulkhead-store was started with on every "
                                  "rank",
                                  env::kStoreAddr.name(), env::kStoreToken.name()),
                      {.rank = world.rank, .expected = fmt::format("{} set", env::kStoreToken.name())});
  const std::string id = runId(lookup);
  if (id.empty())
    throw ConfigError(fmt::format("{} is set but no run id is: export {} (the same on every rank, new for each run) so "
                                  "that this run's keys do not meet an earlier run's in the store",
                                  env::kStoreAddr.name(), env::kRunId.name()),
                      {.rank = world.rank, .expected = fmt::format("{} set", env::kRunId.name())});
  auto client = std::make_shared<TcpStoreClient>(TcpStoreOptions{.host = hostPort->first,
                                                                 .port = hostPort->second,
                                                                 .token = token,
                                                                 .rank = world.rank,
                                                                 .serverOwner = "the bulkhead-store process"});
  try {
    client->connect(deadline);
  } catch (const TimeoutError& e) {
    throw TimeoutError(fmt::format("the store at {} ({}) did not answer within the init deadline: start bulkhead-store "
                                   "there before the job, or check the address ({})",
                                   address, env::kStoreAddr.name(), e.what()),
                       {.rank = world.rank, .group = "world", .expected = "the store outside the job"});
  }
  Rendezvous rendezvous;
  rendezvous.store = std::make_shared<PrefixStore>(client, fmt::format("run/{}/", id));
  rendezvous.outside = true;
  log::debug("launch", "rendezvous through the store at {} as run '{}'", address, id);
  return rendezvous;
}

Rendezvous startRendezvous(Communicator& cpuWorld, const WorldInfo& world, Deadline deadline) {
  Rendezvous rendezvous;
  at::Tensor address = at::zeros({kAddressBytes}, at::kByte);
  if (cpuWorld.rank() == 0) {
    std::string host = advertisedHost(world);
    std::string token = env::kStoreToken.text().empty() ? randomToken() : env::kStoreToken.text();
    // A name is advertised, but the server binds to every interface.
    rendezvous.server = std::make_unique<TcpStoreServer>(
        TcpStoreOptions{.host = isNumericAddress(host) ? host : "0.0.0.0",
                        .port = static_cast<uint16_t>(world.masterPort > 0 ? world.masterPort : 0),
                        .token = token,
                        .rank = 0});
    std::string text = fmt::format("{}\n{}\n{}", host, rendezvous.server->port(), token);
    if (static_cast<int64_t>(text.size()) >= kAddressBytes)
      throw ConfigError(fmt::format("the store address '{}' is too long", host), {.rank = 0});
    std::memcpy(address.data_ptr(), text.data(), text.size());
  }
  cpuWorld.broadcast(address, 0, {.deadline = deadline})->wait();
  std::istringstream lines(std::string(static_cast<const char*>(address.data_ptr())));
  std::string host, port, token;
  std::getline(lines, host);
  std::getline(lines, port);
  std::getline(lines, token);
  auto client = std::make_shared<TcpStoreClient>(TcpStoreOptions{
      .host = host, .port = static_cast<uint16_t>(std::stoi(port)), .token = token, .rank = world.rank});
  client->connect(deadline);
  rendezvous.store = client;
  if (cpuWorld.rank() == 0) log::debug("launch", "rendezvous store at {}:{}", host, port);
  return rendezvous;
}

}  // namespace bulkhead::launch
