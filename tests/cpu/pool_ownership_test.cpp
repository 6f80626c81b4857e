// The public pool against the fake driver: which pool a pointer and a caller use, and what
// happens when a pool goes away. The default and current pools and finding a pointer's pool; a
// pool moved with its identity (refs, resources, buffers, the current pool and the directory
// follow it); a closed pool refusing every use, and the buffers and current-pool settings that
// outlive it; the resources' frees, which may not throw, sending a bad free to the bad-free
// handler, whose default names it and aborts. The core uses are in pool_test.cpp; what the files
// share in pool_support.hpp.

#include <streamalloc/pool.hpp>
#include <streamalloc/resource.hpp>
#include <streamalloc/stream.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <doctest/doctest.h>

#include "bad_free_recorder.hpp"
#include "fake_driver.hpp"
#include "pool_support.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <memory_resource>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// Using a closed pool is the caller's mistake, not the device's: code that catches logic_error
// for such mistakes catches this one too.
static_assert(std::is_base_of_v<std::logic_error, pool_closed>);

TEST_SUITE("pool") {
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

  TEST_CASE("a pool moves with its identity: refs, resources, buffers, the current pool and the directory follow it") {
    stream s(0);
    pool p;
    void* a = p.allocate(4096, s);
    const pool_ref r = p;
    device_resource mr(p);
    void* m = mr.allocate_async(8192, 256, s);
    std::optional<stream_buffer<int>> buf;
    buf.emplace(1000, s, p);
    set_current_pool(0, p);

    pool q = std::move(p);
    // The moved-from pool is closed and says why; it still answers closed() and owns().
    CHECK(p.closed());  // NOLINT(bugprone-use-after-move): what a moved-from pool does is the point
    CHECK_FALSE(p.owns(a));
    CHECK_THROWS_WITH_AS((void)p.allocate(256, s), doctest::Contains("allocate: the pool was moved from"), pool_closed);
    CHECK_THROWS_WITH_AS((void)p.location(), doctest::Contains("location: the pool was moved from"), pool_closed);
    CHECK(p.close().live_allocations == 0);  // nothing to close
    // Nothing new can be made over it: each says so instead of holding a null state.
    CHECK_THROWS_WITH_AS(device_resource{p}, doctest::Contains("the pool was moved from"), pool_closed);
    CHECK_THROWS_WITH_AS((stream_buffer<int>(10, s, p)), doctest::Contains("the pool was moved from"), pool_closed);
    // Everything made from it names q now.
    CHECK(r == pool_ref(q));
    CHECK(mr.pool() == pool_ref(q));
    CHECK(buf->pool() == pool_ref(q));
    CHECK(current_pool(0) == pool_ref(q));
    const auto found = find_pool(a);
    REQUIRE(found.has_value());
    CHECK(*found == pool_ref(q));
    CHECK(q.owns(a));
    CHECK(q.statistics().live_allocations == 3);
    // And works through each of them.
    r.deallocate(a, s);
    mr.deallocate_async(m, 8192, 256, s);
    buf->resize(5000);
    buf.reset();
    void* b = streamalloc::allocate(512, s);  // the current pool: q
    CHECK(q.owns(b));
    streamalloc::deallocate(b, s);
    CHECK(q.statistics().live_allocations == 0);

    // Pools in a vector survive its reallocations.
    std::vector<pool> pools;
    std::vector<void*> ptrs;
    for (int i = 0; i < 9; ++i) {
      pools.emplace_back();
      ptrs.push_back(pools.back().allocate(1024, s));
    }
    for (std::size_t i = 0; i < pools.size(); ++i) {
      CHECK(find_pool(ptrs[i]) == pool_ref(pools[i]));
      pools[i].deallocate(ptrs[i], s);
      CHECK(pools[i].statistics().live_allocations == 0);
    }

    // Move assignment closes what the target held (as its destructor would), then takes over.
    pool other;
    void* c = other.allocate(256, s);
    q = std::move(other);
    CHECK(q.owns(c));
    CHECK_FALSE(current_pool(0) == pool_ref(q));  // the old q was current; closing it reset that
    CHECK(current_pool(0) == default_pool(0));
    q.deallocate(c, s);
    CHECK(q.close().live_allocations == 0);
  }

  TEST_CASE("a buffer freed twice (through the pool, then by its destructor) goes to the bad-free handler") {
    pool p;
    stream s(0);
    const bad_free_recorder bad;
    void* data = nullptr;
    {
      stream_buffer<int> b(100, s, p);
      data = b.data();
      p.deallocate(b.data(), s);  // behind the buffer's back
    }
    CHECK(bad.count() == 1);
    CHECK(bad.latest().pointer == data);
    CHECK(bad.latest().operation == "streamalloc::stream_buffer (destroyed or reassigned)");
    CHECK(bad.latest().reason.find("already free") != std::string::npos);
    CHECK(p.statistics().live_allocations == 0);
  }

  TEST_CASE("set_current_pool refuses a closed pool") {
    pool p;
    (void)p.close();
    CHECK_THROWS_WITH_AS(set_current_pool(0, p), doctest::Contains("the pool is closed"), std::invalid_argument);
    CHECK(current_pool(0) == default_pool(0));
  }

  TEST_CASE("a closed pool refuses every use with pool_closed, naming the member") {
    pool p;
    stream s(0);
    void* a = p.allocate(1024, s);
    CHECK_FALSE(p.closed());
    CHECK(p.close().live_allocations == 1);
    CHECK(p.closed());
    CHECK_FALSE(p.owns(a));
    CHECK_THROWS_WITH_AS((void)p.allocate(1024, s), closed_in("allocate"), pool_closed);
    CHECK_THROWS_WITH_AS((void)p.allocate(0, s), closed_in("allocate"), pool_closed);
    CHECK_THROWS_WITH_AS(p.deallocate(a, s), closed_in("deallocate"), pool_closed);
    CHECK_THROWS_WITH_AS(p.deallocate(nullptr, s), closed_in("deallocate"), pool_closed);
    CHECK_THROWS_WITH_AS((void)p.allocate_sync(1024), closed_in("allocate_sync"), pool_closed);
    CHECK_THROWS_WITH_AS(p.deallocate_sync(a), closed_in("deallocate_sync"), pool_closed);
    CHECK_THROWS_WITH_AS((void)p.grow_in_place(a, 4096, s), closed_in("grow_in_place"), pool_closed);
    CHECK_THROWS_WITH_AS((void)p.shrink_in_place(a, 256, s), closed_in("shrink_in_place"), pool_closed);
    CHECK_THROWS_WITH_AS((void)p.statistics(), closed_in("statistics"), pool_closed);
    CHECK_THROWS_WITH_AS(p.reset_high_water(), closed_in("reset_high_water"), pool_closed);
    CHECK_THROWS_WITH_AS(p.trim_to(0), closed_in("trim_to"), pool_closed);
    CHECK_THROWS_WITH_AS((void)p.synchronize(), closed_in("synchronize"), pool_closed);
    CHECK_THROWS_WITH_AS(p.set_release_threshold(SIZE_MAX), closed_in("set_release_threshold"), pool_closed);
    CHECK_THROWS_WITH_AS(p.set_reuse_policy({}), closed_in("set_reuse_policy"), pool_closed);
    CHECK_THROWS_WITH_AS((void)p.granularity(), closed_in("granularity"), pool_closed);
    CHECK_THROWS_WITH_AS((void)p.find_allocation(a), closed_in("find_allocation"), pool_closed);
    // Through a ref and a resource, the same.
    const pool_ref r(p);
    CHECK_THROWS_WITH_AS((void)r.allocate(1024, s), closed_in("allocate"), pool_closed);
    CHECK_THROWS_WITH_AS((void)r.statistics(), closed_in("statistics"), pool_closed);
    device_resource mr(p);
    CHECK_THROWS_WITH_AS((void)mr.allocate(1024, 4096), closed_in("allocate_sync"), pool_closed);
    {
      // A resource's free may not throw: into a closed pool there is nothing left to free.
      const bad_free_recorder bad;
      mr.deallocate(a, 1024, 4096);
      mr.deallocate_async(a, 1024, 256, s);
      CHECK(bad.count() == 0);
    }
    // A refused setter changed nothing; what needs no memory still answers.
    CHECK(p.properties().release_threshold == 0);
    CHECK(p.location() == memory_location::device(0));
    CHECK(p.device() == 0);
    CHECK(p.close().live_allocations == 0);
    // The pool left the directory: its pointers belong to no pool any more.
    CHECK_FALSE(find_pool(a).has_value());
    CHECK_THROWS_WITH_AS(streamalloc::deallocate(a, s), doctest::Contains("belongs to no streamalloc pool"),
                         std::invalid_argument);
  }

  TEST_CASE("a stream_buffer outlives its closed pool: its destruction frees nothing") {
    const auto before = fake_live();
    stream s(0);
    {
      pool p;
      stream_buffer<int> b(1000, s, p);
      stream_buffer<int> moved_from(10, s, p);
      stream_buffer<int> taker(std::move(moved_from));
      CHECK(p.statistics().live_allocations == 2);
      const auto r = p.close();
      CHECK(r.live_allocations == 2);
      CHECK(r.live_bytes == 4096 + 256);
      // Growing needs the pool: refused, the buffer unchanged.
      CHECK_THROWS_AS(b.resize(1 << 20), pool_closed);
      CHECK(b.size() == 1000);
      CHECK(b.data() != nullptr);
    }  // b, taker and moved_from destroyed after the close: no call into the pool
    CHECK(fake_live().mappings == before.mappings);
    CHECK(fake_live().handles == before.handles);
    CHECK(fake_live().used_device0 == before.used_device0);
  }

  TEST_CASE("a pool made current and then destroyed or closed is current no more") {
    stream s(0);
    {
      pool mine;
      set_current_pool(0, mine);
      CHECK(current_pool(0) == pool_ref(mine));
    }
    CHECK(current_pool(0) == default_pool(0));
    void* d = streamalloc::allocate(4096, s);
    REQUIRE(d != nullptr);
    CHECK(default_pool(0).owns(d));
    CHECK(find_pool(d) == default_pool(0));
    streamalloc::deallocate(d, s);
    pool closed;
    set_current_pool(0, closed);
    (void)closed.close();
    CHECK(current_pool(0) == default_pool(0));
    void* e = streamalloc::allocate(4096, s);
    CHECK(default_pool(0).owns(e));
    streamalloc::deallocate(e, s);
    // Another pool made current stays so when an unrelated pool goes.
    pool kept;
    set_current_pool(0, kept);
    { pool other; }
    CHECK(current_pool(0) == pool_ref(kept));
    set_current_pool(0, default_pool(0));
  }

  TEST_CASE("pool_resource: an over-aligned free must be the pointer allocate returned") {
    pool p;
    stream s(0);
    device_resource r(p);
    void* a = r.allocate(1000, 4096);
    REQUIRE(a != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(a) % 4096 == 0);
    char* inside = static_cast<char*>(a) + 512;
    // The resource's frees may not throw: each refusal goes to the bad-free handler.
    const bad_free_recorder bad;
    static_assert(noexcept(r.deallocate(inside, 1000, 4096)) && noexcept(r.deallocate_async(inside, 1000, 4096, s)));
    r.deallocate(inside, 1000, 4096);
    CHECK(bad.count() == 1);
    CHECK(bad.latest().pointer == inside);
    CHECK(bad.latest().owner == pool_ref(p));
    CHECK(bad.latest().operation == "streamalloc::pool_resource::deallocate");
    CHECK(bad.latest().reason.find("with alignment 4096 is not a pointer allocate returned") != std::string::npos);
    r.deallocate_async(inside, 1000, 4096, s);
    CHECK(bad.count() == 2);
    CHECK(bad.latest().operation == "streamalloc::pool_resource::deallocate_async");
    CHECK(bad.latest().reason.find("is not a pointer allocate returned") != std::string::npos);
    // An interior pointer at a multiple of the alignment, as a larger allocation has them.
    void* big = r.allocate(64 * 1024, 4096);
    r.deallocate(static_cast<char*>(big) + 8192, 64 * 1024, 4096);
    CHECK(bad.count() == 3);
    // With an alignment of 256 or less the pool itself refuses interior pointers.
    r.deallocate(inside, 1000, 256);
    CHECK(bad.count() == 4);
    CHECK(bad.latest().reason.find("points inside an allocation") != std::string::npos);
    // The checking form throws the same refusal.
    CHECK_THROWS_WITH_AS(p.deallocate_sync(inside), doctest::Contains("points inside an allocation"),
                         std::invalid_argument);
    CHECK(p.statistics().live_allocations == 2);  // every refusal changed nothing
    r.deallocate(a, 1000, 4096);
    r.deallocate_async(big, 64 * 1024, 4096, s);
    CHECK(p.statistics().live_allocations == 0);
    void* b = r.allocate_async(100, 8192, s);
    CHECK(reinterpret_cast<std::uintptr_t>(b) % 8192 == 0);
    r.deallocate_async(b, 100, 8192, s);
    CHECK(p.statistics().live_allocations == 0);
  }

  TEST_CASE("pmr_resource frees never throw: a refused free goes to the handler, a closed pool's is ignored") {
    pool host_pool(pool_properties{.location = memory_location::host_numa(0)});
    pmr_resource mr{host_resource(host_pool)};
    std::pmr::memory_resource& base = mr;
    const bad_free_recorder bad;
    void* x = base.allocate(1000, 512);
    base.deallocate(static_cast<char*>(x) + 512, 1000, 512);
    CHECK(bad.count() == 1);
    CHECK(bad.latest().pointer == static_cast<char*>(x) + 512);
    base.deallocate(reinterpret_cast<void*>(0x1000), 16, 16);
    CHECK(bad.count() == 2);
    CHECK(bad.latest().reason.find("0x1000") != std::string::npos);
    CHECK(host_pool.statistics().live_allocations == 1);
    base.deallocate(x, 1000, 512);
    CHECK(host_pool.statistics().live_allocations == 0);
    CHECK(bad.count() == 2);
    base.deallocate(x, 1000, 512);  // a double free
    CHECK(bad.count() == 3);
    CHECK(bad.latest().owner == pool_ref(host_pool));
    CHECK(bad.latest().operation == "streamalloc::pmr_resource::deallocate");
    {
      std::pmr::vector<int> v(&mr);
      v.reserve(1000);  // no elements: the fake driver's addresses hold no memory
      CHECK(host_pool.statistics().live_allocations == 1);
      CHECK(host_pool.close().live_allocations == 1);
    }  // v frees into the closed pool: nothing happens
    CHECK(host_pool.closed());
  }

  TEST_CASE("the default bad-free handler names the pointer, the pool and the reason, then aborts") {
    pool p;
    device_resource r(p);
    void* a = r.allocate(1000);
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    const pid_t child = ::fork();
    REQUIRE(child >= 0);
    if (child == 0) {  // only what the free does runs here: it must not return
      ::dup2(fds[1], STDERR_FILENO);
      r.deallocate(static_cast<char*>(a) + 256, 1000);
      ::_exit(0);
    }
    ::close(fds[1]);
    std::string said;
    char buf[512];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) said.append(buf, static_cast<std::size_t>(n));
    ::close(fds[0]);
    int status = 0;
    REQUIRE(::waitpid(child, &status, 0) == child);
    // The free never returned (the child exits 0 if it does). Normally the child dies of
    // SIGABRT; under ThreadSanitizer, whose abort in a forked child ends in an exit code, it
    // may exit with a non-zero status instead.
    CHECK((WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0)));
    if (WIFSIGNALED(status)) CHECK(WTERMSIG(status) == SIGABRT);
    char where[32];
    std::snprintf(where, sizeof where, "%p", static_cast<void*>(static_cast<char*>(a) + 256));
    CHECK(said.find("streamalloc::pool_resource::deallocate: bad free of " + std::string(where)) != std::string::npos);
    CHECK(said.find("to the pool on device 0") != std::string::npos);
    CHECK(said.find("points inside an allocation") != std::string::npos);
    r.deallocate(a, 1000);
    CHECK(p.statistics().live_allocations == 0);
  }
}
