// Lifetimes and pools: a pool destroyed, closed or replaced as the current pool, and memory
// given back (released, remapped) or taken by growth (grow_in_place, stream_buffer::resize),
// while a kernel ordered before a free still runs: the kernel neither faults nor loses its
// memory, and a closed pool refuses further use with a std::logic_error rather than crash.
//
// Each case is a child process (child_process.hpp) checked with lifetime_checks.cuh, whose
// opening comment describes the technique.

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <doctest/doctest.h>

#include "child_process.hpp"
#include "gpu_kernels.cuh"
#include "gpu_support.hpp"
#include "lifetime_checks.cuh"

#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {

// A pool destroyed (or closed) while a kernel ordered before its last free still runs: it must
// wait before unmapping, so the kernel neither faults nor loses its memory. Also with the free
// never made, with the stream destroyed before the pool, and for a host pool.
CHILD_CASE(pool_destroyed_pending_free) {
  const std::size_t bytes = 8 * MiB;
  for (const config& cfg : configs(bytes)) {
    note("pool: %s", cfg.name);
    device_counters c(4);
    stream s(0);
    {  // the destructor, a free pending
      std::optional<long_use> u;
      void* x = nullptr;
      {
        pool p(cfg.props);
        x = p.allocate(bytes, s);
        u.emplace(start_long_use(x, bytes, 400, s.get(), c.slot(0)));
        p.deallocate(x, s);
      }
      // A pool may release later (after the device finished) rather than wait in its destructor,
      // so a kernel still running here is not by itself the bug; unmapped memory makes it fault.
      note("kernel still running after the pool's destructor returned: %s", u->running() ? "yes" : "no");
      expect_device_ok(1, "destroying a pool whose free was pending behind a running kernel");
      expect_completed(*u, 2, "the kernel over a destroyed pool's memory");  // 2, 3
      CHILD_EXPECT(!find_pool(x), 4, "a destroyed pool still answers for its addresses");
    }
    {  // close(), a free pending
      pool p(cfg.props);
      void* x = p.allocate(bytes, s);
      const long_use u = start_long_use(x, bytes, 410, s.get(), c.slot(1));
      p.deallocate(x, s);
      const pool_close_report r = p.close();
      CHILD_EXPECT(r.live_allocations == 0 && r.live_bytes == 0, 5, "close() reports an allocation that was freed");
      expect_device_ok(6, "closing a pool whose free was pending behind a running kernel");
      expect_completed(u, 7, "the kernel over a closed pool's memory");  // 7, 8
    }
    {  // the destructor, the allocation never freed (reported on stderr)
      std::optional<long_use> u;
      {
        pool p(cfg.props);
        void* x = p.allocate(bytes, s);
        u.emplace(start_long_use(x, bytes, 420, s.get(), c.slot(2)));
      }
      expect_device_ok(9, "destroying a pool with a live allocation a kernel still uses");
      expect_completed(*u, 10, "the kernel over a leaked allocation");  // 10, 11
    }
    {  // the kernel's stream destroyed before the pool (declared after it)
      std::optional<long_use> u;
      {
        pool p(cfg.props);
        stream mine(0);
        void* x = p.allocate(bytes, mine);
        u.emplace(start_long_use(x, bytes, 430, mine.get(), c.slot(3)));
        p.deallocate(x, mine);
      }
      expect_device_ok(12, "destroying the stream, then the pool, while the kernel ran");
      expect_completed(*u, 13, "the kernel of a destroyed stream over a destroyed pool");  // 13, 14
    }
  }

  const device_capabilities caps = query_capabilities(0);
  if (!caps.host_numa_memory) {
    note("host pool skipped: device 0 cannot map host NUMA memory through VMM");
    return;
  }
  const memory_location where = memory_location::host_numa(caps.host_numa_id < 0 ? 0 : caps.host_numa_id);
  note("pool: host memory, %s", where.to_string().c_str());
  device_counters c(2);
  stream s(0);
  {
    std::optional<long_use> u;
    {
      pool p(pool_properties{.location = where});
      void* x = p.allocate(bytes, s);
      u.emplace(start_long_use(x, bytes, 440, s.get(), c.slot(0)));
      p.deallocate(x, s);
    }
    expect_device_ok(15, "destroying a host pool whose free was pending behind a running kernel");
    expect_completed(*u, 16, "the kernel over a destroyed host pool's memory");  // 16, 17
  }
  {
    pool p(pool_properties{.location = where});
    void* x = p.allocate(bytes, s);
    const long_use u = start_long_use(x, bytes, 450, s.get(), c.slot(1));
    p.deallocate(x, s);
    (void)p.close();
    expect_device_ok(18, "closing a host pool whose free was pending behind a running kernel");
    expect_completed(u, 19, "the kernel over a closed host pool's memory");  // 19, 20
  }
}

