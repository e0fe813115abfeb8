#include "runtime/diagnosis/node_relay.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <new>
#include <random>

#include "runtime/env.h"
#include "runtime/errors.h"
#include "runtime/log.h"

namespace bulkhead {

// The segment: a header, then `slots` slots of `stride` bytes each.
struct NodeRelay::Header {
  uint64_t magic;
  uint32_t slots;
  uint32_t stride;
  std::atomic<int64_t> forwardedMs;  // monotonic clock (monotonicMs) of the leader's last forwarding turn
};

// One rank's record under a sequence lock: `version` is odd while the owner
// writes, and a reader keeps a copy only if it saw the same even version
// before and after copying. Every field a reader copies, the record's bytes
// included, is an atomic that writers store and readers load relaxed, so a
// reader racing a writer reads stale or torn values (then discarded), never
// undefined behaviour; the fences in write() and changed() order them.
struct NodeRelay::Slot {
  std::atomic<uint64_t> version;
  std::atomic<uint64_t> forwarded;
  std::atomic<int32_t> worldRank;
  std::atomic<uint32_t> length;
  std::atomic<uint64_t> data[1];  // the record's bytes, 8 a word, run on to the end of the slot
};

namespace {

constexpr uint64_t kMagic = 0x42'4b'52'45'4c'41'59'32;  // "BKRELAY2": monotonic stamps, atomic words
constexpr size_t kHeaderBytes = 64;
static_assert(sizeof(NodeRelay::Header) <= kHeaderBytes);
// The segment is shared between processes: only lock-free atomics of fixed
// size work there. A slot's data starts 8-aligned and its stride is a
// multiple of 64, so a record's bytes fit in whole words of its slot.
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free &&
              std::atomic<uint32_t>::is_always_lock_free && std::atomic<int32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint64_t>) == 8 && offsetof(NodeRelay::Slot, data) % 8 == 0);

// Milliseconds of the monotonic clock (CLOCK_MONOTONIC on Linux: one per host
// and boot, unmoved by steps of the wall clock).
int64_t monotonicMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Stores `text` into `words` with relaxed atomic stores, the last word padded
// with zeros. The caller orders them (the sequence lock's fences).
void storeBytes(std::atomic<uint64_t>* words, std::string_view text) {
  for (size_t offset = 0; offset < text.size(); offset += 8) {
    uint64_t word = 0;
    std::memcpy(&word, text.data() + offset, std::min<size_t>(8, text.size() - offset));
    words[offset / 8].store(word, std::memory_order_relaxed);
  }
}

// The first `length` bytes of `words`, loaded with relaxed atomic loads into
// `out`: a racing writer makes them torn, never undefined behaviour.
void loadBytes(const std::atomic<uint64_t>* words, size_t length, std::string& out) {
  out.resize(length);
  for (size_t offset = 0; offset < length; offset += 8) {
    const uint64_t word = words[offset / 8].load(std::memory_order_relaxed);
    std::memcpy(out.data() + offset, &word, std::min<size_t>(8, length - offset));
  }
}

size_t strideFor(size_t slotBytes) { return (offsetof(NodeRelay::Slot, data) + slotBytes + 63) / 64 * 64; }

std::string randomName() {
  std::random_device device;
  return fmt::format("/bulkhead-relay-{}-{:016x}", getpid(), (uint64_t(device()) << 32) | device());
}

std::string firstLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

void* mapShared(int fd, size_t bytes, const std::string& name) {
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED)
    throw IoError(fmt::format("cannot map the node relay segment {}: {}", name, std::strerror(errno)), {});
  return base;
}

}  // namespace

NodeRelay::NodeRelay(std::string name, void* base, size_t bytes, bool leader)
    : name_(std::move(name)), base_(base), bytes_(bytes), leader_(leader), linked_(leader) {}

NodeRelay::~NodeRelay() {
  unlink();
  munmap(base_, bytes_);
}

