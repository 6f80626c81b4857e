// Ordering tokens against the fake driver: which calls make them, and the run-time check of
// what a token proves (the messages a debug build gives). The GPU tests check the same on
// stream_buffer with real work; this runs in CI.

#include <streamalloc/ordering.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/resource.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include <string>

using namespace streamalloc;

namespace {
// Why `proof` does not let memory last used on `from` (now) be used on `to`; empty if it does.
template <class P>
std::string why(const P& proof, stream_ref from, std::uint64_t last_use, stream_ref to) {
  return detail::unproven(proof, from.record(), last_use, &to.record());
}
std::uint64_t now(stream_ref s) { return s.record().stamp(); }
}  // namespace

// Tokens are values only streamalloc makes; a stream or an event is not one.
static_assert(ordering_proof<stream_order>);
static_assert(ordering_proof<const host_order&>);
static_assert(!ordering_proof<stream_ref>);
static_assert(!ordering_proof<event_ref>);
static_assert(!ordering_proof<int>);
static_assert(!std::is_default_constructible_v<stream_order>);
static_assert(!std::is_default_constructible_v<host_order>);
static_assert(std::is_trivially_copyable_v<stream_order> && std::is_trivially_copyable_v<host_order>);

TEST_SUITE("ordering") {
  TEST_CASE("order_after and wait make tokens that name their streams") {
    stream a(0), b(0);
    const stream_order t = order_after(b, a);
    CHECK(t.earlier_stream() == a.ref().id());
    CHECK(t.later_stream() == b.ref().id());
    event e;
    e.record(a);
    const stream_order w = b.wait(e);
    CHECK(w.earlier_stream() == a.ref().id());
    CHECK(w.point() > t.point());
  }

  TEST_CASE("a token covers uses before it on its earlier stream, for its later stream") {
    stream a(0), b(0), c(0);
    const std::uint64_t use = now(a);
    const stream_order t = order_after(b, a);
    CHECK(why(t, a, use, b).empty());
    // Used on another stream than the token's later one.
    CHECK(why(t, a, use, c).find("the token orders stream #") != std::string::npos);
    // Memory last used after the token was made.
    const std::uint64_t later_use = now(a);
    CHECK(why(t, a, later_use, b).find("made before the memory's last use") != std::string::npos);
    // Memory last used on another stream than the token's earlier one.
    stream d(0);
    CHECK(why(order_after(b, d), a, now(a), b).find("orders after stream #") != std::string::npos);
  }

  TEST_CASE("resolved(): the same stream, carrying its record") {
    stream a(0);
    const stream_ref raw(a.get());
    const stream_ref r = raw.resolved();
    CHECK(r == raw);
    CHECK(&r.record() == &a.ref().record());
    CHECK(r.id() == a.ref().id());
  }

  TEST_CASE("orderings through other streams count: a before b before c") {
    stream a(0), b(0), c(0);
    const std::uint64_t use = now(a);
    (void)order_after(b, a);
    const stream_order bc = order_after(c, b);
    CHECK(why(bc, a, use, c).empty());
  }

  TEST_CASE("host synchronizations: the stream's own, the device's, not another stream's") {
    stream a(0), b(0), c(0);
    const std::uint64_t use = now(a);
    CHECK(why(a.synchronize(), a, use, b).empty());
    const std::uint64_t later_use = now(a);
    CHECK(why(c.synchronize(), a, later_use, b).find("the host synchronized with stream #") != std::string::npos);
    CHECK(why(synchronize_device(0), a, later_use, b).empty());
  }

  TEST_CASE("an event recorded by a raw call proves nothing checkable") {
    stream a(0), b(0);
    CUevent raw = nullptr;
    REQUIRE(detail::cu::cuEventCreate_nothrow(&raw, 0) == CUDA_SUCCESS);
    const stream_order blind = b.wait(event_ref(reinterpret_cast<cudaEvent_t>(raw)));
    CHECK(blind.earlier_stream() == 0);
    CHECK(why(blind, a, now(a), b).find("raw CUDA call") != std::string::npos);
    (void)detail::cu::cuEventDestroy_nothrow(raw);
  }

  TEST_CASE("check_proof throws ordering_error with the reason, when checks are on") {
    stream a(0), b(0), c(0);
    const stream_order t = order_after(c, a);
    CHECK_THROWS_WITH_AS(detail::check_proof(t, a.ref().record(), now(a), &b.ref().record(), "test"),
                         doctest::Contains("the ordering proof does not cover this use"), ordering_error);
    CHECK_NOTHROW(detail::check_proof(t, a.ref().record(), 0, &c.ref().record(), "test"));
  }

  TEST_CASE("resources check their claims against the pool") {
    pool device_pool;
    CHECK_THROWS_AS(host_resource{device_pool}, std::invalid_argument);
    const device_resource d(device_pool);
    CHECK(d == device_resource(device_pool));
    pool host_pool(pool_properties{.location = memory_location::host_numa(0)});
    const host_device_resource both(host_pool);
    const host_resource narrowed = both;
    CHECK(narrowed.pool() == pool_ref(host_pool));
    CHECK_THROWS_AS((void)d.pool().allocate_sync(std::size_t{1} << 63), out_of_memory);
  }
}

// The resource concepts, both ways. A named namespace: the friends below are only used in
// unevaluated checks, which clang reports (and -Werror fails) for internal declarations.
namespace concept_checks {
struct not_a_resource {};
struct sync_only_device {
  void* allocate(std::size_t, std::size_t) { return nullptr; }
  void deallocate(void*, std::size_t, std::size_t) {}
  friend bool operator==(const sync_only_device&, const sync_only_device&) { return true; }
  friend bool operator!=(const sync_only_device&, const sync_only_device&) { return false; }
  friend constexpr void get_property(const sync_only_device&, device_accessible) noexcept {}
};
}  // namespace concept_checks
using concept_checks::not_a_resource;
using concept_checks::sync_only_device;
static_assert(device_memory_resource<device_resource>);
static_assert(device_memory_resource<host_device_resource>);
static_assert(!device_memory_resource<host_resource>);
static_assert(!device_memory_resource<not_a_resource>);
static_assert(!device_memory_resource<sync_only_device>);  // not stream-ordered
static_assert(::cuda::mr::resource_with<sync_only_device, device_accessible>);
static_assert(host_memory_resource<host_resource>);
static_assert(!host_memory_resource<device_resource>);
static_assert(!host_memory_resource<pmr_resource>);  // a std::pmr resource, not a CCCL one
