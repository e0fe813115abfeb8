// The node relay (runtime/diagnosis/node_relay.h): a real shared-memory segment shared
// with a child process, and monitors of four simulated ranks of one node
// publishing through a real TCP store.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "runtime/diagnosis/monitor.h"
#include "runtime/diagnosis/monitor_record.h"
#include "runtime/diagnosis/node_relay.h"
#include "tests/runtime/store_harness.h"

using namespace bulkhead;
using namespace bulkhead::testing;

namespace {

bool segmentExists(const std::string& name) { return std::filesystem::exists("/dev/shm" + name); }

// Forwards to a store and counts the writes each kind of call made.
class CountingStore final : public Store {
 public:
  explicit CountingStore(std::shared_ptr<Store> store) : store_(std::move(store)) {}
  std::atomic<int> sets{0}, multiSets{0};
  void set(const std::string& key, const std::string& value, Deadline deadline) override {
    ++sets;
    store_->set(key, value, deadline);
  }
  void multiSet(const std::vector<std::pair<std::string, std::string>>& pairs, Deadline deadline) override {
    ++multiSets;
    store_->multiSet(pairs, deadline);
  }
  std::string get(const std::string& key, Deadline deadline) override { return store_->get(key, deadline); }
  std::optional<std::string> tryGet(const std::string& key, Deadline deadline) override {
    return store_->tryGet(key, deadline);
  }
  std::vector<std::optional<std::string>> multiGet(const std::vector<std::string>& keys, Deadline deadline) override {
    return store_->multiGet(keys, deadline);
  }
  int64_t add(const std::string& key, int64_t delta, Deadline deadline) override {
    return store_->add(key, delta, deadline);
  }
  std::string compareSet(const std::string& key, const std::string& expected, const std::string& desired,
                         Deadline deadline) override {
    return store_->compareSet(key, expected, desired, deadline);
  }
  void wait(const std::vector<std::string>& keys, Deadline deadline) override { store_->wait(keys, deadline); }
  bool erase(const std::string& key, Deadline deadline) override { return store_->erase(key, deadline); }
  std::string describe() const override { return store_->describe(); }

 private:
  std::shared_ptr<Store> store_;
};

// How old each rank's published record is, in seconds (a large number when missing).
std::vector<double> ages(Store& store, int ranks) {
  std::vector<std::string> keys;
  for (int r = 0; r < ranks; ++r) keys.push_back(monitor_record::stateKey(r));
  auto values = store.multiGet(keys, seconds(5));
  const int64_t now = monitor_record::wallClockMs();
  std::vector<double> result;
  for (const auto& value : values) {
    auto state = monitor_record::decodeState(value);
    result.push_back(state ? (now - state->wallMs) / 1000.0 : 1e9);
  }
  return result;
}

// Record `index` of a slot's writer: its length and every byte follow from
// `index`, so a copy that mixes two records (or one's bytes with another's
// length or rank) does not match the record its rank names.
std::string recordText(int index) {
  std::string text(static_cast<size_t>(index) * 37 % 4001, '\0');
  for (size_t j = 0; j < text.size(); ++j) text[j] = static_cast<char>(static_cast<size_t>(index) * 131 + j * 7);
  return text;
}

}  // namespace