std::unique_ptr<NodeRelay> NodeRelay::create(int slots, size_t slotBytes) {
  if (slots < 1 || slotBytes < 64 || slotBytes > (1u << 30) / static_cast<size_t>(slots))
    throw ConfigError(fmt::format("a node relay of {} slots of {} bytes is out of range", slots, slotBytes),
                      {.expected = "1 or more slots of 64 B to 1 GiB in all"});
  std::string name = randomName();
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw IoError(fmt::format("cannot create the node relay segment {}: {}", name, std::strerror(errno)), {});
  const size_t stride = strideFor(slotBytes);
  const size_t bytes = kHeaderBytes + stride * slots;
  void* base = nullptr;
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int error = errno;
    close(fd);
    shm_unlink(name.c_str());
    throw IoError(fmt::format("cannot size the node relay segment {}: {}", name, std::strerror(error)), {});
  }
  try {
    base = mapShared(fd, bytes, name);
  } catch (...) {
    close(fd);
    shm_unlink(name.c_str());
    throw;
  }
  close(fd);
  auto* header = new (base) Header{};
  header->slots = static_cast<uint32_t>(slots);
  header->stride = static_cast<uint32_t>(stride);
  header->forwardedMs.store(monotonicMs());
  std::atomic_thread_fence(std::memory_order_release);
  header->magic = kMagic;
  return std::unique_ptr<NodeRelay>(new NodeRelay(std::move(name), base, bytes, true));
}

