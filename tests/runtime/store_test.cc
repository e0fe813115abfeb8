// The Store contract (runtime/store/store.h), run against every implementation:
// TcpStore (a server and clients in this process, on real sockets) and
// FileStore (a fresh temporary directory, real files).
#include <fmt/format.h>

#include <atomic>
#include <thread>
#include <vector>

#include "runtime/store/prefix_store.h"
#include "tests/runtime/store_harness.h"

using namespace bulkhead;
using namespace bulkhead::testing;

TEMPLATE_TEST_CASE("a store returns exactly the bytes set, '\\0' bytes and 1 MiB values included", "[store]",
                   TcpHarness, FileHarness) {
  TestType harness;
  auto writer = harness.client(), reader = harness.client();
  std::mt19937_64 rng(11);
  std::vector<std::pair<std::string, std::string>> entries;
  for (size_t size : {size_t(0), size_t(1), size_t(7), size_t(4093), size_t(1) << 20, (size_t(1) << 20) + 3}) {
    std::string key = fmt::format("group/ep[{}]/{}", size % 5, randomWord(rng, 12));
    entries.emplace_back(key, randomBytes(rng, size));
    writer->set(key, entries.back().second, seconds(5));
  }
  for (const auto& [key, value] : entries) {
    INFO(harness.kind << " key " << key << " of " << value.size() << " bytes");
    CHECK(reader->get(key, seconds(5)) == value);
    CHECK(reader->tryGet(key, seconds(5)) == value);
  }
  // A second set replaces the value.
  std::string replacement = randomBytes(rng, 333);
  writer->set(entries.front().first, replacement, seconds(5));
  CHECK(reader->get(entries.front().first, seconds(5)) == replacement);
}

TEMPLATE_TEST_CASE("get of a missing key raises TimeoutError within its deadline, naming the key and the store",
                   "[store]", TcpHarness, FileHarness) {
  TestType harness;
  auto store = harness.client();
  std::mt19937_64 rng(12);
  store->set("present", "1", seconds(5));  // connected: the deadline below measures the wait alone
  for (int attempt = 0; attempt < 3; ++attempt) {
    double deadline = 0.2 + 0.1 * static_cast<double>(rng() % 4);
    std::string key = "never/" + randomWord(rng, 10);
    auto [error, elapsed] = expectError<TimeoutError>([&] { store->get(key, seconds(deadline)); });
    INFO(harness.kind << ": " << error.what());
    CHECK(elapsed >= deadline);
    CHECK(elapsed < deadline + 0.5);
    CHECK(std::string(error.what()).find(key) != std::string::npos);
    CHECK(std::string(error.what()).find(store->describe()) != std::string::npos);
  }
  CHECK_FALSE(store->tryGet("never/at-all", seconds(1)).has_value());
}

TEMPLATE_TEST_CASE("wait returns once another thread has set every key, and names the keys that never come", "[store]",
                   TcpHarness, FileHarness) {
  TestType harness;
  auto waiter = harness.client(), setter = harness.client();
  std::mt19937_64 rng(13);
  std::vector<std::string> keys;
  for (int i = 0; i < 5; ++i) keys.push_back(fmt::format("heads/{}", randomWord(rng, 8)));
  std::atomic<int64_t> lastSetStarted{0};
  std::thread thread([&] {
    setter->get("go", seconds(10));
    for (const std::string& key : keys) {
      lastSetStarted = Clock::now().time_since_epoch().count();
      setter->set(key, randomBytes(rng, 9), seconds(5));
    }
  });
  waiter->set("go", "1", seconds(5));
  waiter->wait(keys, seconds(10));
  int64_t returned = Clock::now().time_since_epoch().count();
  thread.join();
  CHECK(returned >= lastSetStarted.load());
  for (const auto& value : waiter->multiGet(keys, seconds(5))) CHECK(value.has_value());

  std::vector<std::string> someMissing = {keys[0], "absent/one", keys[1], "absent/two"};
  auto [error, elapsed] = expectError<TimeoutError>([&] { waiter->wait(someMissing, seconds(0.3)); });
  INFO(error.what());
  CHECK(elapsed >= 0.3);
  CHECK(elapsed < 0.8);
  std::string text = error.what();
  CHECK(text.find("'absent/one'") != std::string::npos);
  CHECK(text.find("'absent/two'") != std::string::npos);
  CHECK(text.find(harness.kind) != std::string::npos);
}

