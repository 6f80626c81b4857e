#pragma once

// A simulated backend for the pool core (detail/core/pool_core.hpp): physical memory is bookkeeping
// with a capacity, and each stream is a queue whose progress the test controls, so tests decide
// exactly which frees have "executed on the device".

#include <streamalloc/detail/core/pool_core.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <vector>

namespace streamalloc_test {

struct sim_device {
  std::uint64_t granularity = 2u << 20;
  std::uint64_t capacity = 1ull << 40;  // physical bytes the device has
  std::uint64_t physical_used = 0;
  std::uint64_t next_va = 0x100000000000ULL;
  // A granule between reservations made without an address (the pool must not count on them
  // touching); false: each right after the last, as the driver placed them on the H100.
  bool gap_between_reservations = true;
  std::uint64_t next_handle = 1;
  std::map<std::uint64_t, std::uint64_t> handles;  // live handle -> size
  std::map<std::uint64_t, std::uint64_t> mapped;   // va -> size
  std::map<std::uint64_t, std::uint64_t> mapped_handle;  // va -> the handle mapped there
  std::map<std::uint64_t, std::uint64_t> reserved;  // reservation base -> size
  std::uint64_t addresses_left = ~0ull;             // the process's address space, as it runs out
  // Maps refused, as the driver's may be when memory is short: after `maps_before_refusal`
  // more succeed, the next `refuse_maps` fail (sim_backend::map_refused). With `fail_maps`
  // set, they fail with an error that is not a refusal instead (a sticky error's stand-in).
  std::uint64_t refuse_maps = 0, maps_before_refusal = 0;
  // Or each map asks this (when set) whether it is refused, for patterns the two counts cannot
  // make.
  std::function<bool()> refuse_map;
  bool fail_maps = false;
  std::uint64_t creates = 0, releases = 0, maps = 0, unmaps = 0;
  // The calls the pool makes on its hot paths, each a driver call on a GPU (some 170 to 330 ns
  // on the H100 and H200): what a replay's host time there adds to the CPU model's.
  std::uint64_t event_records = 0, event_queries = 0, idle_queries = 0, event_waits = 0;
  std::uint64_t host_waits = 0;  // synchronize: the host waiting for an event

  /// Is [va, va + bytes) inside one reservation?
  bool in_one_reservation(std::uint64_t va, std::uint64_t bytes) const {
    auto it = reserved.upper_bound(va);
    if (it == reserved.begin()) return false;
    --it;
    return va >= it->first && va + bytes <= it->first + it->second;
  }
  /// Does [va, va + bytes) overlap a reservation?
  bool overlaps_reservation(std::uint64_t va, std::uint64_t bytes) const {
    auto it = reserved.lower_bound(va + bytes);
    if (it == reserved.begin()) return false;
    --it;
    return it->first + it->second > va;
  }

  struct stream {
    std::uint64_t enqueued = 0;
    std::uint64_t completed = 0;
  };
  std::map<void*, stream> streams;
  struct event {
    void* stream;
    std::uint64_t seq;
  };
  std::map<std::uint64_t, event> events;
  std::uint64_t next_event = 1;
  std::uint64_t live_events = 0;
  std::vector<std::pair<void*, void*>> waits;  // (waiter, waited-on stream) inserted by the pool
  std::set<void*> busy;  // streams with work the test has not let run (idle() is false for them)
  /// An event recorded on an idle stream has completed by the time the pool looks again, even
  /// within the same request: what a GPU does within the pool's short poll of such events
  /// (pool_core::poll_fresh_covers). Off: it completes when the test runs the stream.
  bool idle_records_complete = false;

  /// The device has executed everything enqueued on `s` so far.
  void run(void* s) {
    streams[s].completed = streams[s].enqueued;
    busy.erase(s);
  }
  void run_all() {
    for (auto& [k, st] : streams) st.completed = st.enqueued;
    busy.clear();
  }
  /// Is [va, va + n) inside mapped memory?
  bool is_mapped(std::uint64_t va, std::uint64_t n) const {
    auto it = mapped.upper_bound(va);
    if (it == mapped.begin()) return false;
    --it;
    // walk contiguous mappings
    std::uint64_t at = va;
    while (at < va + n) {
      if (it == mapped.end() || it->first > at || it->first + it->second <= at) return false;
      at = it->first + it->second;
      ++it;
    }
    return true;
  }
};

struct sim_backend {
  using handle = std::uint64_t;
  using event = std::uint64_t;
  /// The simulated device has no stream capture: nothing to relax.
  struct capture_guard {
    explicit capture_guard(sim_backend&) noexcept {}
  };
  bool capturing(const streamalloc::detail::stream_key&) noexcept { return false; }
  bool lost_to_capture(const streamalloc::detail::stream_key&, event&) noexcept { return false; }
  std::shared_ptr<sim_device> dev;

