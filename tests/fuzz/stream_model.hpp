#pragma once

// The harness's model of stream order: each stream's operations, what each is ordered after, and
// how far the device has run it. The model is exact where the randomized test of the core
// (tests/cpu/detail/pool_core_randomized_test.cpp) is not: a wait carries the point it waits for,
// and the device runs a stream past a wait only once what it waits for has run. The checks
// (model_checks.hpp) judge every block the pool hands out against it.

#include "harness.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace pool_core_fuzz {

// --- the model -----------------------------------------------------------------------------------

inline std::uint64_t harness::enqueue(std::size_t s) {
  model_stream& m = streams_[s];
  ++m.ops;
  if (s == host) m.done = m.ops;  // the host's work is done when the call returns
  return m.ops;
}

/// Stream t waits for point p (its wait is an operation of its own).
inline void harness::model_wait(std::size_t t, const point& p) {
  if (t == p.stream) return;
  model_stream& m = streams_[t];
  ++m.ops;
  m.waits.emplace_back(m.ops, p);
  m.after[p.stream] = std::max(m.after[p.stream], p.op);
  for (std::size_t u = 0; u < max_streams; ++u) m.after[u] = std::max(m.after[u], p.after[u]);
}

/// The device executes stream s's first `target` operations, and before each wait among
/// them, what it waits for.
inline void harness::device_run(std::size_t s, std::uint64_t target) {
  model_stream& m = streams_[s];
  target = std::min(target, m.ops);
  if (target <= m.done) return;
  while (m.waits_passed < m.waits.size() && m.waits[m.waits_passed].first <= target) {
    const point p = m.waits[m.waits_passed].second;
    device_run(p.stream, p.op);
    ++m.waits_passed;
  }
  m.done = std::max(m.done, target);
}

/// May memory freed on s at op f be used by work on t now?
inline bool harness::legal(std::size_t t, std::size_t s, std::uint64_t f) const {
  return t == s || streams_[t].after[s] >= f || streams_[s].done >= f;
}

/// Orders stream t after everything enqueued so far on s (an event recorded on s through
/// streamalloc and waited for by t); after the event recorded before it died for a dead s.
inline void harness::order_after(std::size_t t, std::size_t s) {
  if (t == s || s == host) return;  // the host's work is done already
  model_stream& m = streams_[s];
  if (m.alive) {
    const point p = point_now(s);
    streams_[t].record->wait_for(m.record->capture());
    model_wait(t, p);
  } else {
    streams_[t].record->wait_for(m.last->first);
    model_wait(t, m.last->second);
  }
}

/// A host synchronization of stream s, as stream::synchronize does it.
inline void harness::host_synchronize(std::size_t s) {
  model_stream& m = streams_[s];
  const std::uint64_t epoch = m.record->begin_synchronize();
  device_run(s, m.ops);
  ordering().complete_stream(*m.record, epoch);  // the pool hears of it
}

/// A device-wide synchronization, as synchronize_device does it.
inline void harness::device_synchronize() {
  auto points = ordering().begin_synchronize_all();
  for (std::size_t s = 1; s < streams_.size(); ++s) device_run(s, streams_[s].ops);
  ordering().complete_all(points);
}

// --- streams -------------------------------------------------------------------------------------

inline std::size_t harness::index_of(const stream_record* r) const {
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    if (streams_[i].record.get() == r) return i;
  }
  return none;
}

inline void harness::make_stream(std::uint8_t kind) {
  if (streams_.size() == max_streams) return;
  model_stream m;
  m.record = record_ref(ordering().record(next_id_++));
  switch (kind % 7) {
    case 0:
    case 1:  // a streamalloc stream
      m.stable = true;
      m.native = fresh_handle();
      break;
    case 2:  // a raw stream
      m.native = fresh_handle();
      break;
    case 3:  // a raw stream given the handle value of one destroyed before it
    case 4:  // a streamalloc stream, likewise
      m.stable = kind % 7 == 4;
      if (!dead_handles_.empty()) {
        const std::size_t i = in_.byte() % dead_handles_.size();
        m.native = dead_handles_[i];
        dead_handles_.erase(dead_handles_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        m.native = fresh_handle();
      }
      break;
    case 5:  // another thread's per-thread default stream: one value names a stream per thread
      m.native = per_thread_handle;
      break;
    case 6:  // the legacy default stream: stable, never destroyed
      for (const auto& x : streams_) {
        if (x.native == reinterpret_cast<void*>(0x1)) return;
      }
      m.stable = true;
      m.retirable = false;
      m.native = reinterpret_cast<void*>(0x1);
      break;
  }
  if (m.stable) m.record->mark_handle_stable();
  streams_.push_back(std::move(m));
  TRACE("stream %zu: %s, handle %p, id %llu", streams_.size() - 1, streams_.back().stable ? "stable" : "raw",
        streams_.back().native, ull(streams_.back().record->id()));
}

inline void* harness::fresh_handle() {
  next_handle_ += 0x100;
  return reinterpret_cast<void*>(next_handle_);
}

inline void harness::destroy_stream(std::size_t s) {
  model_stream& m = streams_[s];
  // The last event recorded on it, through which its blocks go on to other streams.
  m.last.emplace(m.record->capture(), point_now(s));
  if (m.stable) {
    TRACE("stream %zu: destroyed (retired)", s);
    current_ = key_of(s);  // the handle is valid until retire returns
    ordering().retire(m.record->id());
    current_ = {};
  } else {
    TRACE("stream %zu: destroyed (raw)", s);
  }
  m.alive = false;
  // A destroyed stream's handle value goes to the next stream made; the per-thread default
  // stream's (its thread ended) names the other threads' streams still.
  if (m.native != per_thread_handle) dead_handles_.push_back(m.native);
}

/// A live stream other than the host, chosen by the input; `none` if there is none.
inline std::size_t harness::pick_stream(std::uint8_t b, std::size_t other_than) const {
  std::array<std::size_t, max_streams> c{};
  std::size_t n = 0;
  for (std::size_t i = 1; i < streams_.size(); ++i) {
    if (streams_[i].alive && i != other_than) c[n++] = i;
  }
  return n == 0 ? none : c[b % n];
}

}  // namespace pool_core_fuzz