TEMPLATE_TEST_CASE("add from 8 threads x 1000 increments totals exactly", "[store]", TcpHarness, FileHarness) {
  TestType harness;
  auto shared = harness.client();  // half the threads share one client, as a heartbeat and a trainer would
  constexpr int kThreads = 8, kIncrements = 1000;
  std::atomic<int64_t> expected{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      auto store = t % 2 ? shared : harness.client();
      std::mt19937_64 rng(100 + t);
      int64_t sum = 0;
      for (int i = 0; i < kIncrements; ++i) {
        int64_t delta = 1 + static_cast<int64_t>(rng() % 1000);
        store->add("counter", delta, seconds(30));
        sum += delta;
      }
      expected += sum;
    });
  for (auto& thread : threads) thread.join();
  CHECK(shared->add("counter", 0, seconds(5)) == expected.load());
  CHECK(shared->get("counter", seconds(5)) == std::to_string(expected.load()));
  CHECK(shared->add("fresh", -17, seconds(5)) == -17);  // a missing key counts as 0

  shared->set("text", "not a number", seconds(5));
  auto [error, elapsed] = expectError<ConfigError>([&] { shared->add("text", 1, seconds(5)); });
  CHECK(std::string(error.what()).find("not a decimal integer") != std::string::npos);
  CHECK(shared->get("text", seconds(5)) == "not a number");
}

TEMPLATE_TEST_CASE("compareSet sets only over the expected value; empty expected means only if missing", "[store]",
                   TcpHarness, FileHarness) {
  TestType harness;
  auto store = harness.client();
  std::mt19937_64 rng(15);
  std::string first = randomBytes(rng, 21), second = randomBytes(rng, 34), other = randomBytes(rng, 5);
  // Missing key, non-empty expected: nothing is stored.
  CHECK(store->compareSet("k", other, first, seconds(5)) == "");
  CHECK_FALSE(store->tryGet("k", seconds(5)).has_value());
  // Missing key, empty expected: stored.
  CHECK(store->compareSet("k", "", first, seconds(5)) == first);
  // Present key, empty expected: not replaced.
  CHECK(store->compareSet("k", "", second, seconds(5)) == first);
  // Present key, a different expected value: not replaced, the current value returned.
  CHECK(store->compareSet("k", other, second, seconds(5)) == first);
  // Present key, matching expected: replaced.
  CHECK(store->compareSet("k", first, second, seconds(5)) == second);
  CHECK(store->get("k", seconds(5)) == second);
  // A key that holds "" exists: empty expected does not match it.
  store->set("empty", "", seconds(5));
  CHECK(store->compareSet("empty", "", first, seconds(5)) == "");
  CHECK(store->tryGet("empty", seconds(5)) == std::string());
}

TEMPLATE_TEST_CASE("a counter built on compareSet by 8 contending threads loses no increment", "[store]", TcpHarness,
                   FileHarness) {
  TestType harness;
  constexpr int kThreads = 8, kIncrements = 150;
  auto shared = harness.client();
  std::atomic<int> conflicts{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      auto store = t % 2 ? shared : harness.client();
      for (int i = 0; i < kIncrements; ++i) {
        // Values are "<count>/<thread>/<i>": a desired value is this thread's
        // alone, so getting it back means this thread's compareSet won.
        while (true) {
          std::string current = store->tryGet("cas", seconds(30)).value_or("");
          int64_t count = current.empty() ? 0 : std::stoll(current.substr(0, current.find('/')));
          std::string desired = fmt::format("{}/{}/{}", count + 1, t, i);
          if (store->compareSet("cas", current, desired, seconds(30)) == desired) break;
          ++conflicts;
        }
      }
    });
  for (auto& thread : threads) thread.join();
  std::string final = shared->get("cas", seconds(5));
  CHECK(std::stoll(final.substr(0, final.find('/'))) == kThreads * kIncrements);
  INFO(harness.kind << " conflicts: " << conflicts.load());
}

