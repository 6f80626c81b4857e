#pragma once

// How a pool learns that frees have run on the device. A free on stream A stamps its block with
// A's clock; the block may be reused by another stream B only once the free is known to precede
// B's work: B was ordered after A (an event wait the ordering registry saw), or the free is known
// complete. Complete is learned here, per stream, from three sources, cheapest first:
//   - the stream's record: a host synchronization (or an event the host waited on) marks
//     everything enqueued before it complete;
//   - the stream itself, during a call given it: one query of an idle stream completes
//     everything before the question;
//   - events the pool records on the stream, one per look covering the frees made since the
//     last one, polled until the device passes them.
//
// Stream handles: a state keeps the handle it was first seen with, but uses it on its own only
// when the stream's record says the handle stays valid (a stream streamalloc owns, until it
// retires; the legacy default stream). Any other handle is used only during a call that was
// given it, on the calling thread: a raw stream may have been destroyed since and its value
// handed to a new stream, and the per-thread default stream's handle names the calling
// thread's stream. Reusing on stream B memory freed on such a stream A therefore needs proof
// learned while A was in hand (an event recorded on A during one of A's calls, a host
// synchronization, an event wait).
//
// Under the pool lock, like the pending bins and events it reads.

#include <streamalloc/detail/core/block.hpp>
#include <streamalloc/detail/core/ordering.hpp>
#include <streamalloc/detail/core/pool_backend.hpp>
#include <streamalloc/detail/core/stream_table.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace streamalloc::detail {

template <pool_backend Backend>
class completion_tracker {
 public:
  using event = typename Backend::event;
  using state = stream_state<event>;

  explicit completion_tracker(Backend& backend) noexcept : backend_(backend) {}

  /// The handle through which the pool may reach `st`'s stream now: its own when the stream's
  /// record says it stays valid, else the caller's when the caller is that stream (given in this
  /// call, on this thread), else none.
  void* handle_now(const state& st, const stream_key& caller) noexcept {
    void* native = nullptr;
    if (st.native != nullptr && st.record->handle_stable()) {
      native = st.native;
    } else if (caller.record == st.record.get()) {
      native = caller.native;
    }
    // A stream being captured runs nothing now: querying it or recording on it would be
    // captured, or refused and break the capture (whoever's capture it is).
    if (native != nullptr && backend_.capturing({st.record.get(), native})) return nullptr;
    return native;
  }

  /// Takes `st`'s pending blocks whose frees are known complete out of its pending bins and
  /// appends them to `ready`. With `query_events`, asks the device first: about the stream
  /// itself where its handle may be used now (`caller`: the stream of the call in progress, if
  /// any), and about the pool's events on it, recording one that covers frees not yet covered.
  void settle(state& st, bool query_events, const stream_key& caller, std::vector<block*>& ready) {
    void* const native = query_events ? handle_now(st, caller) : nullptr;
    // An idle stream has executed everything enqueued before the question, frees included: the
    // cheapest proof there is (one query), and complete, where an event only covers the frees
    // made before it was recorded. But only of the stream this call was given: the query
    // invalidates a capture of the stream in every capture mode, the asking thread's relaxed
    // one included (bench_stream_lookup, H200), and another thread may begin one on its own
    // `stream` between handle_now's question and the query. An event recorded there instead
    // (cover, below) leaves such a capture whole, and covers nothing (lost_to_capture); a
    // request that would otherwise grow the pool polls it briefly (pool_sources.hpp).
    // The legacy default stream is asked from any call. It cannot be captured, but a query
    // (or an event record) on it invalidates a capture of a blocking stream that another
    // thread begins in the window after handle_now's question (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT),
    // and no other call can learn its frees: used only in its own calls, the MoE trace as
    // PyTorch runs it (legacy main stream, raw side stream) held 1.506 of its peak instead of
    // 1.031 on the CPU model. That race stays (docs/graphs.md).
    const bool may_ask = caller.record == st.record.get() || st.record->legacy();
    if (native != nullptr && may_ask && st.has_frees() && st.newest_stamp > st.record->completed()) {
      const std::uint64_t point = st.record->begin_synchronize();
      if (backend_.idle({st.record.get(), native})) ordering().complete_stream_quietly(*st.record, point);
    }
    if (query_events) {
      // One event per stream per look, not one per free.
      if (native != nullptr && cover(st, {st.record.get(), native}) && !may_ask) st.covered_in_look = look_;
      reap(st);
    }
    const std::uint64_t done = st.record->completed();
    if (done == 0 || st.pending.empty()) return;
    // Room for every block first: out of host memory, a block taken from the bins and not yet
    // in `ready` would be in neither, and lost to the pool for good.
    ready.reserve(ready.size() + st.pending.count());
    st.pending.for_each([&](block* b) {
      if (b->stamp <= done) {
        st.pending.remove(b);
        ready.push_back(b);
      }
    });
  }