// A closed pool refuses every use that needs its memory with a std::logic_error (the
// pool_closed class derives from it), never a crash; a stream_buffer outliving its pool's close
// is destroyed quietly.
CHILD_CASE(use_after_close) {
  const std::size_t n = 1 * MiB;  // elements
  const std::size_t bytes = n * sizeof(std::uint32_t);
  stream s(0);
  device_counters c(1);
  pool p;
  {
    stream_buffer<std::uint32_t> buf(n, s, p);
    void* raw = p.allocate(bytes, s);  // live too when the pool closes
    const long_use u = start_long_use(buf.data(), bytes, 500, s.get(), c.slot(0));
    const pool_close_report r = p.close();  // both allocations live, the kernel running
    CHILD_EXPECT(r.live_allocations == 2 && r.live_bytes == 2 * bytes, 1,
              strf("close() reported %zu allocations, %zu bytes", r.live_allocations, r.live_bytes));
    expect_device_ok(2, "closing a pool with live allocations under a running kernel");
    expect_completed(u, 3, "the kernel over a closed pool's buffer");  // 3, 4

    expect_throws_logic_error(5, "allocate on a closed pool", [&] { (void)p.allocate(bytes, s); });
    expect_throws_logic_error(6, "deallocate on a closed pool", [&] { p.deallocate(raw, s); });
    expect_throws_logic_error(7, "statistics on a closed pool", [&] { (void)p.statistics(); });
    expect_throws_logic_error(8, "allocate_sync on a closed pool", [&] { (void)p.allocate_sync(bytes); });
    expect_throws_logic_error(9, "deallocate_sync on a closed pool", [&] { p.deallocate_sync(raw); });
    expect_throws_logic_error(10, "grow_in_place on a closed pool", [&] { (void)p.grow_in_place(raw, 2 * bytes, s); });
    expect_throws_logic_error(11, "shrink_in_place on a closed pool", [&] { (void)p.shrink_in_place(raw, 256, s); });
    expect_throws_logic_error(12, "allocate through a pool_ref", [&] { (void)pool_ref(p).allocate(bytes, s); });
    CHILD_EXPECT(!p.owns(raw), 13, "a closed pool still owns its addresses");
    CHILD_EXPECT(!find_pool(buf.data()), 14, "find_pool still finds a closed pool");
    expect_throws_logic_error(15, "stream_buffer::resize on a closed pool", [&] { (void)buf.resize(2 * n); });
    // Calls that may either do nothing or throw: only a crash is wrong.
    const auto survives = [](const char* call, auto&& f) {
      std::fprintf(stderr, "  calling %s\n", call);
      try {
        f();
      } catch (const std::logic_error& e) {
        note("%s threw: %s", call, e.what());
      }
    };
    survives("trim_to on a closed pool", [&] { p.trim_to(0); });
    survives("reset_high_water on a closed pool", [&] { p.reset_high_water(); });
    survives("set_release_threshold on a closed pool", [&] { p.set_release_threshold(0); });
    survives("set_reuse_policy on a closed pool", [&] { p.set_reuse_policy({}); });
    survives("find_allocation on a closed pool", [&] { (void)p.find_allocation(raw); });
    const pool_close_report again = p.close();
    CHILD_EXPECT(again.live_allocations == 0, 16, "a second close() reports allocations again");
    std::fprintf(stderr, "  destroying a stream_buffer of the closed pool\n");
  }  // the buffer frees into the closed pool: it must not crash
  note("the stream_buffer was destroyed after its pool closed without crashing");

  pool fresh;  // other pools are unaffected
  void* y = fresh.allocate(bytes, s);
  fill_async(y, bytes, 510, s.get());
  CHILD_LAUNCHED("fill_async");
  CHILD_EXPECT(mismatches_on(y, bytes, 510, s.get()) == 0, 17, "a new pool after a closed one does not work");
  fresh.deallocate(y, s);
  s.synchronize();
}

