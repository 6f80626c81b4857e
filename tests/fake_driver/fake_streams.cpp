// The fake driver's streams and events, the context stack, and the streams a test holds
// busy; with what a capture makes of them (membership, forks and joins through events).

#include "fake_calls.hpp"
#include "fake_state.hpp"

#include <cuda.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace [[gnu::visibility("hidden")]] fake_cuda {

// --- streams, events, context stack: the device runs everything at once -------------------

// The calling thread's pushed contexts: a plain array, which has no destructor, so that calls
// made while the process exits still find it. exit() runs the main thread's thread_local
// destructors before the atexit handlers, and a pool's handler (default_pool's trim) pushes a
// stream's context to ask the stream about its work (AddressSanitizer caught a vector here,
// destroyed by then).
constexpr int context_stack_capacity = 64;
[[gnu::tls_model("initial-exec")]] thread_local CUcontext context_stack[context_stack_capacity];
[[gnu::tls_model("initial-exec")]] thread_local int context_stack_size = 0;

CUresult fake_cuCtxPushCurrent(CUcontext c) {
  if (CUresult r = need_init()) return r;
  if (context_stack_size == context_stack_capacity) return CUDA_ERROR_OUT_OF_MEMORY;
  context_stack[context_stack_size++] = current_context;
  current_context = c;
  return CUDA_SUCCESS;
}
CUresult fake_cuCtxPopCurrent(CUcontext* c) {
  if (CUresult r = need_init()) return r;
  if (c != nullptr) *c = current_context;
  current_context = context_stack_size == 0 ? nullptr : context_stack[--context_stack_size];
  return CUDA_SUCCESS;
}
void let_go_all();
CUresult fake_cuCtxSynchronize() {
  if (CUresult r = need_context()) return r;
  if (CUresult r = refuse_if_unsafe()) return r;
  let_go_all();  // every stream's work runs (the fake does not tell contexts apart here)
  return CUDA_SUCCESS;
}

struct fake_stream {
  unsigned long long id;
  CUcontext ctx;
  unsigned flags;
};
std::atomic<unsigned long long> next_stream_id{100};
std::atomic<int> live_streams{0};
std::atomic<int> live_events{0};

// The per-thread default stream is a stream of its own in every thread; the address of this
// thread-local names the calling thread's one.
[[gnu::tls_model("initial-exec")]] thread_local char per_thread_stream_key = 0;

stream_view view_of(CUstream s) {
  if (s == nullptr || s == CU_STREAM_LEGACY) return {true, nullptr, true, current_context};
  if (s == CU_STREAM_PER_THREAD) return {false, &per_thread_stream_key, true, current_context};
  const auto* fs = reinterpret_cast<const fake_stream*>(s);
  return {false, fs, (fs->flags & CU_STREAM_NON_BLOCKING) == 0, fs->ctx};
}

// Streams a test holds busy (fake_cuda_hold_stream): their work does not run, so a query of
// the stream or of an event recorded on it meanwhile answers "not ready", until the test lets
// go or the host waits for it (which, in the fake, runs it). Each hold has a number, so an
// event recorded during an earlier hold is done once that hold ended.
std::mutex held_mutex;
std::unordered_map<const void*, unsigned long long> held_streams;  // stream key -> hold number
std::atomic<int> holds{0};
std::atomic<unsigned long long> next_hold{1};

unsigned long long hold_of(const void* key) {
  if (holds.load() == 0 || key == nullptr) return 0;
  std::lock_guard lock(held_mutex);
  auto it = held_streams.find(key);
  return it == held_streams.end() ? 0 : it->second;
}
void let_go(const void* key) {
  if (holds.load() == 0) return;
  std::lock_guard lock(held_mutex);
  if (held_streams.erase(key) != 0) --holds;
}
void let_go_all() {
  if (holds.load() == 0) return;
  std::lock_guard lock(held_mutex);
  held_streams.clear();
  holds = 0;
}

// The capture `stream_key` takes part in, or null. Called with S().m held, as are the helpers
// below that take or return a capture.
capture* capture_of_locked(const void* stream_key) {
  auto it = S().capturing_streams.find(stream_key);
  return it == S().capturing_streams.end() ? nullptr : &S().captures.at(it->second);
}

// The legacy stream synchronizes with every blocking stream of its context, so using it while
// one of them captures would make captured work depend on work outside the capture
// (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT). Work submitted to it invalidates those captures; a mere
// query of its capture status does not (cuStreamIsCapturing documents both).
bool legacy_conflicts_locked(CUcontext ctx, bool invalidate) {
  bool conflict = false;
  for (auto& [id, c] : S().captures) {
    for (const capture_member& m : c.members) {
      if (m.blocking && m.ctx == ctx) {
        conflict = true;
        if (invalidate) c.invalidated = true;
        break;
      }
    }
  }
  return conflict;
}