std::unique_ptr<NodeRelay> NodeRelay::open(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw IoError(fmt::format("cannot open the node relay segment {}: {}", name, std::strerror(errno)), {});
  struct stat info {};
  if (fstat(fd, &info) != 0 || info.st_size < static_cast<off_t>(kHeaderBytes)) {
    close(fd);
    throw IoError(fmt::format("the node relay segment {} is too small to be one", name), {});
  }
  const size_t bytes = static_cast<size_t>(info.st_size);
  void* base = nullptr;
  try {
    base = mapShared(fd, bytes, name);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  const auto* header = static_cast<const Header*>(base);
  if (header->magic != kMagic || header->stride < strideFor(64) || header->stride % 64 != 0 ||
      kHeaderBytes + uint64_t(header->stride) * header->slots > bytes) {
    munmap(base, bytes);
    throw IoError(fmt::format("{} is not a node relay segment of this Bulkhead build", name), {});
  }
  return std::unique_ptr<NodeRelay>(new NodeRelay(name, base, bytes, false));
}

void NodeRelay::unlink() {
  if (!linked_) return;
  linked_ = false;
  shm_unlink(name_.c_str());
}

int NodeRelay::slots() const { return static_cast<int>(static_cast<const Header*>(base_)->slots); }

NodeRelay::Slot* NodeRelay::slot(int index) const {
  const auto* header = static_cast<const Header*>(base_);
  if (index < 0 || index >= slots())
    throw ConfigError(fmt::format("node relay slot {} does not exist (the segment has {})", index, slots()),
                      {.expected = "a local rank below the node's local size"});
  return reinterpret_cast<Slot*>(static_cast<char*>(base_) + kHeaderBytes + size_t(header->stride) * index);
}

// The sequence lock's writer: the odd version is ordered before every store
// of the record (the release fence), the record before the even version (its
// release store).
bool NodeRelay::write(int index, int worldRank, std::string_view text) {
  Slot* s = slot(index);
  const size_t capacity = static_cast<const Header*>(base_)->stride - offsetof(Slot, data);
  if (text.size() > capacity) return false;
  const uint64_t version = s->version.load(std::memory_order_relaxed);
  s->version.store(version + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  storeBytes(s->data, text);
  s->length.store(static_cast<uint32_t>(text.size()), std::memory_order_relaxed);
  s->worldRank.store(worldRank, std::memory_order_relaxed);
  s->version.store(version + 2, std::memory_order_release);
  return true;
}

// The sequence lock's reader: the acquire load of an even version makes the
// record written before it visible. Where a relaxed load saw a store of a
// later write, the acquire fence pairs with that write's release fence, so
// the second load of the version sees its odd version or a newer one, and the
// torn copy is dropped.
std::vector<NodeRelay::Record> NodeRelay::changed(std::vector<uint64_t>& seen) const {
  seen.resize(slots(), 0);
  const size_t capacity = static_cast<const Header*>(base_)->stride - offsetof(Slot, data);
  std::vector<Record> records;
  for (int i = 0; i < slots(); ++i) {
    const Slot* s = slot(i);
    const uint64_t before = s->version.load(std::memory_order_acquire);
    if (before == seen[i] || before % 2 == 1) continue;
    Record record{.slot = i, .worldRank = s->worldRank.load(std::memory_order_relaxed), .version = before};
    const uint32_t length = s->length.load(std::memory_order_relaxed);
    if (length > capacity) continue;
    loadBytes(s->data, length, record.text);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (s->version.load(std::memory_order_relaxed) != before) continue;  // rewritten meanwhile: next turn
    seen[i] = before;
    records.push_back(std::move(record));
  }
  return records;
}

void NodeRelay::stampForwarded() { static_cast<Header*>(base_)->forwardedMs.store(monotonicMs()); }

double NodeRelay::secondsSinceForwarded() const {
  return (monotonicMs() - static_cast<const Header*>(base_)->forwardedMs.load()) / 1000.0;
}

void NodeRelay::markForwarded(int index, uint64_t version) { slot(index)->forwarded.store(version); }
uint64_t NodeRelay::forwarded(int index) const { return slot(index)->forwarded.load(); }
uint64_t NodeRelay::version(int index) const { return slot(index)->version.load(); }

std::string thisNodeId() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  char ipc[128] = {};
  ssize_t length = readlink("/proc/self/ns/ipc", ipc, sizeof(ipc) - 1);
  return fmt::format("{}:{}:{}", host, firstLine("/proc/sys/kernel/random/boot_id"),
                     length > 0 ? std::string(ipc, static_cast<size_t>(length)) : "");
}

namespace {

std::shared_ptr<NodeRelay> lead(Store& store, const NodeRelayOptions& options, const std::string& key,
                                Deadline deadline) {
  std::shared_ptr<NodeRelay> relay = NodeRelay::create(options.localSize, options.slotBytes);
  std::string stored = store.compareSet(key + "/name", "", relay->name(), deadline);
  if (stored != relay->name()) {
    log::warn("monitor",
              "another rank also calls itself local rank 0 of this node; this rank publishes its "
              "heartbeats directly (check the launcher's local rank variables)");
    return nullptr;
  }
  std::vector<std::string> joined;
  for (int local = 1; local < options.localSize; ++local) joined.push_back(fmt::format("{}/joined/{}", key, local));
  try {
    store.wait(joined, deadline);
  } catch (const TimeoutError& e) {
    log::warn("monitor",
              "not every rank of this node joined its heartbeat relay; those that did not publish "
              "directly ({})",
              e.what());
  }
  relay->unlink();
  log::debug("monitor", "this rank relays the heartbeats of its node's {} ranks", options.localSize);
  return relay;
}

std::shared_ptr<NodeRelay> follow(Store& store, const NodeRelayOptions& options, const std::string& key,
                                  Deadline deadline) {
  std::string name = store.get(key + "/name", deadline);
  std::shared_ptr<NodeRelay> relay;
  try {
    relay = NodeRelay::open(name);
    if (options.localRank >= relay->slots()) {
      log::warn("monitor",
                "local rank {} has no slot in this node's heartbeat relay ({} slots): the ranks disagree "
                "on the local size; this rank publishes directly",
                options.localRank, relay->slots());
      relay.reset();
    }
  } catch (const Error& e) {
    log::warn("monitor", "this rank publishes its heartbeats directly: {}", e.what());
  }
  store.set(fmt::format("{}/joined/{}", key, options.localRank), relay ? "1" : "0", deadline);
  return relay;
}

}  // namespace

std::shared_ptr<NodeRelay> joinNodeRelay(Store& store, const NodeRelayOptions& options, Deadline deadline) {
  if (options.localSize < 2 || options.localRank < 0 || options.localRank >= options.localSize ||
      !env::kNodeRelay.flag())
    return nullptr;
  const std::string key = fmt::format("relay/{}", options.nodeId.empty() ? thisNodeId() : options.nodeId);
  try {
    return options.localRank == 0 ? lead(store, options, key, deadline) : follow(store, options, key, deadline);
  } catch (const Error& e) {
    log::warn("monitor", "this rank publishes its heartbeats directly, without its node's relay: {}", e.what());
    return nullptr;
  }
}

}  // namespace bulkhead
