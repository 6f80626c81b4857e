// A pool's settings changed while streams allocate, against the fake driver (tests/fake_driver).
// Four threads allocate and free random sizes on their own streams, now and then handing a block
// to another thread's stream through an event, while a fifth keeps changing the reuse policy and
// the release threshold and trimming. Whatever the settings, no two live allocations may
// overlap, and the pool must add up once everything is freed. Built for ThreadSanitizer too.
//
// The fake device's memory is not host-readable: only addresses and sizes are checked.

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

using namespace streamalloc;
using streamalloc_test::fake_live;
using streamalloc_test::MiB;

namespace {
constexpr int workers = 4;
constexpr int iterations = 3000;
constexpr std::uint64_t seed = 20240611;

// Every live allocation, [start, start + size), shared by all threads.
class live_ranges {
 public:
  /// Records a new allocation; false if it overlaps one still live.
  bool add(void* p, std::size_t size, std::string& why) {
    const auto start = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard lock(mutex_);
    auto next = ranges_.lower_bound(start);
    if (next != ranges_.end() && next->first < start + size) {
      why = describe(start, size, next->first, next->second);
      return false;
    }
    if (next != ranges_.begin()) {
      const auto prev = std::prev(next);
      if (prev->first + prev->second > start) {
        why = describe(start, size, prev->first, prev->second);
        return false;
      }
    }
    ranges_.emplace_hint(next, start, size);
    return true;
  }
  // Called before the pool gets the block back: once it has, another thread may be handed the
  // same addresses, and they must not be found still recorded here.
  void remove(void* p) {
    std::lock_guard lock(mutex_);
    ranges_.erase(reinterpret_cast<std::uintptr_t>(p));
  }
  std::size_t size() {
    std::lock_guard lock(mutex_);
    return ranges_.size();
  }

 private:
  static std::string describe(std::uintptr_t a, std::size_t an, std::uintptr_t b, std::size_t bn) {
    std::ostringstream m;
    m << std::hex << "[0x" << a << ", 0x" << a + an << ") overlaps live [0x" << b << ", 0x" << b + bn << ")";
    return m.str();
  }

  std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> ranges_;
};

// A failure seen on a worker thread, reported on the test's thread (the first one in full).
class failures {
 public:
  void add(const std::string& what) {
    std::lock_guard lock(mutex_);
    if (count_++ == 0) first_ = what;
  }
  int count() {
    std::lock_guard lock(mutex_);
    return count_;
  }
  std::string first() {
    std::lock_guard lock(mutex_);
    return first_;
  }

 private:
  std::mutex mutex_;
  int count_ = 0;
  std::string first_;
};

struct block {
  void* ptr = nullptr;
  std::size_t size = 0;
};

// A block on its way to another thread's stream, with the event recorded after the sender's
// last use of it, which the receiver's stream waits for before using it.
struct handoff {
  block b;
  std::shared_ptr<event> after_last_use;
};

class mailbox {
 public:
  void post(handoff h) {
    std::lock_guard lock(mutex_);
    items_.push_back(std::move(h));
  }
  std::vector<handoff> take_all() {
    std::lock_guard lock(mutex_);
    return std::exchange(items_, {});
  }

 private:
  std::mutex mutex_;
  std::vector<handoff> items_;
};

// 256 B to 4 MiB, spread evenly over the powers of two so small and large requests both come
// often, and not always a multiple of 256.
std::size_t random_size(std::mt19937_64& rng) {
  const int log2 = std::uniform_int_distribution<int>(8, 21)(rng);
  const std::size_t low = std::size_t{1} << log2;
  return std::uniform_int_distribution<std::size_t>(low, 2 * low)(rng);
}
}  // namespace