// A pool set as a device's current pool, then destroyed or closed: the device must fall back
// to its default pool, and streamalloc::allocate must give working memory from it.
CHILD_CASE(current_pool_destroyed) {
  const std::size_t bytes = 4 * MiB;
  stream s(0);
  device_counters c(1);
  {
    pool p;
    set_current_pool(0, p);
    CHILD_EXPECT(current_pool(0) == pool_ref(p), 1, "set_current_pool did not take");
    void* a = streamalloc::allocate(bytes, s);
    CHILD_EXPECT(p.owns(a), 2, "streamalloc::allocate did not use the current pool");
    streamalloc::deallocate(a, s);
  }
  // The slot was cleared (a ref to the destroyed pool would not do: the default pool's state,
  // made later, may reuse its address).
  CHILD_EXPECT(detail::current_pools()[0].load() == nullptr, 3, "the current pool is still the destroyed one");
  CHILD_EXPECT(current_pool(0) == default_pool(0), 4, "the current pool is not the default after the destroy");
  void* y = streamalloc::allocate(bytes, s);
  CHILD_EXPECT(y != nullptr && default_pool(0).owns(y), 5, "streamalloc::allocate does not use the default pool");
  fill_async(y, bytes, 520, s.get());
  CHILD_LAUNCHED("fill_async");
  CHILD_EXPECT(mismatches_on(y, bytes, 520, s.get()) == 0, 6,
               "memory from the fallback pool does not hold what a kernel wrote");
  streamalloc::deallocate(y, s);
  {
    stream_buffer<std::uint32_t> b(bytes / 4, s);  // from the current pool
    fill_async(b.data(), bytes, 521, s.get());
    CHILD_LAUNCHED("fill_async");
    CHILD_EXPECT(mismatches_on(b.data(), bytes, 521, s.get()) == 0, 7, "a stream_buffer from the fallback pool");
  }

  {  // close() instead of the destructor
    pool q;
    set_current_pool(0, q);
    (void)q.close();
    CHILD_EXPECT(!(current_pool(0) == pool_ref(q)), 8, "the current pool is still the closed one");
    void* z = streamalloc::allocate(bytes, s);
    fill_async(z, bytes, 530, s.get());
    CHILD_LAUNCHED("fill_async");
    CHILD_EXPECT(mismatches_on(z, bytes, 530, s.get()) == 0, 9, "allocating after the current pool closed");
    streamalloc::deallocate(z, s);
  }

  {  // destroyed with a free pending behind a kernel, then allocation through the fallback
    stream t(0);
    std::optional<long_use> u;
    {
      pool r;
      set_current_pool(0, r);
      void* x = streamalloc::allocate(bytes, s);
      u.emplace(start_long_use(x, bytes, 540, s.get(), c.slot(0)));
      streamalloc::deallocate(x, s);
    }
    void* w = streamalloc::allocate(bytes, t);
    expect_not_reused_while_running(w, bytes, *u, 10, "the default pool after the current pool was destroyed");
    const owner o = fill_new(w, bytes, 550, t.get());
    expect_device_ok(11, "destroying the current pool under a running kernel");
    expect_completed(*u, 12, "the kernel over the destroyed current pool's memory");  // 12, 13
    expect_intact(o, 14, "memory from the fallback pool");
    streamalloc::deallocate(w, t);
    t.synchronize();
  }
  s.synchronize();
}

// Everything that gives memory back (synchronization points with release threshold 0, trim_to,
// lowering the threshold) while a free is pending behind a kernel: the pending block's memory
// stays mapped until the kernel has finished.
CHILD_CASE(release_while_running) {
  const std::size_t bytes = 8 * MiB;
  for (const config& cfg : configs(bytes)) {
    note("pool: %s, release threshold 0", cfg.name);
    pool_properties props = cfg.props;
    props.release_threshold = 0;
    pool p(props);
    stream s(0), t(0), idle(0);
    device_counters c(1);
    void* x = p.allocate(bytes, s);
    const long_use u = start_long_use(x, bytes, 1200, s.get(), c.slot(0));
    p.deallocate(x, s);
    void* w = p.allocate(bytes, t);
    p.deallocate(w, t);
    t.synchronize();  // a synchronization point: the threshold applies
    (void)t.query();
    idle.synchronize();
    p.trim_to(0);
    p.set_release_threshold(0);
    p.trim_to(0);
    const pool_statistics st = p.statistics();
    note("reserved %zu, free clear %zu, free pending %zu", st.reserved_current, st.free_clear, st.free_pending);
    if (u.running()) {
      CHILD_EXPECT(st.reserved_current >= bytes, 1, "the pending block's memory was given back while its kernel runs");
    }
    expect_device_ok(2, "releasing memory while a free was pending");
    expect_completed(u, 3, "the kernel before the free");  // 3, 4
    (void)p.synchronize();
    p.trim_to(0);
    CHILD_EXPECT(p.statistics().reserved_current == 0, 5, "after a synchronization everything free is given back");
  }
}

