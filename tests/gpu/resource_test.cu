// One typed conformance suite that every streamalloc memory resource passes: pool_resource in
// each of its access flavours, pmr_resource (synchronous and stream-ordered), and CCCL's
// type-erased async_resource_ref over a streamalloc resource. Each harness says what the
// memory is accessible from; the suite writes and reads it back from there.

#include <streamalloc/resource.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <doctest/doctest.h>

#include "bad_free_recorder.hpp"
#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <cuda/memory_resource>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <tuple>
#include <memory>
#include <memory_resource>
#include <new>
#include <set>
#include <stdexcept>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {
pool_properties host_pool_props(std::size_t max = 0) {
  return {.location = memory_location::host_numa(0), .max_size = max};
}
pool_properties device_pool_props(std::size_t max = 0) { return {.location = memory_location::device(0), .max_size = max}; }

// A harness: makes the resource over a fresh pool, allocates and frees through the resource's
// own interface, and says where its memory is accessible from.

template <class Derived, bool Host, bool Device>
struct harness_base {
  static constexpr bool host = Host;
  static constexpr bool device = Device;
  stream s{0};
};

template <class R, bool Host, bool Device, bool Host_pool>
struct pool_resource_harness : harness_base<pool_resource_harness<R, Host, Device, Host_pool>, Host, Device> {
  explicit pool_resource_harness(std::size_t max = 0)
      : p(Host_pool ? host_pool_props(max) : device_pool_props(max)), r(p) {}
  void* allocate(std::size_t n, std::size_t a) { return r.allocate(n, a); }
  void deallocate(void* q, std::size_t n, std::size_t a) { r.deallocate(q, n, a); }
  void* allocate_async(std::size_t n, std::size_t a) { return r.allocate_async(n, a, ::cuda::stream_ref(this->s.get())); }
  void deallocate_async(void* q, std::size_t n, std::size_t a) {
    r.deallocate_async(q, n, a, ::cuda::stream_ref(this->s.get()));
  }
  bool equal_to_same_pool() { return r == R(p); }
  bool equal_to_other_pool() {
    pool other(Host_pool ? host_pool_props() : device_pool_props());
    return r == R(other);
  }
  pool p;
  R r;
};

using device_harness = pool_resource_harness<device_resource, false, true, false>;
using host_harness = pool_resource_harness<host_resource, true, false, true>;
using host_device_harness = pool_resource_harness<host_device_resource, true, true, true>;
using device_over_host_pool_harness = pool_resource_harness<device_resource, false, true, true>;

// std::pmr: synchronous, or in the order of a stream.
template <bool Ordered>
struct pmr_harness : harness_base<pmr_harness<Ordered>, true, true> {
  explicit pmr_harness(std::size_t max = 0)
      : p(host_pool_props(max)),
        r(Ordered ? pmr_resource(host_resource(p), this->s) : pmr_resource(host_resource(p))) {}
  void* allocate(std::size_t n, std::size_t a) { return static_cast<std::pmr::memory_resource&>(r).allocate(n, a); }
  void deallocate(void* q, std::size_t n, std::size_t a) { static_cast<std::pmr::memory_resource&>(r).deallocate(q, n, a); }
  void* allocate_async(std::size_t n, std::size_t a) { return allocate(n, a); }
  void deallocate_async(void* q, std::size_t n, std::size_t a) { deallocate(q, n, a); }
  bool equal_to_same_pool() {
    pmr_resource same = Ordered ? pmr_resource(host_resource(p), this->s) : pmr_resource(host_resource(p));
    return r.is_equal(same);
  }
  bool equal_to_other_pool() {
    pool other(host_pool_props());
    return r.is_equal(pmr_resource(host_resource(other)));
  }
  pool p;
  pmr_resource r;
};