TEST_CASE("a relay segment carries each slot's newest record to another process, and unlink leaves no name") {
  std::mt19937_64 rng(31);
  auto leader = NodeRelay::create(3, 4096);
  REQUIRE(segmentExists(leader->name()));
  std::vector<std::string> texts;
  for (int slot = 0; slot < 3; ++slot) texts.push_back(randomWord(rng, 100 + rng() % 3000));
  leader->stampForwarded();
  pid_t child = fork();
  if (child == 0) {
    int code = 0;
    try {
      auto member = NodeRelay::open(leader->name());
      for (int slot = 1; slot < 3; ++slot) code |= member->write(slot, 10 + slot, texts[slot]) ? 0 : 1;
      code |= member->write(1, 11, std::string(5000, 'x')) ? 2 : 0;  // larger than a slot: refused
      // The leader's stamp, read in another process's clock: just made.
      const double since = member->secondsSinceForwarded();
      code |= since >= 0 && since < 10 ? 0 : 8;
    } catch (...) {
      code = 4;
    }
    _exit(code);
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  CHECK(leader->write(0, 10, texts[0]));
  std::vector<uint64_t> seen;
  auto records = leader->changed(seen);
  REQUIRE(records.size() == 3);
  for (const auto& record : records) {
    CHECK(record.worldRank == 10 + record.slot);
    CHECK(record.text == texts[record.slot]);
  }
  CHECK(leader->changed(seen).empty());  // nothing new since
  CHECK(leader->write(2, 12, "newer"));
  records = leader->changed(seen);
  REQUIRE(records.size() == 1);
  CHECK(records[0].text == "newer");
  CHECK_THROWS_AS(leader->write(3, 13, "no such slot"), ConfigError);

  leader->unlink();
  CHECK_FALSE(segmentExists(leader->name()));
  CHECK_THROWS_AS(NodeRelay::open(leader->name()), IoError);
  CHECK(leader->write(0, 10, "still mapped"));
}

TEST_CASE("a node's ranks publish through its leader in one request per turn, and directly once it stops") {
  TcpHarness harness;
  std::mt19937_64 rng(32);
  constexpr int kRanks = 4;
  const std::string nodeId = randomWord(rng, 12);
  MonitorOptions options;
  options.heartbeatSeconds = 0.1;
  options.deadAfterSeconds = 1.0;
  std::vector<std::shared_ptr<CountingStore>> stores;
  std::vector<std::shared_ptr<NodeRelay>> relays(kRanks);
  for (int r = 0; r < kRanks; ++r) stores.push_back(std::make_shared<CountingStore>(harness.client()));
  std::vector<std::thread> joins;
  for (int r = 0; r < kRanks; ++r)
    joins.emplace_back([&, r] {
      relays[r] = joinNodeRelay(*stores[r], {.localRank = r, .localSize = kRanks, .worldRank = r, .nodeId = nodeId},
                                seconds(10));
    });
  for (auto& join : joins) join.join();
  for (int r = 0; r < kRanks; ++r) REQUIRE(relays[r] != nullptr);
  CHECK(relays[0]->leader());
  CHECK_FALSE(segmentExists(relays[0]->name()));  // unlinked once every member opened it

  std::vector<std::shared_ptr<Monitor>> monitors;
  for (int r = 0; r < kRanks; ++r) {
    monitors.push_back(std::make_shared<Monitor>(stores[r], r, options));
    monitors[r]->relayThrough(relays[r], r);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  auto fresh = ages(*harness.client(), kRanks);
  for (int r = 0; r < kRanks; ++r) {
    INFO("rank " << r << " record age " << fresh[r] << " s");
    CHECK(fresh[r] < 0.5);
  }
  CHECK(stores[0]->multiSets >= 5);
  // A member publishes directly only while its leader is late: its turns
  // before the leader's first forward, and any turn after the leader's
  // thread went unscheduled for over 1.25 heartbeats (two shared cores under
  // a parallel test run). Without the relay every member would publish every
  // turn: about 30 sets in this second.
  int direct = 0;
  for (int r = 1; r < kRanks; ++r) direct += stores[r]->sets;
  INFO(direct << " direct sets by " << kRanks - 1 << " members in 1 s of 0.1 s turns");
  CHECK(direct <= 3 * (kRanks - 1));

  // The leader stops: its members notice and publish their own records.
  monitors[0]->stop();
  const int before = stores[1]->sets;
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  auto after = ages(*harness.client(), kRanks);
  CHECK(after[0] > 0.6);
  for (int r = 1; r < kRanks; ++r) {
    INFO("rank " << r << " record age " << after[r] << " s after its leader stopped");
    CHECK(after[r] < 0.5);
  }
  CHECK(stores[1]->sets > before);
  for (auto& monitor : monitors) monitor->stop();
}

TEST_CASE("no relay below two local ranks, and a second local rank 0 publishes directly") {
  TcpHarness harness;
  auto store = harness.client();
  CHECK(joinNodeRelay(*store, {.localRank = 0, .localSize = 1}, seconds(2)) == nullptr);
  CHECK(joinNodeRelay(*store, {.localRank = 0, .localSize = -1}, seconds(2)) == nullptr);
  const NodeRelayOptions options{.localRank = 0, .localSize = 2, .nodeId = "twice"};
  std::shared_ptr<NodeRelay> first;
  std::thread member(
      [&] { joinNodeRelay(*harness.client(), {.localRank = 1, .localSize = 2, .nodeId = "twice"}, seconds(5)); });
  first = joinNodeRelay(*store, options, seconds(5));
  member.join();
  CHECK(first != nullptr);
  CHECK(joinNodeRelay(*store, options, seconds(5)) == nullptr);
}

// The sequence lock: a reader copying a slot while its owner rewrites it
// gets whole records only. Under ThreadSanitizer (.ci/sanitize.sh thread) it
// also fails on any non-atomic access to the slot's bytes.
TEST_CASE("a relay slot read while its owner rewrites it yields whole records, never a mix of two") {
  auto relay = NodeRelay::create(1, 4096);
  std::atomic<bool> stop{false};
  int writes = 0, refused = 0;
  std::thread writer([&] {
    for (; !stop.load(std::memory_order_relaxed); ++writes)
      refused += relay->write(0, writes, recordText(writes)) ? 0 : 1;
  });
  std::vector<uint64_t> seen;
  int reads = 0, mixed = 0;
  uint64_t last = 0;
  bool ordered = true;
  std::string example;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] { return std::chrono::steady_clock::now() - start; };
  // Enough records for the reads to have overlapped writes, however the two
  // threads are scheduled.
  while ((reads < 200 || elapsed() < std::chrono::milliseconds(200)) && elapsed() < std::chrono::seconds(20)) {
    for (const NodeRelay::Record& record : relay->changed(seen)) {
      ++reads;
      ordered = ordered && record.version > last;
      last = record.version;
      if (record.worldRank >= 0 && record.version == 2 * (static_cast<uint64_t>(record.worldRank) + 1) &&
          record.text == recordText(record.worldRank))
        continue;
      if (mixed++ == 0)
        example = fmt::format("rank {}, version {}, {} bytes", record.worldRank, record.version, record.text.size());
    }
  }
  stop = true;
  writer.join();
  INFO(reads << " records read while " << writes << " were written");
  CHECK(refused == 0);
  INFO("first mixed record: " << example);
  CHECK(mixed == 0);
  CHECK(ordered);
  CHECK(reads >= 200);
  // Once the owner stopped, its newest record is read.
  auto rest = relay->changed(seen);
  CHECK(relay->version(0) == 2 * static_cast<uint64_t>(writes));
  CHECK(seen[0] == relay->version(0));
  for (const NodeRelay::Record& record : rest) CHECK(record.text == recordText(writes - 1));
}
