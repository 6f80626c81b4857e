// The public pool, streams and events against the fake driver (tests/fake_driver): everything
// but the device's own work, on any machine. The fake device runs work at once, so every event
// is complete when queried. The GPU tests check the same API on real memory.

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <atomic>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace streamalloc;
using streamalloc_test::fake_live;

namespace {
constexpr std::size_t MiB = std::size_t{1} << 20;
}

TEST_SUITE("pool") {
  TEST_CASE("allocate, reuse on the stream, free; memory comes from mapped chunks") {
    pool p;
    stream s(0);
    void* a = p.allocate(1000, s);
    REQUIRE(a != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(a) % 256 == 0);
    CHECK(p.owns(a));
    CHECK(fake_live().mappings == 1);  // one 64 MiB chunk
    CHECK(fake_live().used_device0 == 64 * MiB);
    p.deallocate(a, s);
    CHECK(p.allocate(1000, s) == a);
    CHECK(p.allocate(0, s) == nullptr);
    CHECK_NOTHROW(p.deallocate(nullptr, s));
  }

  TEST_CASE("a large request gets a chunk of its own") {
    pool p;
    stream s(0);
    void* a = p.allocate(100 * MiB, s);
    CHECK(p.statistics().chunks == 1);
    CHECK(p.statistics().reserved_current == 100 * MiB);
    p.deallocate(a, s);
  }

  TEST_CASE("synchronization points apply the release threshold; trim_to gives memory back") {
    const auto base = fake_live().used_device0;
    {
      pool p;  // threshold 0
      stream s(0);
      void* a = p.allocate(10 * MiB, s);
      p.deallocate(a, s);
      CHECK(p.statistics().reserved_current == 64 * MiB);
      s.synchronize();
      CHECK(p.statistics().reserved_current == 0);
      CHECK(fake_live().used_device0 == base);
    }
    {
      pool_properties props;
      props.release_threshold = SIZE_MAX;
      pool p(props);
      stream s(0);
      p.deallocate(p.allocate(10 * MiB, s), s);
      s.synchronize();
      CHECK(p.statistics().reserved_current == 64 * MiB);
      p.trim_to(0);
      CHECK(p.statistics().reserved_current == 0);
      CHECK(fake_live().used_device0 == base);
    }
  }

  TEST_CASE("pool::synchronize applies the release threshold") {
    pool p;
    stream s(0);
    p.deallocate(p.allocate(10 * MiB, s), s);
    CHECK(p.statistics().reserved_current == 64 * MiB);
    p.synchronize();
    CHECK(p.statistics().reserved_current == 0);
  }

  TEST_CASE("defragmentation remaps free chunks instead of growing") {
    pool_properties props;
    props.chunk_size = 2 * MiB;
    props.max_size = 8 * MiB;
    props.release_threshold = SIZE_MAX;
    pool p(props);
    stream s(0);
    std::vector<void*> x;
    for (int i = 0; i < 4; ++i) x.push_back(p.allocate(2 * MiB, s));
    p.deallocate(x[0], s);
    p.deallocate(x[2], s);
    s.synchronize();
    void* y = p.allocate(4 * MiB, s);
    CHECK(y != nullptr);
    CHECK(p.statistics().reserved_current == 8 * MiB);
    CHECK(p.statistics().remapped_chunks >= 1);  // 1 when a hole has room after it, else 2
  }

  TEST_CASE("limits and bad input") {
    pool_properties props;
    props.max_size = 64 * MiB;
    pool p(props);
    stream s(0);
    void* a = p.allocate(60 * MiB, s);
    CHECK_THROWS_AS((void)p.allocate(8 * MiB, s), out_of_memory);
    CHECK_THROWS_AS((void)p.allocate(std::size_t{1} << 63, s), std::bad_alloc);
    CHECK_THROWS_AS(p.deallocate(reinterpret_cast<void*>(0x1000), s), std::invalid_argument);
    CHECK_THROWS_AS(p.deallocate(static_cast<char*>(a) + 256, s), std::invalid_argument);
    p.deallocate(a, s);
    CHECK_THROWS_AS(p.deallocate(a, s), std::invalid_argument);
    // Properties that cannot work are refused up front.
    CHECK_THROWS_AS(pool(pool_properties{.chunk_size = 3 * MiB}), std::invalid_argument);
    CHECK_THROWS_AS(pool(pool_properties{.location = memory_location::device(5)}), std::invalid_argument);
    CHECK_THROWS_AS(pool(pool_properties{.max_size = 4096}), std::invalid_argument);
  }

  TEST_CASE("close reports live allocations and releases everything") {
    const auto before = fake_live();
    pool p;
    stream s(0);
    (void)p.allocate(5 * MiB, s);
    (void)p.allocate(1 * MiB, s);
    const auto r = p.close();
    CHECK(r.live_allocations == 2);
    CHECK(r.live_bytes == 6 * MiB);
    CHECK(fake_live().mappings == before.mappings);
    CHECK(fake_live().used_device0 == before.used_device0);
  }

  TEST_CASE("follow_event_dependencies through streamalloc's events") {
    pool_properties props;
    props.chunk_size = 2 * MiB;
    props.release_threshold = SIZE_MAX;
    props.reuse = {true, false, false};  // the fake device completes at once: opportunistic off
    pool p(props);
    stream a(0), b(0);
    void* x = p.allocate(2 * MiB, a);
    p.deallocate(x, a);
    void* y = p.allocate(2 * MiB, b);  // no proof yet
    CHECK(y != x);
    event e;
    e.record(a);
    b.wait(e);
    CHECK(p.allocate(2 * MiB, b) == x);
  }

  TEST_CASE("threads on their own streams, and on one shared stream") {
    pool p;
    std::vector<stream> streams;
    for (int i = 0; i < 8; ++i) streams.emplace_back(0);
    stream shared(0);
    std::atomic<int> wrong{0};
    std::vector<std::thread> ts;
    for (int t = 0; t < 8; ++t) {
      ts.emplace_back([&, t] {
        std::vector<void*> mine;
        for (int i = 0; i < 20000; ++i) {
          stream_ref s = (i % 5 == 0) ? stream_ref(shared) : stream_ref(streams[t]);
          mine.push_back(p.allocate(256 * ((i % 37) + 1), s));
          if (mine.size() > 8) {
            p.deallocate(mine.front(), s);
            mine.erase(mine.begin());
          }
        }
        for (void* x : mine) p.deallocate(x, shared);
        if (p.statistics().live_allocations > 8 * 9) ++wrong;
      });
    }
    for (auto& t : ts) t.join();
    CHECK(wrong == 0);
    CHECK(p.statistics().live_allocations == 0);
    CHECK(p.statistics().used_current == 0);
  }

  TEST_CASE("default and current pools, and finding a pointer's pool") {
    CHECK(default_pool(0) == default_pool(0));
    stream s(0);
    void* d = streamalloc::allocate(4096, s);
    CHECK(find_pool(d) == default_pool(0));
    streamalloc::deallocate(d, s);
    pool mine;
    set_current_pool(0, mine);
    void* m = streamalloc::allocate(4096, s);
    CHECK(mine.owns(m));
    streamalloc::deallocate(m, s);
    set_current_pool(0, default_pool(0));
    CHECK_THROWS_AS(streamalloc::deallocate(reinterpret_cast<void*>(0x1000), s), std::invalid_argument);
  }

  TEST_CASE("streams and events are released; a destroyed stream is let go of") {
    const auto before = fake_live();
    {
      pool p;
      stream s(0);
      event e;
      e.record(s);
      void* x = p.allocate(4096, s);
      p.deallocate(x, s);
    }
    CHECK(fake_live().streams == before.streams);
    CHECK(fake_live().events == before.events);
  }
}

TEST_SUITE("pool_two_devices") {
  TEST_CASE("a stream of another device cannot allocate from a device's pool") {
    pool p0(pool_properties{.location = memory_location::device(0)});
    stream s1(1);
    CHECK(s1.ref().device() == 1);
    CHECK_THROWS_WITH_AS((void)p0.allocate(1024, s1), doctest::Contains("belongs to device 1"), std::invalid_argument);
    CHECK(p0.statistics().live_allocations == 0);
    // The device's own pool takes it; the free may be on any stream.
    void* q = current_pool(1).allocate(1024, s1);
    stream s0(0);
    CHECK_THROWS_AS((void)p0.allocate(1024, s1), std::invalid_argument);
    current_pool(1).deallocate(q, s1);
    void* r = p0.allocate(1024, s0);
    CHECK(r != nullptr);
    p0.deallocate(r, s0);
  }
}