// CCCL's type erasure over a streamalloc resource.
struct cccl_ref_harness : harness_base<cccl_ref_harness, false, true> {
  explicit cccl_ref_harness(std::size_t max = 0) : p(device_pool_props(max)), r(p), ref(r) {}
  void* allocate(std::size_t n, std::size_t a) { return ref.allocate(n, a); }
  void deallocate(void* q, std::size_t n, std::size_t a) { ref.deallocate(q, n, a); }
  void* allocate_async(std::size_t n, std::size_t a) { return ref.allocate_async(n, a, ::cuda::stream_ref(s.get())); }
  void deallocate_async(void* q, std::size_t n, std::size_t a) { ref.deallocate_async(q, n, a, ::cuda::stream_ref(s.get())); }
  bool equal_to_same_pool() {
    device_resource same(p);
    return ref == ::cuda::mr::async_resource_ref<::cuda::mr::device_accessible>(same);
  }
  bool equal_to_other_pool() {
    pool other(device_pool_props());
    device_resource o(other);
    return ref == ::cuda::mr::async_resource_ref<::cuda::mr::device_accessible>(o);
  }
  pool p;
  device_resource r;
  ::cuda::mr::async_resource_ref<::cuda::mr::device_accessible> ref;
};

// The resources claim what they are, in CCCL's terms.
static_assert(::cuda::mr::async_resource_with<device_resource, ::cuda::mr::device_accessible>);
static_assert(::cuda::mr::async_resource_with<host_device_resource, ::cuda::mr::device_accessible, ::cuda::mr::host_accessible>);
static_assert(::cuda::mr::async_resource_with<host_resource, ::cuda::mr::host_accessible>);
static_assert(!::cuda::mr::resource_with<host_resource, ::cuda::mr::device_accessible>);
static_assert(!::cuda::mr::resource_with<device_resource, ::cuda::mr::host_accessible>);
static_assert(std::is_base_of_v<std::pmr::memory_resource, pmr_resource>);

/// Writes `seed`'s pattern over [q, q + bytes) and checks it, from every side that may.
template <class H>
bool round_trip(H& h, void* q, std::size_t bytes, std::uint32_t seed) {
  const std::size_t n = bytes / 4;
  bool ok = true;
  if constexpr (H::device) {
    fill_async(q, n * 4, seed, h.s.get());
    ok = ok && mismatches_on(q, n * 4, seed, h.s.get()) == 0;
  }
  if constexpr (H::host) {
    (void)h.s.synchronize();
    auto* w = static_cast<std::uint32_t*>(q);
    for (std::size_t i = 0; i < n; ++i) w[i] = pattern(i, seed + 1);
    for (std::size_t i = 0; i < n; ++i) ok = ok && w[i] == pattern(i, seed + 1);
    if constexpr (H::device) ok = ok && mismatches_on(q, n * 4, seed + 1, h.s.get()) == 0;
  }
  return ok;
}
}  // namespace

#define SA_RESOURCES                                                                                             \
  device_harness, host_harness, host_device_harness, device_over_host_pool_harness, pmr_harness<false>, \
      pmr_harness<true>, cccl_ref_harness

TEST_CASE_TEMPLATE("conformance: every size and alignment, aligned, disjoint, readable where claimed", H, SA_RESOURCES) {
  H h;
  std::vector<std::tuple<char*, std::size_t, std::size_t>> live;
  std::uint32_t seed = 1;
  for (std::size_t bytes : {std::size_t{4}, std::size_t{256}, std::size_t{4100}, 3 * MiB}) {
    for (std::size_t align : {std::size_t{8}, std::size_t{256}, std::size_t{4096}, std::size_t{65536}}) {
      CAPTURE(bytes);
      CAPTURE(align);
      void* q = (seed % 2 == 0) ? h.allocate(bytes, align) : h.allocate_async(bytes, align);
      REQUIRE(q != nullptr);
      CHECK(reinterpret_cast<std::uintptr_t>(q) % align == 0);
      CHECK(round_trip(h, q, bytes, seed));
      live.emplace_back(static_cast<char*>(q), bytes, align);
      ++seed;
    }
  }
  std::sort(live.begin(), live.end());
  for (std::size_t i = 1; i < live.size(); ++i) {
    CHECK(std::get<0>(live[i - 1]) + std::get<1>(live[i - 1]) <= std::get<0>(live[i]));
  }
  // Interleaved with the first, the contents of each are still what was last written.
  (void)h.s.synchronize();
  for (auto& [q, bytes, align] : live) h.deallocate_async(q, bytes, align);
  (void)h.s.synchronize();
}

