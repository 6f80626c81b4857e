#pragma once

// The simulated device for tests of the pool core out of host memory (with failing_new.hpp): its
// own bookkeeping never fails for lack of host memory, so that a failure the test makes is
// always the pool's. Like failing_new.hpp, which it includes, for one source file per binary.

#include <streamalloc/detail/core/ordering.hpp>
#include <streamalloc/detail/core/pool_backend.hpp>

#include "failing_new.hpp"
#include "sim_backend.hpp"
#include "test_streams.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <exception>

namespace test_support {

/// The simulated device, whose calls never fail for lack of host memory.
struct device_backend {
  using handle = streamalloc_test::sim_backend::handle;
  using event = streamalloc_test::sim_backend::event;
  struct capture_guard {
    explicit capture_guard(device_backend&) noexcept {}
  };
  struct device_call {
    bool was = test_support::allocations_exempt;
    device_call() noexcept { test_support::allocations_exempt = true; }
    ~device_call() { test_support::allocations_exempt = was; }
  };
  streamalloc_test::sim_backend sim;

  bool capturing(const streamalloc::detail::stream_key&) noexcept { return false; }
  bool lost_to_capture(const streamalloc::detail::stream_key&, event&) noexcept { return false; }
  std::uint64_t granularity() const { return sim.granularity(); }
  std::uint64_t reserve(std::uint64_t b) {
    const device_call c;
    return sim.reserve(b);
  }
  std::uint64_t try_reserve(std::uint64_t b, std::uint64_t at) {
    const device_call c;
    return sim.try_reserve(b, at);
  }
  CUresult create(std::uint64_t b, handle& h) {
    const device_call c;
    return sim.create(b, h);
  }
  void map(std::uint64_t va, std::uint64_t b, handle& h) {
    const device_call c;
    sim.map(va, b, h);
  }
  static bool refused(const std::exception& e) noexcept { return streamalloc_test::sim_backend::refused(e); }
  void unmap(std::uint64_t va, std::uint64_t b) noexcept {
    const device_call c;
    sim.unmap(va, b);
  }
  void release(handle& h) noexcept {
    const device_call c;
    sim.release(h);
  }
  event record(const streamalloc::detail::stream_key& k) {
    const device_call c;
    return sim.record(k);
  }
  bool done(event& e) {
    const device_call c;
    return sim.done(e);
  }
  bool idle(const streamalloc::detail::stream_key& k) {
    const device_call c;
    return sim.idle(k);
  }
  void wait(const streamalloc::detail::stream_key& k, event& e) {
    const device_call c;
    sim.wait(k, e);
  }
  void synchronize(event& e) noexcept {
    const device_call c;
    sim.synchronize(e);
  }
  void destroy(event& e) noexcept {
    const device_call c;
    sim.destroy(e);
  }
};
static_assert(streamalloc::detail::pool_backend<device_backend>);

/// A host synchronization of `s`: its work runs, and the pools hear of it.
inline void host_sync(streamalloc_test::sim_device& dev, test_stream s) {
  const auto epoch = s.record->begin_synchronize();
  dev.run(s.native);
  streamalloc::detail::ordering().complete_stream(*s.record, epoch);
}

/// The end of a test: once `s`'s work has run and the pool is trimmed, the pool holds nothing
/// and the device has no physical memory left (nothing was lost to the pool on the way).
template <class Pool>
void check_all_given_back(Pool& pool, streamalloc_test::sim_device& dev, test_stream s) {
  host_sync(dev, s);
  pool.trim_to(0);
  CHECK(pool.statistics().reserved_current == 0);
  CHECK(dev.handles.empty());
}

}  // namespace test_support
