#pragma once
// Gloo contexts for Bulkhead's groups: one TCP device per process, and the
// rendezvous of each group through the job's store. Backend-internal.

#include <gloo/context.h>
#include <gloo/transport/device.h>

#include <memory>
#include <string>

#include "runtime/deadline.h"
#include "runtime/errors.h"
#include "runtime/store/store.h"

namespace bulkhead::gloo {

class ContextFactory {
 public:
  // `host`: the address to listen on and advertise (empty: GLOO_SOCKET_IFNAME's
  // interface, else this host's name). Keys go under `prefix`.
  ContextFactory(std::shared_ptr<Store> store, const std::string& host, std::string prefix);

  // The factory of a group split from this one: same store and device, keys
  // under prefix + `suffix`.
  ContextFactory child(const std::string& suffix) const;

  // Connects every pair of the group's `size` ranks (collective), bounded by
  // `deadline`: TimeoutError names the ranks that did not show up.
  std::shared_ptr<::gloo::Context> connect(int rank, int size, Deadline deadline, const ErrorContext& context) const;

 private:
  ContextFactory(std::shared_ptr<Store> store, std::shared_ptr<::gloo::transport::Device> device, std::string prefix)
      : store_(std::move(store)), device_(std::move(device)), prefix_(std::move(prefix)) {}

  std::shared_ptr<Store> store_;
  std::shared_ptr<::gloo::transport::Device> device_;
  std::string prefix_;
};

}  // namespace bulkhead::gloo