TEMPLATE_TEST_CASE("multiGet returns every key in order, nullopt for the missing ones", "[store]", TcpHarness,
                   FileHarness) {
  TestType harness;
  auto store = harness.client();
  std::mt19937_64 rng(16);
  std::vector<std::string> keys;
  std::vector<std::optional<std::string>> expected;
  for (int i = 0; i < 12; ++i) {
    keys.push_back(fmt::format("ledger/heads/{}", i));
    if (rng() % 3 == 0) {
      expected.push_back(std::nullopt);
    } else {
      expected.push_back(randomBytes(rng, 1 + rng() % 200));
      store->set(keys.back(), *expected.back(), seconds(5));
    }
  }
  CHECK((store->multiGet(keys, seconds(5)) == expected));
  CHECK(store->multiGet({}, seconds(5)).empty());
}

TEMPLATE_TEST_CASE("erase removes a key and reports whether it existed", "[store]", TcpHarness, FileHarness) {
  TestType harness;
  auto store = harness.client();
  std::mt19937_64 rng(17);
  std::string value = randomBytes(rng, 40);
  store->set("doomed", value, seconds(5));
  store->set("kept", value, seconds(5));
  CHECK(store->erase("doomed", seconds(5)));
  CHECK_FALSE(store->tryGet("doomed", seconds(5)).has_value());
  CHECK_FALSE(store->erase("doomed", seconds(5)));
  CHECK(store->get("kept", seconds(5)) == value);
  CHECK_THROWS_AS(store->get("doomed", seconds(0.2)), TimeoutError);
  CHECK(store->add("doomed", 5, seconds(5)) == 5);  // a fresh start after erase
}

TEMPLATE_TEST_CASE("two PrefixStores over one store never see each other's keys", "[store]", TcpHarness, FileHarness) {
  TestType harness;
  auto base = harness.client();
  PrefixStore ep0(base, "group/ep[0]"), ep1(base, "group/ep[1]/");
  std::mt19937_64 rng(18);
  std::string a = randomBytes(rng, 30), b = randomBytes(rng, 31);
  ep0.set("heads/0", a, seconds(5));
  ep1.set("heads/0", b, seconds(5));
  CHECK(ep0.get("heads/0", seconds(5)) == a);
  CHECK(ep1.get("heads/0", seconds(5)) == b);
  CHECK(base->get("group/ep[0]/heads/0", seconds(5)) == a);
  CHECK(ep1.prefix() == "group/ep[1]/");

  ep0.set("only-in-0", a, seconds(5));
  CHECK_FALSE(ep1.tryGet("only-in-0", seconds(5)).has_value());
  CHECK(
      (ep1.multiGet({"heads/0", "only-in-0"}, seconds(5)) == std::vector<std::optional<std::string>>{b, std::nullopt}));
  CHECK(ep0.add("count", 3, seconds(5)) == 3);
  CHECK(ep1.add("count", 4, seconds(5)) == 4);
  CHECK(ep0.compareSet("count", "3", "30", seconds(5)) == "30");
  CHECK(ep1.get("count", seconds(5)) == "4");
  CHECK(ep1.erase("only-in-0", seconds(5)) == false);
  CHECK(ep0.tryGet("only-in-0", seconds(5)) == a);

  auto [error, elapsed] = expectError<TimeoutError>([&] { ep1.wait({"heads/0", "only-in-0"}, seconds(0.2)); });
  CHECK(std::string(error.what()).find("group/ep[1]/only-in-0") != std::string::npos);
  // Nested prefixes compose.
  PrefixStore nested(std::make_shared<PrefixStore>(base, "group"), "ep[0]");
  CHECK(nested.get("heads/0", seconds(5)) == a);
  CHECK_THROWS_AS(ep0.set("", a, seconds(5)), ConfigError);
}

TEST_CASE("FileStore names key files safely: '/', '[', ']' and other bytes are encoded") {
  CHECK(FileStore::fileNameOf("group/ep[1]/heads") == "k.group%2Fep%5B1%5D%2Fheads");
  CHECK(FileStore::fileNameOf("a.b%") == "k.a%2Eb%25");
  CHECK(FileStore::fileNameOf("..") == "k.%2E%2E");
}

