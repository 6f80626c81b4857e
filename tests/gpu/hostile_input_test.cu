// Hostile input: bad device ordinals, double frees, pointers the pool does not own (foreign,
// interior, misaligned, host, stale from a destroyed pool) and sizes no pool can serve must
// throw, naming the problem, rather than crash or change the pool; and, where a free is pending
// behind a running kernel meanwhile, the pending block must stay pending.
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

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {

// Bad device ordinals throw, naming the problem, before anything is made.
CHILD_CASE(stream_bad_device) {
  expect_throws<std::invalid_argument>(1, "stream(-5)", [] { stream s(-5); });
  expect_throws<std::invalid_argument>(2, "stream(-2)", [] { stream s(-2); });
  {
    stream s(-1);  // the current context's device: 0 after cudaSetDevice(0)
    CHILD_EXPECT(s.device() == 0, 3, "stream(-1) is not on device 0");
  }
  const int n = device_count();
  expect_throws_something(4, "stream(device_count())", [n] { stream s(n); });
  expect_throws_something(5, "stream(1000)", [] { stream s(1000); });
  expect_throws<std::invalid_argument>(6, "memory_location::device(-1)", [] { (void)memory_location::device(-1); });
  expect_throws<std::invalid_argument>(7, "a pool on device device_count()",
                                       [n] { pool p(pool_properties{.location = memory_location::device(n)}); });
  expect_throws<std::invalid_argument>(8, "default_pool(-1)", [] { (void)default_pool(-1); });
  expect_throws<std::invalid_argument>(9, "current_pool(device_count())", [n] { (void)current_pool(n); });
}

// A double free, on the same or on another stream, while the first free is pending behind a
// kernel: std::invalid_argument, nothing changes, and the block is still not reusable elsewhere.
CHILD_CASE(double_free) {
  const std::size_t bytes = 4 * MiB;
  pool p;
  stream s(0), t(0);
  device_counters c(1);
  void* x = p.allocate(bytes, s);
  const long_use u = start_long_use(x, bytes, 800, s.get(), c.slot(0));
  p.deallocate(x, s);
  expect_throws<std::invalid_argument>(1, "a second free on the same stream", [&] { p.deallocate(x, s); });
  expect_throws<std::invalid_argument>(2, "a second free on another stream", [&] { p.deallocate(x, t); });
  expect_throws<std::invalid_argument>(3, "a second free through streamalloc::deallocate",
                                       [&] { streamalloc::deallocate(x, t); });
  void* y = p.allocate(bytes, t);
  expect_not_reused_while_running(y, bytes, u, 4, "after double frees on the allocating stream");
  const owner o = fill_new(y, bytes, 810, t.get());
  CHILD_EXPECT(p.statistics().live_allocations == 1, 5, "double frees changed the live allocations");
  expect_device_ok(6, "double frees while the first was pending");
  expect_completed(u, 7, "the kernel before the first free");  // 7, 8
  expect_intact(o, 9, "the allocation after the double frees");
  p.deallocate(y, t);
  expect_throws<std::invalid_argument>(10, "a double free after everything completed", [&] { p.deallocate(y, t); });
  CHILD_EXPECT(p.statistics().live_allocations == 0, 11, "the pool's count after the double free");
  void* z = p.allocate(bytes, t);
  fill_async(z, bytes, 820, t.get());
  CHILD_LAUNCHED("fill_async");
  CHILD_EXPECT(mismatches_on(z, bytes, 820, t.get()) == 0, 12, "the pool no longer works after double frees");
  p.deallocate(z, t);
  t.synchronize();
}

// Pointers the pool does not own as allocations: foreign device memory, host memory, another
// pool's allocation, interior and misaligned pointers, addresses inside a pending block. Each is
// refused with std::invalid_argument and changes nothing; zero-sized requests are no-ops.
CHILD_CASE(bad_pointers) {
  const std::size_t bytes = 4 * MiB;
  void* foreign = nullptr;
  CHILD_CUDA(cudaMalloc(&foreign, bytes));  // before any long kernel: cudaMalloc may synchronize
  pool p, other;
  stream s(0), t(0);
  device_counters c(1);
  void* theirs = other.allocate(bytes, s);
  void* live = p.allocate(bytes, s);
  void* x = p.allocate(bytes, s);
  const long_use u = start_long_use(x, bytes, 900, s.get(), c.slot(0));
  p.deallocate(x, s);
  const pool_statistics before = p.statistics();
  int on_stack = 0;
  auto* live_bytes = static_cast<char*>(live);
  expect_throws<std::invalid_argument>(1, "freeing cudaMalloc memory", [&] { p.deallocate(foreign, t); });
  expect_throws<std::invalid_argument>(2, "freeing a host stack address", [&] { p.deallocate(&on_stack, t); });
  expect_throws<std::invalid_argument>(3, "freeing another pool's allocation", [&] { p.deallocate(theirs, t); });
  expect_throws<std::invalid_argument>(4, "freeing an interior pointer", [&] { p.deallocate(live_bytes + 256, t); });
  expect_throws<std::invalid_argument>(5, "freeing the last 256 bytes of an allocation",
                                       [&] { p.deallocate(live_bytes + bytes - 256, t); });
  expect_throws<std::invalid_argument>(6, "freeing a misaligned pointer", [&] { p.deallocate(live_bytes + 1, t); });
  expect_throws<std::invalid_argument>(7, "freeing the middle of a pending block",
                                       [&] { p.deallocate(static_cast<char*>(x) + bytes / 2, t); });
  expect_throws<std::invalid_argument>(8, "streamalloc::deallocate of cudaMalloc memory",
                                       [&] { streamalloc::deallocate(foreign, t); });
  CHILD_EXPECT(p.allocate(0, t) == nullptr, 9, "allocate(0) is not nullptr");
  p.deallocate(nullptr, t);
  streamalloc::deallocate(nullptr, t);
  {
    stream_buffer<std::uint32_t> empty(0, t, p);
    CHILD_EXPECT(empty.size() == 0, 10, "an empty stream_buffer has elements");
  }
  const pool_statistics after = p.statistics();
  CHILD_EXPECT(after.live_allocations == before.live_allocations && after.used_current == before.used_current, 11,
            "refused frees or empty requests changed the pool's statistics");
  auto found = p.find_allocation(live_bytes + 256);
  CHILD_EXPECT(found && found->first == live, 12, "the allocation an interior free pointed into is no longer live");
  CHILD_EXPECT(other.find_allocation(theirs).has_value(), 13, "the other pool's allocation is no longer live");
  void* y = p.allocate(bytes, t);
  expect_not_reused_while_running(y, bytes, u, 14, "after refused frees");
  const owner o = fill_new(y, bytes, 910, t.get());
  expect_device_ok(15, "refused frees while a free was pending");
  expect_completed(u, 16, "the kernel before the free");  // 16, 17
  expect_intact(o, 18, "the allocation after refused frees");
  p.deallocate(y, t);
  p.deallocate(live, t);
  other.deallocate(theirs, t);
  t.synchronize();
  CHILD_CUDA(cudaFree(foreign));
}

// Requests no pool can serve: out_of_memory (a std::bad_alloc) with the size asked for, or
// std::length_error for a buffer whose byte count overflows, while a free is pending behind a
// kernel; the pool keeps working and still does not hand out the pending block.
CHILD_CASE(huge_sizes) {
  const std::size_t bytes = 4 * MiB;
  pool p;
  stream s(0), t(0);
  device_counters c(1);
  void* x = p.allocate(bytes, s);
  const long_use u = start_long_use(x, bytes, 1000, s.get(), c.slot(0));
  p.deallocate(x, s);
  const std::size_t total = device_memory(0).total;
  const std::size_t sizes[] = {SIZE_MAX, (std::size_t{1} << 62) + 1, std::size_t{1} << 62, 2 * total};
  int code = 1;
  for (std::size_t n : sizes) {
    try {
      void* q = p.allocate(n, t);
      fail(code, strf("allocate(%zu) returned %p", n, q));
    } catch (const out_of_memory& e) {
      CHILD_EXPECT(e.requested() == n, code + 1, strf("out_of_memory names %zu bytes, asked %zu", e.requested(), n));
    } catch (const std::exception& e) {
      fail(code, strf("allocate(%zu) threw \"%s\", not streamalloc::out_of_memory", n, e.what()));
    }
    code += 2;
  }  // 1..8
  expect_throws<std::length_error>(9, "a stream_buffer of SIZE_MAX / 4 words",
                                   [&] { stream_buffer<std::uint32_t> b(SIZE_MAX / 4, t, p); });
  expect_throws<std::bad_alloc>(10, "a stream_buffer of 2^62 bytes",
                                [&] { stream_buffer<std::uint32_t> b((std::size_t{1} << 62) / 4, t, p); });
  CHILD_EXPECT(p.statistics().live_allocations == 0, 11, "failed requests left live allocations");
  void* y = p.allocate(bytes, t);
  expect_not_reused_while_running(y, bytes, u, 12, "after failed huge requests");
  const owner o = fill_new(y, bytes, 1010, t.get());
  expect_device_ok(13, "failed huge requests while a free was pending");
  expect_completed(u, 14, "the kernel before the free");  // 14, 15
  expect_intact(o, 16, "the allocation after failed huge requests");
  p.deallocate(y, t);
  t.synchronize();
}

// Properties the driver refuses fail when the pool is made, naming the property, and not at the
// first allocation: a host NUMA node that does not exist, fabric handles where the device (or
// its fabric service) cannot make them. A limit off the granularity is rounded down, and holds.
CHILD_CASE(properties_refused) {
  const auto refused = [](int code, const char* call, const char* property, auto&& make) {
    std::fprintf(stderr, "  calling %s\n", call);
    try {
      make();
    } catch (const cuda_error& e) {
      CHILD_EXPECT(std::string(e.what()).find(property) != std::string::npos, code,
                   strf("%s threw \"%s\", which does not name %s", call, e.what(), property));
      CHILD_EXPECT(std::string(e.what()).find("when the pool was made") != std::string::npos, code,
                   strf("%s threw \"%s\", which does not say it failed when the pool was made", call, e.what()));
      note("%s threw as it should: %s", call, e.what());
      return;
    } catch (const std::exception& e) {
      fail(code, strf("%s threw \"%s\", not a streamalloc::cuda_error", call, e.what()));
    }
    fail(code, strf("%s did not throw", call));
  };
  refused(1, "a pool on host NUMA node 1000", "pool_properties::location (host NUMA node 1000)",
          [] { pool p(pool_properties{.location = memory_location::host_numa(1000)}); });

  // Fabric handles: refused when the pool is made, or usable from its first allocation on.
  std::optional<pool> fabric;
  try {
    fabric.emplace(pool_properties{.handle_types = shareable_handle_type::fabric});
  } catch (const cuda_error& e) {
    CHILD_EXPECT(std::string(e.what()).find("pool_properties::handle_types (fabric) on device 0") != std::string::npos,
                 2, strf("a refused fabric pool's message \"%s\" does not name the handle types", e.what()));
    note("fabric handles refused when the pool was made: %s", e.what());
  }
  stream s(0);
  if (fabric) {
    note("fabric handles work on this device: its pool must serve at once");
    void* x = fabric->allocate(MiB, s);
    fill_async(x, MiB, 1200, s.get());
    CHILD_LAUNCHED("fill_async");
    CHILD_EXPECT(mismatches_on(x, MiB, 1200, s.get()) == 0, 3, "an allocation of the fabric pool");
    fabric->deallocate(x, s);
  }

  // max_size 3 MiB with a 2 MiB granularity: at most 2 MiB held, and said so.
  pool small(pool_properties{.max_size = 3 * MiB});
  CHILD_EXPECT(small.properties().max_size == 2 * MiB, 4,
               strf("max_size 3 MiB became %zu, not 2 MiB", small.properties().max_size));
  expect_throws<out_of_memory>(5, "3 MiB + 256 from a pool of at most 3 MiB", [&] { (void)small.allocate(3 * MiB + 256, s); });
  void* y = small.allocate(2 * MiB, s);
  fill_async(y, 2 * MiB, 1210, s.get());
  CHILD_LAUNCHED("fill_async");
  CHILD_EXPECT(mismatches_on(y, 2 * MiB, 1210, s.get()) == 0, 6, "the whole of a rounded-down limit");
  CHILD_EXPECT(small.statistics().reserved_current == 2 * MiB, 7, "the pool holds more than its limit");
  small.deallocate(y, s);
  s.synchronize();
}

// A pointer from a destroyed pool, freed afterwards: no pool owns it (std::invalid_argument), or
// a new pool got the same addresses, when the stale free cannot be told from a real one. Only a
// crash is wrong then; the new pool keeps working.
CHILD_CASE(stale_pointer_after_pool_destroyed) {
  const std::size_t bytes = 4 * MiB;
  stream s(0);
  device_counters c(1);
  void* x = nullptr;
  std::optional<long_use> u;
  {
    pool a;
    x = a.allocate(bytes, s);
    u.emplace(start_long_use(x, bytes, 1100, s.get(), c.slot(0)));
  }  // destroyed with x live and its kernel running (reported on stderr)
  if (!find_pool(x)) {
    expect_throws<std::invalid_argument>(1, "freeing a destroyed pool's pointer",
                                         [&] { streamalloc::deallocate(x, s); });
  }
  pool b;
  void* y = b.allocate(bytes, s);
  note("the new pool %s the old pointer %p; its allocation is %p", b.owns(x) ? "owns" : "does not own", x, y);
  fill_async(y, bytes, 1110, s.get());
  CHILD_LAUNCHED("fill_async");
  expect_device_ok(2, "destroying a pool under a kernel, then making another");
  expect_completed(*u, 3, "the kernel over the destroyed pool's memory");  // 3, 4
  bool stale_accepted = false;
  std::fprintf(stderr, "  freeing the stale pointer\n");
  try {
    streamalloc::deallocate(x, s);
    stale_accepted = true;
  } catch (const std::invalid_argument& e) {
    note("the stale free was refused: %s", e.what());
  } catch (const std::exception& e) {
    fail(5, strf("the stale free threw \"%s\", not std::invalid_argument", e.what()));
  }
  if (stale_accepted) {
    note("the stale free was accepted: the new pool's allocation sits at the old address (undetectable)");
  } else {
    CHILD_EXPECT(mismatches_on(y, bytes, 1110, s.get()) == 0, 6,
                 "the new pool's allocation after a refused stale free");
    b.deallocate(y, s);
  }
  void* z = b.allocate(bytes, s);
  fill_async(z, bytes, 1120, s.get());
  CHILD_LAUNCHED("fill_async");
  CHILD_EXPECT(mismatches_on(z, bytes, 1120, s.get()) == 0, 7, "the new pool after a stale free");
  b.deallocate(z, s);
  s.synchronize();
}

}  // namespace

TEST_CASE("hostile input: stream_bad_device: bad device ordinals throw") { expect_child_passes("stream_bad_device"); }
TEST_CASE("hostile input: double_free: refused, and the pending block stays pending") {
  expect_child_passes("double_free");
}
TEST_CASE("hostile input: bad_pointers: foreign, interior, misaligned and host pointers are refused") {
  expect_child_passes("bad_pointers");
}
TEST_CASE("hostile input: huge_sizes: out_of_memory or length_error, and the pool keeps working") {
  expect_child_passes("huge_sizes");
}
TEST_CASE("hostile input: properties_refused: refused when the pool is made, naming the property") {
  expect_child_passes("properties_refused");
}
TEST_CASE("hostile input: stale_pointer_after_pool_destroyed: no crash") {
  expect_child_passes("stale_pointer_after_pool_destroyed");
}