TEST_CASE_TEMPLATE("conformance: the pool's statistics follow the resource's allocations", H, SA_RESOURCES) {
  H h;
  const auto before = h.p.statistics();
  void* q = h.allocate(5 * MiB, 256);
  const auto during = h.p.statistics();
  CHECK(during.live_allocations == before.live_allocations + 1);
  CHECK(during.used_current >= before.used_current + 5 * MiB);
  h.deallocate(q, 5 * MiB, 256);
  const auto after = h.p.statistics();
  CHECK(after.live_allocations == before.live_allocations);
  CHECK(after.used_current == before.used_current);
}

TEST_CASE_TEMPLATE("conformance: foreign pointers and double frees go to the bad-free handler and change nothing", H,
                   SA_RESOURCES) {
  H h;
  void* q = h.allocate(1024, 256);
  int on_stack = 0;
  // Every resource's free may not throw (containers and CCCL's refs call it from noexcept
  // code): a refusal is reported to the handler, which here records it instead of aborting.
  const bad_free_recorder bad;
  h.deallocate(&on_stack, sizeof on_stack, 256);
  CHECK(bad.count() == 1);
  CHECK(bad.latest().pointer == &on_stack);
  CHECK(bad.latest().owner == pool_ref(h.p));
  CHECK(h.p.statistics().live_allocations == 1);
  h.deallocate(q, 1024, 256);
  CHECK(bad.count() == 1);
  h.deallocate(q, 1024, 256);  // a double free
  CHECK(bad.count() == 2);
  CHECK(bad.latest().pointer == q);
  CHECK(h.p.statistics().live_allocations == 0);
  // The pool's own free is the checking form: it throws the same refusal.
  CHECK_THROWS_AS(h.p.deallocate_sync(q), std::invalid_argument);
}

TEST_CASE_TEMPLATE("conformance: a pool at its limit throws bad_alloc; bad alignments are refused", H, SA_RESOURCES) {
  H h(64 * MiB);
  void* q = h.allocate(32 * MiB, 256);
  CHECK_THROWS_AS((void)h.allocate(64 * MiB, 256), std::bad_alloc);
  CHECK_THROWS_AS((void)h.allocate(1024, 3), std::invalid_argument);
  h.deallocate(q, 32 * MiB, 256);
  CHECK(h.p.statistics().live_allocations == 0);
}

TEST_CASE_TEMPLATE("conformance: equal over the same pool, not over another", H, SA_RESOURCES) {
  H h;
  CHECK(h.equal_to_same_pool());
  CHECK_FALSE(h.equal_to_other_pool());
}

TEST_CASE("claims are checked against the pool: host access over a device pool is refused") {
  pool device_pool(device_pool_props());
  CHECK_THROWS_AS(host_resource{device_pool}, std::invalid_argument);
  CHECK_THROWS_AS(host_device_resource{device_pool}, std::invalid_argument);
  pool host_pool(host_pool_props());
  host_device_resource both(host_pool);
  const host_resource narrowed = both;  // a claim can be narrowed
  CHECK(narrowed.pool() == both.pool());
}

TEST_CASE("std::pmr containers on a host pool, from host code") {
  pool hp(host_pool_props());
  pmr_resource mr(host_resource{hp});
  std::pmr::vector<int> v(&mr);
  for (int i = 0; i < 100000; ++i) v.push_back(i);
  CHECK(hp.owns(v.data()));
  long long sum = 0;
  for (int x : v) sum += x;
  CHECK(sum == 100000LL * 99999 / 2);
  std::pmr::map<int, std::pmr::string> m(&mr);
  for (int i = 0; i < 1000; ++i) m.emplace(i, std::pmr::string(100, char('a' + i % 26)));
  CHECK(std::string_view(m.at(27)) == std::string(100, 'b'));
  CHECK(hp.statistics().live_allocations > 1000);
  m.clear();
  v = std::pmr::vector<int>(&mr);
  CHECK(hp.statistics().live_allocations == 0);
}