// Destroyed streams' objects, handed to the streams made next: CUDA gives a destroyed
// stream's handle to a new stream (every one of 20,000 made one after another on the H100),
// and so does the fake, whatever the host allocator does (AddressSanitizer's quarantine never
// hands an address back soon).
// Never destroyed: streams are destroyed during static destruction too, and LeakSanitizer
// counts what a destroyed global vector held as leaked.
std::mutex spare_streams_mutex;
std::vector<fake_stream*>& spare_streams = *new std::vector<fake_stream*>;

CUresult fake_cuStreamCreateWithPriority(CUstream* s, unsigned flags, int) {
  if (CUresult r = need_context()) return r;
  fake_stream* made = nullptr;
  {
    std::lock_guard lock(spare_streams_mutex);
    if (!spare_streams.empty()) {
      made = spare_streams.back();
      spare_streams.pop_back();
    }
  }
  if (made != nullptr) {
    *made = fake_stream{next_stream_id++, current_context, flags};
  } else {
    made = new fake_stream{next_stream_id++, current_context, flags};
  }
  *s = reinterpret_cast<CUstream>(made);
  ++live_streams;
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamDestroy(CUstream s) {
  if (s == nullptr || reinterpret_cast<std::uintptr_t>(s) <= 2) return CUDA_ERROR_INVALID_HANDLE;
  if (any_capture()) {
    // As the driver does (H200, 580.159.04, measured 2026-11-29): destroying the stream that
    // began a capture ends the capture and destroys the graph being built, whose user objects'
    // destructors run; a stream that joined a capture leaves it, the capture goes on, and its
    // end then succeeds without a graph (the graph destroyed likewise).
    std::lock_guard lock(S().m);
    if (capture* c = capture_of_locked(s)) {
      if (c->origin == s) {
        for (const capture_member& m : c->members) S().capturing_streams.erase(m.stream_key);
        const CUgraph graph = c->graph;
        S().captures.erase(c->id);
        active_captures.fetch_sub(1, std::memory_order_release);
        auto g = S().graphs.find(graph);
        g->second.capturing = false;
        destroy_graph_locked(g);
      } else {
        std::erase_if(c->members, [&](const capture_member& m) { return m.stream_key == s; });
        S().capturing_streams.erase(s);
        c->member_destroyed = true;
      }
    }
  }
  {
    std::lock_guard lock(spare_streams_mutex);
    spare_streams.push_back(reinterpret_cast<fake_stream*>(s));
  }
  --live_streams;
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamGetId(CUstream s, unsigned long long* id) {
  ++stream_calls.stream_ids;
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  if (v <= 2) {  // the default streams of the current context: other streams in each context
    if (CUresult r = need_context()) return r;
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    if (s == CU_STREAM_PER_THREAD && capture_info_of(s, &status) == CUDA_SUCCESS &&
        status != CU_STREAM_CAPTURE_STATUS_NONE) {
      return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;  // as for any capturing stream (below)
    }
    const auto device = static_cast<unsigned long long>(std::max(0, device_of(current_context)));
    if (s == CU_STREAM_PER_THREAD) {
      // As on the GPU: each thread's per-thread default stream is a stream of its own, with
      // an id no other stream ever has.
      thread_local std::array<unsigned long long, 16> per_thread_ids{};
      unsigned long long& mine = per_thread_ids[device % per_thread_ids.size()];
      if (mine == 0) mine = next_stream_id++;
      *id = mine;
      return CUDA_SUCCESS;
    }
    // The legacy stream while a blocking stream of the context captures: refused, and the
    // capture invalidated, in every capture mode and from any thread, where cuStreamIsCapturing
    // is refused alone (bench_stream_lookup, one H200, 2026-11-29).
    if (any_capture()) {
      std::lock_guard lock(S().m);
      if (legacy_conflicts_locked(current_context, true)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    }
    *id = 1 + v + 4 * device;
    return CUDA_SUCCESS;
  }
  // As measured on the H100 (driver 580): refused for a capturing stream, in every mode.
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (capture_info_of(s, &status) == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE) {
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  *id = reinterpret_cast<fake_stream*>(s)->id;
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamGetCtx(CUstream s, CUcontext* c) {
  if (reinterpret_cast<std::uintptr_t>(s) <= 2) {
    if (CUresult r = need_context()) return r;
    *c = current_context;
    return CUDA_SUCCESS;
  }
  *c = reinterpret_cast<fake_stream*>(s)->ctx;
  return CUDA_SUCCESS;
}

// cuStreamSynchronize and cuStreamQuery: the host waiting for a stream. Potentially unsafe for
// the capture modes; on a capturing stream always refused, since the work waited for does not
// run until the graph does, and the capture is invalidated.
CUresult host_waits_for_stream(CUstream s) {
  if (CUresult r = need_init()) return r;
  if (view_of(s).legacy) note_legacy_call();
  if (CUresult r = refuse_if_unsafe()) return r;
  if (!any_capture()) return CUDA_SUCCESS;
  const stream_view v = view_of(s);
  std::lock_guard lock(S().m);
  if (v.legacy) return legacy_conflicts_locked(v.ctx, true) ? CUDA_ERROR_STREAM_CAPTURE_IMPLICIT : CUDA_SUCCESS;
  if (capture* c = capture_of_locked(v.stream_key)) {
    c->invalidated = true;
    ++unsafe_call_refusals;
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  }
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamSynchronize(CUstream s) {
  const CUresult r = host_waits_for_stream(s);
  if (r == CUDA_SUCCESS) let_go(view_of(s).stream_key);  // the host waits: its work runs
  return r;
}
// A test's code run inside the next cuStreamQuery, once, before it answers
// (fake_cuda_before_next_stream_query): what another thread could do meanwhile.
std::atomic<void (*)(void*)> next_stream_query_hook{nullptr};
std::atomic<void*> next_stream_query_arg{nullptr};

CUresult fake_cuStreamQuery(CUstream s) {
  ++stream_calls.stream_queries;
  if (auto* hook = next_stream_query_hook.exchange(nullptr)) hook(next_stream_query_arg.load());
  const CUresult r = host_waits_for_stream(s);
  return r == CUDA_SUCCESS && hold_of(view_of(s).stream_key) != 0 ? CUDA_ERROR_NOT_READY : r;
}

// An event's last record: never recorded, recorded for real (outside any capture), or recorded
// into the capture with that id, which makes it a node of that capture's graph, not a point in
// a stream the host can wait for. Atomic, so recording outside a capture takes no lock.
constexpr cuuint64_t never_recorded = 0;
constexpr cuuint64_t recorded_outside_capture = ~cuuint64_t{0};
bool is_capture_id(cuuint64_t last_record) {
  return last_record != never_recorded && last_record != recorded_outside_capture;
}
struct fake_event {
  std::atomic<cuuint64_t> last_record{never_recorded};
  CUcontext ctx = nullptr;  // current when it was made: it may be recorded on streams of that context only
  std::atomic<const void*> held_on{nullptr};    // recorded on a held stream (not yet run) ...
  std::atomic<unsigned long long> hold{0};       // ... during this hold
};
fake_event& event_of(CUevent e) { return *reinterpret_cast<fake_event*>(e); }
std::atomic<long long> captured_event_records{0};

CUresult fake_cuEventCreate(CUevent* e, unsigned) {
  if (CUresult r = need_context()) return r;
  auto* ev = new fake_event;
  ev->ctx = current_context;
  *e = reinterpret_cast<CUevent>(ev);
  ++live_events;
  return CUDA_SUCCESS;
}
CUresult fake_cuEventDestroy(CUevent e) {
  if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  delete &event_of(e);
  --live_events;
  return CUDA_SUCCESS;
}

// A test's code run inside the next cuEventRecord, once, before it records
// (fake_cuda_before_next_event_record): what another thread could do meanwhile.
std::atomic<void (*)(void*)> next_event_record_hook{nullptr};
std::atomic<void*> next_event_record_arg{nullptr};

CUresult fake_cuEventRecord(CUevent e, CUstream s) {
  ++stream_calls.event_records;
  if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  fake_event& ev = event_of(e);
  {
    // As the driver: an event is recorded only on a stream of its own context (waiting on one
    // from another context is allowed).
    const stream_view v = view_of(s);
    if (v.ctx != ev.ctx) return CUDA_ERROR_INVALID_HANDLE;
    if (v.legacy) note_legacy_call();
  }
  if (auto* hook = next_event_record_hook.exchange(nullptr)) hook(next_event_record_arg.load());
  const auto recorded_outside = [&ev, s] {
    ev.last_record = recorded_outside_capture;
    const void* key = view_of(s).stream_key;
    const unsigned long long h = hold_of(key);
    ev.held_on = h != 0 ? key : nullptr;
    ev.hold = h;
    return CUDA_SUCCESS;
  };
  if (!any_capture()) return recorded_outside();
  const stream_view v = view_of(s);
  std::lock_guard lock(S().m);
  if (v.legacy && legacy_conflicts_locked(v.ctx, true)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  capture* c = v.legacy ? nullptr : capture_of_locked(v.stream_key);
  if (c == nullptr) return recorded_outside();
  if (c->invalidated) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  ev.last_record = c->id;
  ++captured_event_records;
  return CUDA_SUCCESS;
}

// A wait joins captures and streams: a stream outside any capture that waits on an event
// recorded in capture C becomes part of C (a fork); a capturing stream may wait only on events
// of its own capture, or on one never recorded (an empty set of work).
CUresult fake_cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
  ++stream_calls.stream_waits;
  if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if ((flags & ~unsigned{CU_EVENT_WAIT_EXTERNAL}) != 0) return CUDA_ERROR_INVALID_VALUE;
  const cuuint64_t last = event_of(e).last_record.load();
  if (!any_capture()) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;  // external waits exist only in captures
    // The capture that recorded it has ended: there is nothing in any stream to wait for.
    return is_capture_id(last) ? CUDA_ERROR_CAPTURED_EVENT : CUDA_SUCCESS;
  }
  const stream_view v = view_of(s);
  std::lock_guard lock(S().m);
  if (v.legacy && legacy_conflicts_locked(v.ctx, true)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  capture* waiter = v.legacy ? nullptr : capture_of_locked(v.stream_key);
  if (flags != 0) {  // an external event node: no dependency on other work, any event will do
    if (waiter == nullptr) return CUDA_ERROR_INVALID_VALUE;
    return waiter->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
  }
  capture* recorder = nullptr;
  if (is_capture_id(last)) {
    auto it = S().captures.find(last);
    if (it != S().captures.end()) recorder = &it->second;
  }
  if (waiter != nullptr) {
    if (waiter->invalidated) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    if (last == never_recorded || recorder == waiter) return CUDA_SUCCESS;
    waiter->invalidated = true;
    if (recorder != nullptr) {
      recorder->invalidated = true;
      return CUDA_ERROR_STREAM_CAPTURE_MERGE;
    }
    return CUDA_ERROR_STREAM_CAPTURE_ISOLATION;  // recorded outside, or in a capture now ended
  }
  if (recorder != nullptr) {
    if (v.legacy) {  // the legacy stream cannot take part in a capture
      recorder->invalidated = true;
      return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    if (recorder->invalidated) return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    S().capturing_streams[v.stream_key] = recorder->id;
    recorder->members.push_back({v.stream_key, v.blocking, v.ctx});
    return CUDA_SUCCESS;
  }
  return is_capture_id(last) ? CUDA_ERROR_CAPTURED_EVENT : CUDA_SUCCESS;
}

// cuEventQuery and cuEventSynchronize: potentially unsafe for the capture modes; and an event
// last recorded in a capture stands for graph nodes, which no host call can wait for, in any
// mode (cuThreadExchangeStreamCaptureMode names this case).
// A test's code run inside the next host wait for an event (fake_cuda_before_next_event_wait),
// once: what another thread could do while the host waits.
std::atomic<void (*)(void*)> next_event_wait_hook{nullptr};
std::atomic<void*> next_event_wait_arg{nullptr};

CUresult host_waits_for_event(CUevent e) {
  if (e == nullptr) return CUDA_ERROR_INVALID_HANDLE;
  if (auto* hook = next_event_wait_hook.exchange(nullptr)) hook(next_event_wait_arg.load());
  if (CUresult r = refuse_if_unsafe()) return r;
  return is_capture_id(event_of(e).last_record.load()) ? CUDA_ERROR_CAPTURED_EVENT : CUDA_SUCCESS;
}
// Recorded during a hold that has not ended: not run yet.
bool event_held(CUevent e) {
  const fake_event& ev = event_of(e);
  const void* key = ev.held_on.load();
  return key != nullptr && ev.last_record.load() == recorded_outside_capture && hold_of(key) == ev.hold.load();
}
CUresult fake_cuEventQuery(CUevent e) {
  ++stream_calls.event_queries;
  const CUresult r = host_waits_for_event(e);
  return r == CUDA_SUCCESS && event_held(e) ? CUDA_ERROR_NOT_READY : r;
}
CUresult fake_cuEventSynchronize(CUevent e) {
  const CUresult r = host_waits_for_event(e);
  if (r == CUDA_SUCCESS && event_held(e)) let_go(event_of(e).held_on.load());  // the host waits: it runs
  return r;
}

}  // namespace fake_cuda