TEST_SUITE("pool_settings") {
  TEST_CASE("reuse policy, release threshold and trims changed while four threads allocate and hand blocks over") {
    CAPTURE(seed);
    pool p;
    live_ranges live;
    failures failed;
    std::array<mailbox, workers> mailboxes;
    // Made here, so a block handed to a thread that has finished can still be freed on its stream.
    std::vector<stream> streams;
    for (int t = 0; t < workers; ++t) streams.emplace_back(0);

    std::atomic<bool> go{false};
    std::atomic<int> running{workers};
    std::atomic<int> settings_changes{0};
    std::atomic<int> handoffs{0};
    reuse_policy last_reuse{};
    std::size_t last_threshold = 0;

    auto change_settings = [&] {
      std::mt19937_64 rng(seed);
      const std::array<std::size_t, 3> thresholds{0, 64 * MiB, SIZE_MAX};
      const std::array<std::size_t, 3> trims{0, 4 * MiB, 64 * MiB};
      std::bernoulli_distribution coin;
      while (running.load() > 0) {
        last_reuse = reuse_policy{.follow_event_dependencies = coin(rng), .opportunistic = coin(rng),
                                  .internal_dependencies = coin(rng)};
        p.set_reuse_policy(last_reuse);
        last_threshold = thresholds[rng() % thresholds.size()];
        p.set_release_threshold(last_threshold);
        p.trim_to(trims[rng() % trims.size()]);
        const pool_statistics st = p.statistics();
        if (st.used_current > st.reserved_current) failed.add("statistics: more bytes used than reserved");
        ++settings_changes;
        go = true;  // the workers start once the settings have changed at least once
        std::this_thread::yield();
      }
    };
    std::thread settings([&] {
      try {
        change_settings();
      } catch (const std::exception& e) {
        failed.add(std::string("the settings thread threw: ") + e.what());
      }
      go = true;
    });

    auto work = [&](int me) {
      std::mt19937_64 rng(seed + 1 + me);
      const stream& own = streams[me];
      std::vector<block> mine;
      auto release = [&](std::size_t i) {
        live.remove(mine[i].ptr);
        p.deallocate(mine[i].ptr, own);
        mine[i] = mine.back();
        mine.pop_back();
      };
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < iterations; ++i) {
        for (handoff& h : mailboxes[me].take_all()) {
          (void)own.wait(*h.after_last_use);  // the block is ours on our stream from here
          mine.push_back(h.b);
        }
        const std::size_t size = random_size(rng);
        void* ptr = p.allocate(size, own);
        if (reinterpret_cast<std::uintptr_t>(ptr) % 256 != 0) failed.add("an allocation is not 256-aligned");
        std::string why;
        if (!live.add(ptr, size, why)) failed.add(why);
        mine.push_back({ptr, size});

        const std::size_t keep = rng() % 24;
        while (mine.size() > keep && rng() % 3 != 0) release(rng() % mine.size());
        if (!mine.empty() && rng() % 8 == 0) {
          const std::size_t which = rng() % mine.size();
          const int to = static_cast<int>((me + 1 + rng() % (workers - 1)) % workers);
          auto e = std::make_shared<event>();
          e->record(own);
          mailboxes[to].post({mine[which], std::move(e)});
          ++handoffs;
          mine[which] = mine.back();
          mine.pop_back();
        }
        if (rng() % 64 == 0) (void)own.synchronize();  // a synchronization point: the threshold applies
      }
      while (!mine.empty()) release(mine.size() - 1);
    };
    // An exception on a worker would end the program without a word of which case failed: it
    // is recorded as a failure instead, and the blocks the thread held are left to the checks.
    auto worker = [&](int me) {
      try {
        work(me);
      } catch (const std::exception& e) {
        failed.add(std::string("worker ") + std::to_string(me) + " threw: " + e.what());
      }
      --running;
    };
    std::vector<std::thread> threads;
    for (int t = 0; t < workers; ++t) threads.emplace_back(worker, t);
    for (auto& t : threads) t.join();
    settings.join();

    // Blocks handed to a thread after it finished: freed on its stream, after the handoff's event.
    for (int t = 0; t < workers; ++t) {
      for (handoff& h : mailboxes[t].take_all()) {
        (void)streams[t].wait(*h.after_last_use);
        live.remove(h.b.ptr);
        p.deallocate(h.b.ptr, streams[t]);
      }
    }

    INFO("first failure: ", failed.first());
    CHECK(failed.count() == 0);
    CHECK(settings_changes.load() > 0);
    CHECK(handoffs.load() > 0);
    CHECK(live.size() == 0);
    const pool_statistics after = p.statistics();
    CHECK(after.live_allocations == 0);
    CHECK(after.used_current == 0);

    // The properties are the settings last made.
    CHECK(p.properties().release_threshold == last_threshold);
    CHECK(p.properties().reuse.follow_event_dependencies == last_reuse.follow_event_dependencies);
    CHECK(p.properties().reuse.opportunistic == last_reuse.opportunistic);
    CHECK(p.properties().reuse.internal_dependencies == last_reuse.internal_dependencies);

    // With nothing live, a threshold of 0 and a synchronization point give everything back.
    p.set_release_threshold(0);
    (void)p.synchronize();
    CHECK(p.properties().release_threshold == 0);
    CHECK(p.statistics().reserved_current == 0);
  }

  // trim_to, and the release threshold applied at a synchronization point, unmap and release
  // physical memory, on a thread that may never have made a CUDA call (which the driver
  // allows): the memory must really go back, or the pool reuses addresses still mapped.
  TEST_CASE("memory trimmed from a thread with no current context is given back to the driver") {
    pool p(pool_properties{.release_threshold = SIZE_MAX});
    stream s(0);
    p.deallocate(p.allocate(MiB, s), s);
    (void)s.synchronize();
    REQUIRE(p.statistics().reserved_current == 64 * MiB);
    const auto before = fake_live();
    std::thread([&] { p.trim_to(0); }).join();
    CHECK(p.statistics().reserved_current == 0);
    // The driver agrees: the chunk is unmapped and its memory released.
    CHECK(fake_live().mappings == before.mappings - 1);
    CHECK(fake_live().physicals == before.physicals - 1);
    // Its addresses are free again for the pool, which maps there next.
    void* q = nullptr;
    CHECK_NOTHROW(q = p.allocate(MiB, s));
    if (q != nullptr) p.deallocate(q, s);
  }
}
