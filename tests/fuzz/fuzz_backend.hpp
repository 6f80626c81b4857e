#pragma once

// The backend the pool core runs on (declared in harness.hpp): physical memory from the simulated
// device, and streams and events from the harness's model, which answers each call only after
// checking that the pool may use that stream's handle now, and watches every mapping and unmapping
// for memory still in use.

#include "harness.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace pool_core_fuzz {

// --- what the backend asks, answered by the model ------------------------------------------------

/// The stream behind a key the pool passes to the backend, after checking the pool may use
/// that handle now.
inline std::size_t harness::check_handle(const stream_key& k, const char* what) {
  const std::size_t s = index_of(k.record);
  if (s == none) fail("backend %s on a stream record the test never made", what);
  if (s == host || k.native == nullptr) fail("backend %s on stream %zu with no handle", what, s);
  if (current_.record == k.record && current_.native == k.native) return s;
  const model_stream& m = streams_[s];
  if (m.stable && m.alive && !k.record->retired() && k.native == m.native) return s;
  fail("backend %s through the handle %p of stream %zu (%s, %s%s) outside a call given it%s", what, k.native, s,
       m.stable ? "stable" : "raw", m.alive ? "alive" : "destroyed", k.record->retired() ? ", retired" : "",
       k.native != m.native ? " (not even its own handle)" : "");
}

inline sim_backend::event harness::record_event(const stream_key& k, sim_backend& sim) {
  const std::size_t s = check_handle(k, "record");
  const sim_backend::event e = sim.record({k.record, phys(s)});
  events_[e] = point_now(s);
  return e;
}

inline const point& harness::event_point(sim_backend::event e, const char* what) {
  auto it = events_.find(e);
  if (it == events_.end()) fail("backend %s of an unknown or destroyed event %llu", what, ull(e));
  return it->second;
}

inline bool harness::event_done(sim_backend::event e) {
  const point& p = event_point(e, "done");
  return streams_[p.stream].done >= p.op;
}

inline bool harness::stream_idle(const stream_key& k) {
  const model_stream& m = streams_[check_handle(k, "idle")];
  return m.done == m.ops;
}

inline void harness::stream_wait(const stream_key& k, sim_backend::event e) {
  const std::size_t t = check_handle(k, "wait");
  const point p = event_point(e, "wait");
  TRACE("  pool: stream %zu waits for stream %zu op %llu", t, p.stream, ull(p.op));
  model_wait(t, p);
}

inline void harness::event_synchronize(sim_backend::event e) {
  const point p = event_point(e, "synchronize");
  TRACE("  pool: host waits for stream %zu op %llu", p.stream, ull(p.op));
  device_run(p.stream, p.op);
}

inline void harness::event_destroy(sim_backend::event e, sim_backend& sim) {
  (void)event_point(e, "destroy");
  events_.erase(e);
  sim.destroy(e);
}

/// Memory is about to be mapped at `va`. Physical memory already mapped elsewhere (an alias:
/// a stream's own frees moved to new addresses before they ran) brings its unexecuted frees
/// along, so the checks of reuse at the new addresses see them.
inline void harness::on_map(std::uint64_t va, std::uint64_t bytes, sim_backend::handle hd, const sim_backend& sim) {
  for (const auto& [old, mapped] : sim.dev->mapped_handle) {
    if (mapped != hd) continue;
    TRACE("  pool: [%#llx, +%llu) mapped again at %#llx", ull(old), ull(bytes), ull(va));
    // Only free memory may be mapped again: a live block there would share its physical
    // memory with whatever the new addresses are given to.
    for (const auto& [a, l] : live_) {
      if (overlaps(old, bytes, l.addr, l.size))
        fail("mapping [%#llx, +%llu) again at %#llx under the live block [%#llx, +%llu) of stream %zu", ull(old),
             ull(bytes), ull(va), ull(l.addr), ull(l.size), l.owner);
    }
    std::vector<freed> moved;
    for (const freed& f : history_) {
      if (streams_[f.stream].done >= f.op || !overlaps(old, bytes, f.addr, f.size)) continue;
      const std::uint64_t from = std::max(f.addr, old), to = std::min(f.addr + f.size, old + bytes);
      moved.push_back({va + (from - old), to - from, f.stream, f.op});
    }
    history_.insert(history_.end(), moved.begin(), moved.end());
  }
}

/// Memory is about to be unmapped: nothing may still use it.
inline void harness::check_unmap(std::uint64_t va, std::uint64_t bytes) {
  if (!shutting_down_) {
    for (const auto& [a, l] : live_) {
      if (overlaps(va, bytes, l.addr, l.size))
        fail("unmapping [%#llx, +%llu) under the live block [%#llx, +%llu) of stream %zu", ull(va), ull(bytes),
             ull(l.addr), ull(l.size), l.owner);
    }
  }
  for (const freed& f : history_) {
    if (streams_[f.stream].done < f.op && overlaps(va, bytes, f.addr, f.size))
      fail("unmapping [%#llx, +%llu) while the free of [%#llx, +%llu) on stream %zu (op %llu, executed %llu) may "
           "still run",
           ull(va), ull(bytes), ull(f.addr), ull(f.size), f.stream, ull(f.op), ull(streams_[f.stream].done));
  }
}

// --- the backend's members, which need the harness -------------------------------------------

template <class F>
auto sim_call(const char* what, F&& f) {
  try {
    return f();
  } catch (const std::logic_error& e) {
    fail("the simulated device refused %s: %s", what, e.what());
  }
}

inline CUresult fuzz_backend::create(std::uint64_t bytes, handle& out) {
  return sim_call("create", [&] { return sim.create(bytes, out); });
}
inline void fuzz_backend::map(std::uint64_t va, std::uint64_t bytes, handle& hd) {
  // A refused mapping maps nothing: it throws here, before the model hears of a mapping.
  if (sim.dev->refuse_maps != 0 && sim.dev->maps_before_refusal == 0) {
    sim_call("map", [&] { sim.map(va, bytes, hd); });
  }
  h->on_map(va, bytes, hd, sim);
  sim_call("map", [&] { sim.map(va, bytes, hd); });
}
// The simulated device aborts on a misuse in these: they may not throw (pool_backend).
inline void fuzz_backend::unmap(std::uint64_t va, std::uint64_t bytes) noexcept {
  h->check_unmap(va, bytes);
  sim.unmap(va, bytes);
}
inline void fuzz_backend::release(handle& hd) noexcept { sim.release(hd); }
inline fuzz_backend::event fuzz_backend::record(const stream_key& k) { return h->record_event(k, sim); }
inline bool fuzz_backend::done(event& e) { return h->event_done(e); }
inline bool fuzz_backend::idle(const stream_key& k) { return h->stream_idle(k); }
inline void fuzz_backend::wait(const stream_key& k, event& e) { h->stream_wait(k, e); }
inline void fuzz_backend::synchronize(event& e) noexcept { h->event_synchronize(e); }
inline void fuzz_backend::destroy(event& e) noexcept { h->event_destroy(e, sim); }

static_assert(pool_backend<fuzz_backend>);

}  // namespace pool_core_fuzz