TEMPLATE_TEST_CASE("multiSet sets every pair, replaces values and wakes a waiter, through a prefix too", "[store]",
                   TcpHarness, FileHarness) {
  TestType harness;
  auto writer = harness.client(), reader = harness.client();
  std::mt19937_64 rng(21);
  std::vector<std::pair<std::string, std::string>> pairs;
  for (int i = 0; i < 37; ++i)
    pairs.emplace_back(fmt::format("state/{}", randomWord(rng, 6)), randomBytes(rng, 1 + rng() % 3000));
  std::vector<std::string> keys;
  for (const auto& pair : pairs) keys.push_back(pair.first);
  std::thread waiter([&] { reader->wait(keys, seconds(10)); });
  writer->multiSet(pairs, seconds(5));
  waiter.join();
  auto values = reader->multiGet(keys, seconds(5));
  for (size_t i = 0; i < pairs.size(); ++i) CHECK(values[i] == pairs[i].second);

  pairs[5].second = randomBytes(rng, 77);
  PrefixStore prefixed(writer, "job");
  prefixed.multiSet({pairs[5], {"extra", "x"}}, seconds(5));
  CHECK(reader->get("job/" + pairs[5].first, seconds(5)) == pairs[5].second);
  CHECK(reader->get("job/extra", seconds(5)) == "x");
  writer->multiSet({}, seconds(5));  // nothing to set: no request
  CHECK_THROWS_AS(writer->multiSet({{"", "v"}}, seconds(5)), ConfigError);
}

TEMPLATE_TEST_CASE("setAndGather: every thread gets every thread's value, erases its older key, and is named when late",
                   "[store]", TcpHarness, FileHarness) {
  TestType harness;
  constexpr int kThreads = 5;
  std::mt19937_64 rng(31);
  std::vector<std::string> values;
  for (int i = 0; i < kThreads; ++i) values.push_back(randomBytes(rng, 1 + rng() % 5000));
  for (int round = 1; round <= 3; ++round) {
    std::vector<std::string> keys;
    for (int i = 0; i < kThreads; ++i) keys.push_back(fmt::format("round/{}/{}", round, i));
    std::vector<std::vector<std::string>> gathered(kThreads);
    std::vector<std::thread> threads;
    for (int i = 0; i < kThreads; ++i)
      threads.emplace_back([&, i] {
        PrefixStore prefixed(harness.client(), "job");
        gathered[i] = prefixed.setAndGather({.key = keys[i],
                                             .value = values[i] + std::to_string(round),
                                             .erase = round > 1 ? fmt::format("round/{}/{}", round - 1, i) : "",
                                             .keys = keys},
                                            seconds(10));
      });
    for (auto& thread : threads) thread.join();
    for (int i = 0; i < kThreads; ++i) {
      REQUIRE(gathered[i].size() == static_cast<size_t>(kThreads));
      for (int j = 0; j < kThreads; ++j) CHECK(gathered[i][j] == values[j] + std::to_string(round));
    }
  }
  auto store = harness.client();
  CHECK_FALSE(store->tryGet("job/round/2/0", seconds(5)));  // erased by round 3
  CHECK(store->tryGet("job/round/3/0", seconds(5)));
  // A round one key of which never comes: TimeoutError names it, soon after the deadline.
  auto [error, took] = expectError<TimeoutError>([&] {
    store->setAndGather({.key = "late/0", .value = "v", .keys = {"late/0", "late/1"}}, seconds(1));
  });
  CHECK(std::string(error.what()).find("late/1") != std::string::npos);
  CHECK(took < 3.0);
  CHECK(store->tryGet("late/0", seconds(5)) == std::optional<std::string>("v"));
  CHECK_THROWS_AS(store->setAndGather({.key = "", .value = "v", .keys = {"a"}}, seconds(1)), ConfigError);
}

TEST_CASE("a tcp setAndGather parked on keys waits again for a key erased meanwhile, and no other request suffers",
          "[store]") {
  TcpHarness harness;
  auto gatherer = harness.client(), other = harness.client(), bystander = harness.client();
  other->set("gather/0", "first", seconds(5));
  std::atomic<bool> returned{false};
  std::vector<std::string> values;
  std::thread parked([&] {
    values =
        gatherer->setAndGather({.key = "gather/self", .value = "me", .keys = {"gather/0", "gather/1"}}, seconds(10));
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // parked on gather/1, past gather/0
  CHECK(other->erase("gather/0", seconds(5)));
  std::thread waiter([&] { bystander->wait({"gather/1"}, seconds(10)); });
  other->set("gather/1", "second", seconds(5));  // the request now waits for gather/0 again
  waiter.join();                                 // a plain wait on the same key is answered
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK_FALSE(returned.load());
  other->set("gather/0", "again", seconds(5));
  parked.join();
  CHECK(values == std::vector<std::string>{"again", "second"});
}