  /// Records an event on `s` (the stream of the call in progress, whose state is `st`) covering
  /// its pending frees not yet covered by one. For a stream whose handle the pool may not use
  /// later (raw, per-thread) this is the only way other streams ever learn that those frees ran
  /// without a host synchronization.
  /// True when it recorded one.
  bool cover(state& st, const stream_key& s) {
    if (s.native == nullptr || !st.has_frees() || st.newest_stamp <= st.last_event_epoch ||
        st.newest_stamp <= st.record->completed()) {
      return false;
    }
    return record_on(st, s);
  }

  /// Starts a request's look at the other streams: the streams whose frees it covers with an
  /// event without asking whether they are idle are marked with this look
  /// (stream_state::covered_in_look).
  void begin_look() noexcept { ++look_; }
  [[nodiscard]] std::uint64_t current_look() const noexcept { return look_; }

  /// Records an event on `s` (the stream of the call in progress, whose state is `st`, known
  /// not capturing) covering every free made on it so far, cached ones included. False when
  /// the record went into a capture begun meanwhile (it covers nothing).
  bool record_on(state& st, const stream_key& s) {
    // A stream that only ever takes its fast path is never settled: its completed events are
    // given back here, or they would pile up (each a new CUevent).
    reap(st);
    const clock_snapshot point = st.record->capture();
    auto ev = backend_.record(s);
    // Another thread may have begun capturing the stream since it was found not capturing (a
    // `stream` whose handle the pool keeps is used by its owner's thread too): the record may
    // then have gone into that capture, marking no point of the stream's work. It covers nothing.
    if (backend_.lost_to_capture(s, ev)) [[unlikely]] return false;
    try {
      st.events.push_back({ev, point.epoch});
    } catch (...) {  // out of host memory: the event is not kept, so it must not outlive this
      backend_.destroy(ev);
      throw;
    }
    st.last_event_epoch = std::max(st.last_event_epoch, point.epoch);
    st.uncovered_bytes.store(0, std::memory_order_relaxed);
    return true;
  }

  /// The events at the front of `st`'s list that have completed: what they cover is marked
  /// complete, and they are given back.
  void reap(state& st) {
    while (!st.events.empty() && backend_.done(st.events.front().ev)) {
      st.record->mark_completed(st.events.front().epoch);
      backend_.destroy(st.events.front().ev);
      st.events.pop_front();
    }
  }

  /// An event on `st`'s stream covering its frees up to the returned epoch: recorded now when
  /// its handle may be used (whatever the frees since the last one), else, or when that record
  /// was lost to a capture begun meanwhile, the newest the pool recorded before. 0: there is none.
  std::uint64_t latest_cover(state& st) {
    if (void* native = handle_now(st, stream_key{})) record_on(st, {st.record.get(), native});
    return st.events.empty() ? 0 : st.events.back().epoch;  // the newest: the one just recorded, if any
  }

  /// Orders stream `s` (state `waiter`) after `st`'s newest event, which covers `st`'s frees up
  /// to `epoch` (from latest_cover): a stream wait, or for a synchronous call (`s` without a
  /// handle) the host's. The registry learns the ordering, whatever the reuse policies.
  /// Only after latest_cover returned `epoch` (not 0) for `st`: its newest event is that one.
  void wait_for_latest(state& waiter, const stream_key& s, state& st, std::uint64_t epoch) {
    event& ev = st.events.back().ev;
    if (s.native != nullptr) {
      backend_.wait(s, ev);
    } else {
      backend_.synchronize(ev);
    }
    waiter.record->wait_for(clock_snapshot{st.record->id(), epoch, {}});
  }

  /// Gives back `st`'s events, done or not (nothing waits on them any more); with `wait`, the
  /// host waits for each first (the pool is closing and its memory is about to go).
  void drop_events(state& st, bool wait) noexcept {
    for (auto& pe : st.events) {
      if (wait) backend_.synchronize(pe.ev);
      backend_.destroy(pe.ev);
    }
    st.events.clear();
  }

 private:
  Backend& backend_;
  std::uint64_t look_ = 0;  // the current look (begin_look)
};

}  // namespace streamalloc::detail