  std::uint64_t granularity() const { return dev->granularity; }
  // Reservations go one after another with a granule between them; one asked for at an
  // address gets it when free there (as the driver's hint, usually honoured).
  std::uint64_t reserve(std::uint64_t bytes) {
    const std::uint64_t at = try_reserve(bytes, 0);
    if (at == 0) throw std::runtime_error("reserve: out of addresses");
    return at;
  }
  std::uint64_t try_reserve(std::uint64_t bytes, std::uint64_t at) {
    if (bytes == 0 || bytes % dev->granularity != 0) throw std::logic_error("reserve: bad size");
    if (bytes > dev->addresses_left) return 0;
    if (at == 0) at = dev->next_va;
    if (dev->overlaps_reservation(at, bytes)) return 0;
    dev->reserved[at] = bytes;
    dev->addresses_left -= bytes;
    dev->next_va = std::max(dev->next_va, at + bytes + (dev->gap_between_reservations ? dev->granularity : 0));
    return at;
  }
  CUresult create(std::uint64_t bytes, handle& out) {
    if (bytes == 0 || bytes % dev->granularity != 0) throw std::logic_error("create: bad size");
    if (dev->physical_used + bytes > dev->capacity) return CUDA_ERROR_OUT_OF_MEMORY;
    dev->physical_used += bytes;
    out = dev->next_handle++;
    dev->handles[out] = bytes;
    ++dev->creates;
    return CUDA_SUCCESS;
  }
  /// What a refused map throws.
  struct map_refused : std::runtime_error {
    using std::runtime_error::runtime_error;
  };
  static bool refused(const std::exception& e) noexcept { return dynamic_cast<const map_refused*>(&e) != nullptr; }
  void map(std::uint64_t va, std::uint64_t bytes, handle& h) {
    if (dev->handles.at(h) != bytes) throw std::logic_error("map: size mismatch");
    if (!dev->in_one_reservation(va, bytes)) throw std::logic_error("map: not inside one reservation");
    auto next = dev->mapped.lower_bound(va);
    if (next != dev->mapped.end() && next->first < va + bytes) throw std::logic_error("map: overlap");
    if (next != dev->mapped.begin() && std::prev(next)->first + std::prev(next)->second > va)
      throw std::logic_error("map: overlap");
    if (dev->refuse_map && dev->refuse_map()) {
      throw map_refused("map: refused (simulated shortage)");
    } else if (dev->refuse_maps != 0 && dev->maps_before_refusal != 0) {
      --dev->maps_before_refusal;
    } else if (dev->refuse_maps != 0) {
      --dev->refuse_maps;
      if (dev->fail_maps) throw std::runtime_error("map: failed (simulated error, not a shortage)");
      throw map_refused("map: refused (simulated shortage)");
    }
    dev->mapped[va] = bytes;
    dev->mapped_handle[va] = h;
    ++dev->maps;
  }
  // What the core calls while giving memory back may not throw (pool_backend): a misuse found
  // there ends the test at once.
  [[noreturn]] static void misuse(const char* what) noexcept {
    std::fprintf(stderr, "simulated device: %s\n", what);
    std::abort();
  }
  void unmap(std::uint64_t va, std::uint64_t bytes) noexcept {
    auto it = dev->mapped.find(va);
    if (it == dev->mapped.end() || it->second != bytes) misuse("unmap: not mapped");
    dev->mapped.erase(it);
    dev->mapped_handle.erase(va);
    ++dev->unmaps;
  }
  void release(handle& h) noexcept {
    auto it = dev->handles.find(h);
    if (it == dev->handles.end()) misuse("release: unknown handle");
    for (const auto& [va, mapped] : dev->mapped_handle) {
      if (mapped == h) misuse("release: the handle is still mapped");
    }
    dev->physical_used -= it->second;
    dev->handles.erase(it);
    ++dev->releases;
    h = 0;
  }
  event record(const streamalloc::detail::stream_key& k) {
    auto& s = dev->streams[k.native];
    const bool was_idle = s.completed == s.enqueued && !dev->busy.count(k.native);
    const event id = dev->next_event++;
    dev->events[id] = {k.native, ++s.enqueued};
    if (was_idle && dev->idle_records_complete) s.completed = s.enqueued;
    ++dev->live_events;
    ++dev->event_records;
    return id;
  }
  bool done(event& e) {
    ++dev->event_queries;
    const auto& ev = dev->events.at(e);
    return dev->streams[ev.stream].completed >= ev.seq;
  }
  bool idle(const streamalloc::detail::stream_key& k) {
    ++dev->idle_queries;
    auto& s = dev->streams[k.native];
    return s.completed == s.enqueued && !dev->busy.count(k.native);
  }
  void wait(const streamalloc::detail::stream_key& k, event& e) {
    dev->waits.emplace_back(k.native, dev->events.at(e).stream);
    ++dev->event_waits;
    // A stream waiting on an event not yet reached is blocked: not idle until it runs.
    const auto& ev = dev->events.at(e);
    if (dev->streams[ev.stream].completed < ev.seq) dev->busy.insert(k.native);
  }
  void synchronize(event& e) noexcept {
    const auto found = dev->events.find(e);
    if (found == dev->events.end()) misuse("synchronize: unknown event");
    ++dev->host_waits;
    auto& ev = found->second;
    auto& s = dev->streams[ev.stream];
    s.completed = std::max(s.completed, ev.seq);
  }
  void destroy(event& e) noexcept {
    dev->events.erase(e);
    --dev->live_events;
  }
};

static_assert(streamalloc::detail::pool_backend<sim_backend>);

}  // namespace streamalloc_test
