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