// Defragmentation under a running kernel: a compact pool at its maximum size, with two clear
// chunks and one pending behind a kernel. A request that only the pending chunk could complete
// must fail (out_of_memory) rather than remap or take it; smaller ones may remap the clear chunks.
CHILD_CASE(remap_while_running) {
  const std::size_t g = allocation_granularity(memory_location::device(0));
  pool_properties props;
  props.compact = true;
  props.max_size = 4 * g;
  props.release_threshold = SIZE_MAX;
  props.reuse.internal_dependencies = false;  // at the limit: fail rather than wait on the pending free
  pool p(props);
  stream s(0), t(0);
  device_counters c(1);
  void* a = p.allocate(g, s);
  void* b = p.allocate(g, s);
  void* kept = p.allocate(g, s);
  void* d = p.allocate(g, s);
  note("chunks at %p %p %p %p (granularity %zu)", a, b, kept, d, g);
  p.deallocate(b, s);
  p.deallocate(d, s);
  s.synchronize();  // b and d are clear: moving them is allowed
  const long_use u = start_long_use(a, g, 1300, s.get(), c.slot(0));
  p.deallocate(a, s);  // pending: neither reusable on t nor movable
  std::vector<owner> owners;
  const auto attempt = [&](std::size_t n, int code, std::uint32_t seed) {
    void* q = nullptr;
    try {
      q = p.allocate(n, t);
    } catch (const out_of_memory& e) {
      note("%zu bytes on another stream: out_of_memory (%s)", n, e.what());
      return;
    }
    note("%zu bytes on another stream: %p", n, q);
    expect_not_reused_while_running(q, n, u, code, strf("%zu bytes at the pool's limit", n));
    owners.push_back(fill_new(q, n, seed, t.get()));
  };
  attempt(3 * g, 1, 1310);  // needs the pending chunk
  attempt(2 * g, 2, 1320);  // the clear chunks, remapped side by side
  attempt(g, 3, 1330);
  note("chunks remapped: %zu", p.statistics().remapped_chunks);
  expect_device_ok(4, "defragmenting while a kernel used a pending chunk");
  expect_completed(u, 5, "the kernel over the pending chunk");  // 5, 6
  expect_all_intact(owners, 7, "allocations made by defragmenting");
  free_all(p, owners, t);
  p.deallocate(kept, s);
  (void)p.synchronize();
}

