// The public pool against the fake driver (tests/fake_driver), its core uses and its limits:
// allocating, reusing and freeing from mapped chunks, the release threshold and trims,
// defragmentation, bad input, what close reports; then the limits: max_size rounded to the
// granularity, sizes above 2^50 refused, properties the device cannot serve, 4,096 pools in one
// process, and what an out_of_memory says when addresses run out. The pool across streams, threads and lifetimes is
// in pool_streams_test.cpp; the current pool, moves, closed pools, resources and bad frees in
// pool_ownership_test.cpp; what the three share in pool_support.hpp.

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"
#include "pool_support.hpp"

#include <cstdint>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

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

  TEST_CASE("a large request is built from whole chunks; the rest of the last one stays free") {
    pool p;
    stream s(0);
    void* a = p.allocate(100 * MiB, s);
    CHECK(p.statistics().chunks == 2);
    CHECK(p.statistics().reserved_current == 128 * MiB);
    CHECK(fake_live().mappings == 2);
    void* b = p.allocate(28 * MiB, s);  // the last chunk's rest, right after it: no growth
    CHECK(static_cast<char*>(b) == static_cast<char*>(a) + 100 * MiB);
    CHECK(p.statistics().reserved_current == 128 * MiB);
    p.deallocate(b, s);
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

  TEST_CASE("max_size is rounded down to the granularity: the pool never holds more") {
    REQUIRE(allocation_granularity(memory_location::device(0)) == 2 * MiB);
    pool p(pool_properties{.max_size = 3 * MiB});
    CHECK(p.properties().max_size == 2 * MiB);
    stream s(0);
    CHECK_THROWS_WITH_AS((void)p.allocate(3 * MiB + 256, s), doctest::Contains("of at most 2097152"), out_of_memory);
    CHECK(p.statistics().reserved_current == 0);
    void* a = p.allocate(2 * MiB, s);
    REQUIRE(a != nullptr);
    CHECK_THROWS_AS((void)p.allocate(256, s), out_of_memory);
    CHECK(p.statistics().reserved_current == 2 * MiB);
    CHECK(p.statistics().reserved_high == 2 * MiB);
    p.deallocate(a, s);
    // A multiple of the granularity is kept as given.
    CHECK(pool(pool_properties{.max_size = 4 * MiB}).properties().max_size == 4 * MiB);
  }

  TEST_CASE("sizes near SIZE_MAX or 2^62 are refused up front, naming the property") {
    const std::size_t huge[] = {SIZE_MAX, SIZE_MAX - 2 * MiB + 1, std::size_t{1} << 62,
                                (std::size_t{1} << 50) + 2 * MiB};
    for (const std::size_t v : huge) {
      CAPTURE(v);
      // Appended piecewise: g++ 12 at -O2 warns (-Wrestrict) on `" " + std::to_string(v)`.
      std::string value(1, ' ');
      value += std::to_string(v);
      value += " is above 2^50 bytes";
      CHECK_THROWS_WITH_AS(pool(pool_properties{.max_size = v}),
                           doctest::Contains(("pool_properties::max_size" + value).c_str()), std::invalid_argument);
      CHECK_THROWS_WITH_AS(pool(pool_properties{.address_space = v}),
                           doctest::Contains(("pool_properties::address_space" + value).c_str()),
                           std::invalid_argument);
      CHECK_THROWS_WITH_AS(pool(pool_properties{.chunk_size = v}),
                           doctest::Contains(("pool_properties::chunk_size" + value).c_str()), std::invalid_argument);
      CHECK(contains(message_of([&] { pool q(pool_properties{.max_size = v}); }),
                     "no device address space is that large"));
    }
    // A large but possible limit: four times it is reserved, computed without overflow.
    pool big(pool_properties{.max_size = std::size_t{1} << 40});
    CHECK(big.properties().max_size == std::size_t{1} << 40);
    // A device reporting absurd memory: the default addresses are capped at 2^50 bytes rather
    // than overflowing to 0 (and reserved as needed, 8 GiB first).
    {
      const fake_knob memory("FAKE_CUDA_DEVICE_MEMORY", std::to_string(std::size_t{1} << 62).c_str());
      const pool absurd;
      CHECK(absurd.properties().address_space == std::size_t{1} << 50);
    }
  }

  TEST_CASE("properties the device cannot serve are refused when the pool is made") {
    // Handle-type bits streamalloc does not know (2: a Windows handle).
    CHECK_THROWS_WITH_AS(pool(pool_properties{.handle_types = static_cast<shareable_handle_type>(2)}),
                         doctest::Contains("pool_properties::handle_types 2 has bits no shareable_handle_type names"),
                         std::invalid_argument);
    const auto fd_and_unknown = shareable_handle_type::posix_fd | static_cast<shareable_handle_type>(16);
    CHECK_THROWS_AS(pool(pool_properties{.handle_types = fd_and_unknown}), std::invalid_argument);
    const pool_properties host_fd{.location = memory_location::host_numa(0),
                                  .handle_types = shareable_handle_type::posix_fd};
    const auto before = fake_live();
    {
      const fake_knob no_fd("FAKE_CUDA_NO_POSIX_FD", "1");
      // A device pool: the device's attributes say no.
      CHECK_THROWS_AS(pool(pool_properties{.handle_types = shareable_handle_type::posix_fd}), not_supported);
      // A host pool: only creating memory tells (the driver refuses cuMemCreate); the probe
      // finds it, and that the location alone works, so it blames the handle types.
      try {
        pool p(host_fd);
        FAIL("the pool was made");
      } catch (const not_supported&) {
        FAIL("not a capability the attributes report");
      } catch (const cuda_error& e) {
        CHECK(e.code() == CUDA_ERROR_INVALID_VALUE);
        CHECK(e.call() == "cuMemCreate");
        CHECK(contains(e.what(), "the driver refused pool_properties::handle_types (posix_fd) on host NUMA node 0"));
      }
    }
    CHECK(fake_live().handles == before.handles);  // the probes were released
    CHECK(fake_live().reservations == before.reservations);
    // The same properties with the handle type the device has: made, the probe released.
    {
      pool p(host_fd);
      CHECK(p.statistics().reserved_current == 0);
      CHECK(fake_live().handles == before.handles);
    }
    // A lack of memory is no fault of the properties: the pool is made, allocations fail.
    {
      const fake_knob tiny("FAKE_CUDA_DEVICE_MEMORY", "1048576");
      pool p(pool_properties{.max_size = 2 * MiB});
      stream s(0);
      CHECK_THROWS_AS((void)p.allocate(1024, s), out_of_memory);
    }
  }

  TEST_CASE("4,096 pools in one process, each growing a buffer in place; every pointer finds its pool") {
    const fake_knob memory("FAKE_CUDA_DEVICE_MEMORY", std::to_string(std::size_t{64} << 30).c_str());
    stream s(0);
    std::vector<std::unique_ptr<pool>> pools;
    std::vector<void*> bufs;
    for (int i = 0; i < 4096; ++i) {
      pools.push_back(std::make_unique<pool>(pool_properties{.chunk_size = 2 * MiB}));
      void* b = pools.back()->allocate(MiB, s);
      REQUIRE(pools.back()->grow_in_place(b, 4 * MiB, s) == 4 * MiB);
      bufs.push_back(b);
    }
    for (std::size_t i = 0; i < pools.size(); i += 97) {
      const auto found = find_pool(static_cast<char*>(bufs[i]) + 3 * MiB);
      REQUIRE(found.has_value());
      CHECK(found->owns(bufs[i]));
      CHECK(*found == pool_ref(*pools[i]));
    }
    for (std::size_t i = 0; i < pools.size(); ++i) pools[i]->deallocate(bufs[i], s);
  }

  TEST_CASE("an out_of_memory caused by the process running out of addresses says so") {
    const fake_knob memory("FAKE_CUDA_DEVICE_MEMORY", std::to_string(std::size_t{64} << 30).c_str());
    stream s(0);
    pool p;
    const fake_knob space("FAKE_CUDA_ADDRESS_SPACE", "1");  // from now on, nothing more is reserved
    const std::string m = message_of([&] { (void)p.allocate(std::size_t{16} << 30, s); });
    CHECK(contains(m, "the process's virtual addresses ran out: the driver refused to reserve"));
    CHECK(contains(m, "which holds 8589934592 bytes of addresses"));
    CHECK_THROWS_AS((void)p.allocate(std::size_t{16} << 30, s), out_of_memory);
  }

  TEST_CASE("an out_of_memory caused by used-up addresses says so") {
    stream s(0);
    {
      // Smaller than one 64 MiB chunk: the pool can never grow.
      pool p(pool_properties{.address_space = 8 * MiB});
      CHECK_THROWS_WITH_AS((void)p.allocate(1024, s), doctest::Contains("raise pool_properties::address_space"),
                           out_of_memory);
      CHECK(contains(message_of([&] { (void)p.allocate(1024, s); }),
                     "may reserve 8388608 bytes of addresses, 0 of them mapped, and growing for this request needs "
                     "67108864"));
    }
    {
      // Large requests each take their own addresses: the second does not fit.
      pool p(pool_properties{.address_space = 128 * MiB});
      void* a = p.allocate(100 * MiB, s);
      CHECK_THROWS_WITH_AS((void)p.allocate(100 * MiB, s), doctest::Contains("the pool's addresses are used up"),
                           out_of_memory);
      p.deallocate(a, s);
    }
    {
      // At its maximum size with addresses to spare: the addresses are not blamed.
      pool p(pool_properties{.max_size = 64 * MiB});
      void* a = p.allocate(60 * MiB, s);
      const std::string m = message_of([&] { (void)p.allocate(8 * MiB, s); });
      CHECK(contains(m, "of at most 67108864"));
      CHECK_FALSE(contains(m, "address"));
      p.deallocate(a, s);
    }
  }
}
