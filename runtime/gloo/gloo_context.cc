#include "runtime/gloo/gloo_context.h"

#include <fmt/format.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "runtime/gloo/gloo_check.h"
#include "runtime/gloo/gloo_state.h"

namespace bulkhead::gloo {
namespace {

// Gloo's rendezvous over Bulkhead's store, every call bounded by `deadline`.
class StoreAdapter : public ::gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<bulkhead::Store> store, std::string prefix, Deadline deadline)
      : store_(std::move(store)), prefix_(std::move(prefix)), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(prefix_ + key, std::string(data.begin(), data.end()), deadline_);
  }

  std::vector<char> get(const std::string& key) override {
    std::string value = store_->get(prefix_ + key, deadline_);
    return {value.begin(), value.end()};
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, remainingMillis(deadline_)); }

  // Gloo passes its context's timeout, which connect() shortens for the pairs'
  // first connects; the rendezvous keeps the whole deadline.
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& /*timeout*/) override {
    std::vector<std::string> prefixed;
    for (const auto& key : keys) prefixed.push_back(prefix_ + key);
    store_->wait(prefixed, deadline_);
  }

 private:
  std::shared_ptr<bulkhead::Store> store_;
  std::string prefix_;
  Deadline deadline_;
};

std::shared_ptr<::gloo::transport::Device> makeDevice(const std::string& host) {
  ::gloo::transport::tcp::attr attr;
  const char* iface = std::getenv("GLOO_SOCKET_IFNAME");
  if (!host.empty()) {
    attr.hostname = host;
  } else if (iface && *iface) {
    attr.iface = iface;
  } else {
    char name[256] = {};
    ::gethostname(name, sizeof(name) - 1);
    attr.hostname = name;
  }
  std::shared_ptr<::gloo::transport::Device> device;
  guarded("device", {}, [&] { device = ::gloo::transport::tcp::CreateDevice(attr); });
  return device;
}

}  // namespace

ContextFactory::ContextFactory(std::shared_ptr<Store> store, const std::string& host, std::string prefix)
    : store_(std::move(store)), device_(makeDevice(host)), prefix_(std::move(prefix)) {}

ContextFactory ContextFactory::child(const std::string& suffix) const {
  return ContextFactory(store_, device_, prefix_ + suffix);
}

std::shared_ptr<::gloo::Context> ContextFactory::connect(int rank, int size, Deadline deadline,
                                                         const ErrorContext& context) const {
  auto glooContext = std::make_shared<::gloo::rendezvous::Context>(rank, size);
  // A pair's first connect waits five times the context's timeout (gloo/transport/tcp/pair.h): a
  // fifth of what is left keeps a peer that died mid-connect from holding this rank past the deadline.
  glooContext->setTimeout(std::max(std::chrono::milliseconds(1), remainingMillis(deadline) / 5));
  StoreAdapter adapter(store_, prefix_, deadline);
  try {
    auto device = device_;
    guarded("connect", context, [&] { glooContext->connectFullMesh(adapter, device); });
  } catch (const Error& e) {
    if (!deadline.expired() && !isGlooTimeout(std::current_exception()) && !dynamic_cast<const TimeoutError*>(&e))
      throw;
    throw TimeoutError(fmt::format("connecting the gloo group '{}' ({} ranks) did not finish within the init "
                                   "deadline: some rank did not reach it ({})",
                                   context.group, size, e.what()),
                       context);
  }
  // Later operations set their own timeouts; this one bounds what has none.
  glooContext->setTimeout(std::chrono::seconds(60));
  return glooContext;
}

}  // namespace bulkhead::gloo