// The same with the default properties, whose chunks are 64 MiB and whose larger requests are
// built from several of them: a pool at its limit of six chunks holds a two-chunk block freed
// behind a kernel, live chunks on either side of it (a free absorbs clear neighbours, which
// would make them pending too), and two clear chunks at the ends. A three-chunk request on
// another stream needs the pending chunks and must fail; a two-chunk one remaps the clear
// chunks side by side, elsewhere.
CHILD_CASE(remap_multi_chunk_while_running) {
  const std::size_t chunk = 64 * MiB;  // the default chunk size, named so the limit is exact
  pool_properties props;
  props.chunk_size = chunk;
  props.max_size = 6 * chunk;
  props.release_threshold = SIZE_MAX;
  props.reuse.internal_dependencies = false;  // at the limit: fail rather than wait on the pending free
  pool p(props);
  stream s(0), t(0);
  device_counters c(1);
  void* a = p.allocate(chunk, s);
  void* before = p.allocate(chunk, s);
  void* pending = p.allocate(2 * chunk, s);  // two chunks mapped next to each other
  void* after = p.allocate(chunk, s);
  void* d = p.allocate(chunk, s);
  note("blocks at %p %p %p %p %p", a, before, pending, after, d);
  const auto at = [&](void* x, std::size_t chunks) { return static_cast<char*>(a) + chunks * chunk == x; };
  CHILD_EXPECT(at(before, 1) && at(pending, 2) && at(after, 4) && at(d, 5), 1,
               "the default pool did not pack 64 MiB and 128 MiB requests into one run of six chunks");
  p.deallocate(a, s);
  p.deallocate(d, s);
  s.synchronize();  // a and d are clear, whole chunks apart: moving them is allowed
  const long_use u = start_long_use(pending, 2 * chunk, 1340, s.get(), c.slot(0));
  p.deallocate(pending, s);  // pending: neither reusable on t nor movable
  std::vector<owner> owners;
  bool three_failed = false;
  const auto attempt = [&](std::size_t n, int code, std::uint32_t seed) {
    void* q = nullptr;
    try {
      q = p.allocate(n, t);
    } catch (const out_of_memory& e) {
      note("%zu MiB on another stream: out_of_memory (%s)", n / MiB, e.what());
      if (n == 3 * chunk) three_failed = true;
      return;
    }
    note("%zu MiB on another stream: %p", n / MiB, q);
    expect_not_reused_while_running(q, n, u, code, strf("%zu MiB at the pool's limit", n / MiB));
    owners.push_back(fill_new(q, n, seed, t.get()));
  };
  // Three chunks need the pending ones: handed out while the kernel runs is the bug (the check
  // in `attempt`); after it finished, allowed. Remapping them would fault the kernel (code 7).
  attempt(3 * chunk, 2, 1350);
  attempt(2 * chunk, 3, 1360);  // the clear chunks, remapped side by side
  const std::size_t remapped = p.statistics().remapped_chunks;
  note("chunks remapped: %zu; the kernel %s", remapped, u.running() ? "still runs" : "has finished");
  if (three_failed) {
    CHILD_EXPECT(owners.size() == 1, 5, "two clear chunks did not make a two-chunk block");
    CHILD_EXPECT(remapped >= 1, 6, "two clear chunks apart became one block without a remap");
  }
  expect_device_ok(7, "defragmenting a default pool while a kernel used a pending two-chunk block");
  expect_completed(u, 8, "the kernel over the pending two-chunk block");  // 8, 9
  expect_all_intact(owners, 10, "allocations made by defragmenting");
  free_all(p, owners, t);
  p.deallocate(before, s);
  p.deallocate(after, s);
  (void)p.synchronize();
}

// A large request on the stream of a running kernel, whose frees there are pending behind it:
// the freed chunks are mapped again as one range (aliases) for the request, without the host
// waiting and without growing, while their old addresses stay mapped under the kernel. The
// request's own work, ordered after the kernel, then writes the same memory.
CHILD_CASE(alias_while_running) {
  const std::size_t chunk = 64 * MiB;  // the default chunk size, named so the sizes are exact
  pool_properties props;
  props.chunk_size = chunk;
  props.release_threshold = SIZE_MAX;
  pool p(props);
  stream s(0);
  device_counters c(1);
  void* a = p.allocate(chunk, s);
  void* b = p.allocate(chunk, s);  // live between the two frees: they do not touch
  void* x = p.allocate(chunk, s);
  void* y = p.allocate(chunk, s);
  note("blocks at %p %p %p %p", a, b, x, y);
  const long_use u = start_long_use(a, chunk, 1500, s.get(), c.slot(0));
  p.deallocate(a, s);  // both pending behind the kernel
  p.deallocate(x, s);
  const std::size_t before = p.statistics().reserved_current;
  const auto t0 = std::chrono::steady_clock::now();
  void* q = p.allocate(2 * chunk, s);  // no free 128 MiB range: the two chunks, moved
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const bool still_running = u.running();
  const pool_statistics st = p.statistics();
  note("128 MiB on the kernel's stream: %p in %.2f ms, reserved %zu -> %zu MiB, %zu chunks remapped, the kernel %s",
       q, ms, before / MiB, st.reserved_current / MiB, st.remapped_chunks, still_running ? "still runs" : "has finished");
  CHILD_EXPECT(still_running, 1, "the kernel finished before the request: the case proves nothing (too fast a GPU?)");
  CHILD_EXPECT(ms < 100, 2, "the request waited for the kernel");
  CHILD_EXPECT(st.reserved_current == before && st.remapped_chunks == 2, 3,
               "the stream's own two freed chunks were not mapped again for its request");
  std::vector<owner> owners;
  owners.push_back(fill_new(q, 2 * chunk, 1520, s.get()));  // runs after the kernel, on s
  // The device first: the counters are read with a plain copy, which does not wait for s.
  expect_device_ok(4, "a large request served by chunks aliased under a running kernel");
  expect_completed(u, 5, "the kernel whose frees were aliased");  // 5, 6
  expect_all_intact(owners, 7, "the request's memory");
  free_all(p, owners, s);
  p.deallocate(b, s);
  p.deallocate(y, s);
  (void)p.synchronize();
  CHILD_EXPECT(p.statistics().reserved_current == before, 8, "the aliases changed what the pool holds");
}

// Growing an allocation in place on another stream must not take the pending block behind it.
CHILD_CASE(grow_into_pending) {
  const std::size_t bytes = 4 * MiB;
  for (const config& cfg : configs(bytes)) {
    note("pool: %s", cfg.name);
    pool p(cfg.props);
    stream s(0), t(0);
    device_counters c(1);
    void* y = p.allocate(bytes, t);  // first: a packed pool puts x right after it
    void* x = p.allocate(bytes, s);
    note("y %p, x %p: x is %s y", y, x,
         static_cast<char*>(x) == static_cast<char*>(y) + bytes ? "right after" : "not right after");
    const long_use u = start_long_use(x, bytes, 1400, s.get(), c.slot(0));
    p.deallocate(x, s);
    const std::size_t got = p.grow_in_place(y, 2 * bytes, t);
    note("grow_in_place(y, %zu) on another stream: %zu", 2 * bytes, got);
    if (got != 0) expect_not_reused_while_running(y, got, u, 1, "y grown in place on another stream");
    const owner o = fill_new(y, got != 0 ? 2 * bytes : bytes, 1410, t.get());
    expect_device_ok(2, "growing in place next to a pending block");
    expect_completed(u, 3, "the kernel over the pending block");  // 3, 4
    expect_intact(o, 5, "the grown allocation");
    p.deallocate(y, t);
    t.synchronize();
  }
}

// stream_buffer: destroyed (freed on its stream) while its kernel runs; a buffer on another
// stream, and its growth, must not take that memory.
CHILD_CASE(stream_buffer_running) {
  const std::size_t n = 2 * MiB;  // elements: 8 MiB
  const std::size_t bytes = n * sizeof(std::uint32_t);
  for (const config& cfg : configs(bytes)) {
    note("pool: %s", cfg.name);
    pool p(cfg.props);
    stream s(0), t(0);
    device_counters c(1);
    std::optional<long_use> u;
    {
      stream_buffer<std::uint32_t> a(n, s, p);
      u.emplace(start_long_use(a.data(), bytes, 1500, s.get(), c.slot(0)));
    }  // freed on s by its destructor while the kernel runs
    stream_buffer<std::uint32_t> b(n, t, p);
    expect_not_reused_while_running(b.data(), bytes, *u, 1, "a stream_buffer on another stream");
    fill_async(b.data(), bytes, 1510, t.get());
    CHILD_LAUNCHED("fill_async");
    const growth how = b.resize(2 * n);
    note("resize to twice: %s", how == growth::in_place ? "in place" : how == growth::moved ? "moved" : "unchanged");
    expect_not_reused_while_running(b.data(), b.capacity() * sizeof(std::uint32_t), *u, 2,
                                    "the buffer on another stream, grown");
    const owner o = fill_new(b.data(), 2 * bytes, 1520, t.get());
    expect_device_ok(3, "a stream_buffer freed under its kernel");
    expect_completed(*u, 4, "the kernel over the destroyed buffer");  // 4, 5
    expect_intact(o, 6, "the buffer on another stream");
  }
}

}  // namespace

TEST_CASE("lifetime: pool_destroyed_pending_free: destroying or closing a pool waits for its kernels") {
  expect_child_passes("pool_destroyed_pending_free");
}
TEST_CASE("lifetime: use_after_close: a closed pool throws std::logic_error, its buffers die quietly") {
  expect_child_passes("use_after_close");
}
TEST_CASE("lifetime: current_pool_destroyed: the device falls back to its default pool") {
  expect_child_passes("current_pool_destroyed");
}
TEST_CASE("lifetime: release_while_running: nothing pending is given back") {
  expect_child_passes("release_while_running");
}
TEST_CASE("lifetime: remap_while_running: defragmentation leaves a pending chunk alone") {
  expect_child_passes("remap_while_running");
}
TEST_CASE("lifetime: remap_multi_chunk_while_running: a default pool leaves a pending multi-chunk block alone") {
  expect_child_passes("remap_multi_chunk_while_running");
}
TEST_CASE("lifetime: alias_while_running: a stream's own pending chunks serve its request, mapped anew") {
  expect_child_passes("alias_while_running");
}
TEST_CASE("lifetime: grow_into_pending: growth in place stops at a pending block") {
  expect_child_passes("grow_into_pending");
}
TEST_CASE("lifetime: stream_buffer_running: a buffer freed under its kernel is not handed out") {
  expect_child_passes("stream_buffer_running");
}
