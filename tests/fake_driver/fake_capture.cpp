// The fake driver's stream capture: the capture-interaction modes that refuse unsafe calls
// during a capture; beginning and ending captures, capture status; and the graph and
// user-object bookkeeping that ending a capture shares with fake_graphs.cpp.

#include "fake_calls.hpp"
#include "fake_state.hpp"

#include <cuda.h>

#include <mutex>
#include <thread>
#include <utility>

namespace [[gnu::visibility("hidden")]] fake_cuda {

// --- capture-interaction modes: which calls a capture forbids -----------------------------

// Captures begun and not yet ended, invalidated ones included. Read first by every call that a
// capture could affect, so that without a capture they cost one atomic load and take no lock
// (a benchmark's model calls cuStreamGetCaptureInfo on every allocation).
std::atomic<int> active_captures{0};
std::atomic<long long> unsafe_call_refusals{0};

bool any_capture() { return active_captures.load(std::memory_order_acquire) != 0; }

// The calling thread's mode, set by cuThreadExchangeStreamCaptureMode; global until changed.
[[gnu::tls_model("initial-exec")]] thread_local CUstreamCaptureMode thread_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;

// For the calls the driver calls "potentially unsafe" during a capture (they act outside stream
// order, so a graph could not replay them): refused, and the captures that forbade them
// invalidated, as cuThreadExchangeStreamCaptureMode documents. A thread in global mode is
// refused while it began a capture not in relaxed mode, or while another thread's capture begun
// in global mode runs; a thread in thread_local mode only for captures it began; a thread in
// relaxed mode never.
CUresult refuse_if_unsafe() {
  if (!any_capture()) return CUDA_SUCCESS;
  const CUstreamCaptureMode mine = thread_capture_mode;
  if (mine == CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
  const std::thread::id self = std::this_thread::get_id();
  std::lock_guard lock(S().m);
  bool refused = false;
  for (auto& [id, c] : S().captures) {
    const bool own = c.began_on == self && c.mode != CU_STREAM_CAPTURE_MODE_RELAXED;
    const bool anothers_global = mine == CU_STREAM_CAPTURE_MODE_GLOBAL && c.began_on != self &&
                                 c.mode == CU_STREAM_CAPTURE_MODE_GLOBAL;
    if (own || anothers_global) {
      c.invalidated = true;
      refused = true;
    }
  }
  if (!refused) return CUDA_SUCCESS;
  ++unsafe_call_refusals;
  return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

// --- stream capture ---------------------------------------------------------------------------

void release_user_object_locked(CUuserObject obj, unsigned long long count) {
  auto it = S().user_objects.find(obj);
  it->second.refs -= count;
  if (it->second.refs == 0) {
    post_to_driver_thread(it->second.destroy, it->second.ptr);
    S().user_objects.erase(it);
  }
}

void release_all_locked(const user_object_refs& refs) {
  for (const auto& [obj, count] : refs) release_user_object_locked(obj, count);
}

void destroy_graph_locked(std::map<CUgraph, fake_graph>::iterator g) {
  release_all_locked(g->second.refs);
  for (CUgraphNode n : g->second.nodes) S().nodes.erase(n);
  S().graphs.erase(g);
}

CUresult fake_cuStreamBeginCapture(CUstream s, CUstreamCaptureMode mode) {
  if (CUresult r = need_init()) return r;
  if (static_cast<unsigned>(mode) > CU_STREAM_CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
  const stream_view v = view_of(s);
  if (v.legacy) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
  std::lock_guard lock(S().m);
  if (S().capturing_streams.count(v.stream_key) != 0) return CUDA_ERROR_ILLEGAL_STATE;
  capture c;
  c.id = S().next_capture_id++;
  c.graph = new_graph_handle_locked<CUgraph>();
  c.mode = mode;
  c.began_on = std::this_thread::get_id();
  c.origin = v.stream_key;
  c.members.push_back({v.stream_key, v.blocking, v.ctx});
  S().graphs[c.graph].capturing = true;
  S().capturing_streams[v.stream_key] = c.id;
  S().captures.emplace(c.id, std::move(c));
  active_captures.fetch_add(1, std::memory_order_release);
  return CUDA_SUCCESS;
}

CUresult fake_cuStreamEndCapture(CUstream s, CUgraph* graph_out) {
  if (CUresult r = need_init()) return r;
  if (graph_out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const stream_view v = view_of(s);
  if (v.legacy) return CUDA_ERROR_ILLEGAL_STATE;
  std::lock_guard lock(S().m);
  capture* c = capture_of_locked(v.stream_key);
  if (c == nullptr) return CUDA_ERROR_ILLEGAL_STATE;
  if (c->origin != v.stream_key) {  // a stream that joined the capture, not the one that began it
    c->invalidated = true;
    return CUDA_ERROR_STREAM_CAPTURE_UNMATCHED;
  }
  if (c->mode != CU_STREAM_CAPTURE_MODE_RELAXED && c->began_on != std::this_thread::get_id())
    return CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
  for (const capture_member& m : c->members) S().capturing_streams.erase(m.stream_key);
  const CUgraph graph = c->graph;
  const bool invalidated = c->invalidated;
  const bool member_destroyed = c->member_destroyed;
  S().captures.erase(c->id);
  active_captures.fetch_sub(1, std::memory_order_release);
  auto g = S().graphs.find(graph);
  g->second.capturing = false;
  if (invalidated || member_destroyed) {  // the graph dies with the capture, and its user-object references with it
    destroy_graph_locked(g);
    *graph_out = nullptr;
    return invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
  }
  *graph_out = graph;
  return CUDA_SUCCESS;
}

// The nodes a capture would hang the next one on are not modelled: an active capture reports
// no dependencies. Out-parameters other than the status are written only for an active capture,
// the only case in which the driver promises them.
CUresult capture_info_of(CUstream s, CUstreamCaptureStatus* status, cuuint64_t* id, CUgraph* graph,
                         const CUgraphNode** dependencies, const CUgraphEdgeData** edge_data,
                         std::size_t* dependency_count) {
  if (status == nullptr || (edge_data != nullptr && dependencies == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult r = need_init()) return r;
  // A default stream's handle names the current context's stream: none without a context.
  if (reinterpret_cast<std::uintptr_t>(s) <= 2) {
    if (CUresult r = need_context()) return r;
  }
  if (!any_capture()) {
    *status = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
  }
  const stream_view v = view_of(s);
  std::lock_guard lock(S().m);
  if (v.legacy) {
    if (legacy_conflicts_locked(v.ctx, false)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
    *status = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
  }
  const capture* c = capture_of_locked(v.stream_key);
  if (c == nullptr) {
    *status = CU_STREAM_CAPTURE_STATUS_NONE;
    return CUDA_SUCCESS;
  }
  if (c->invalidated) {
    *status = CU_STREAM_CAPTURE_STATUS_INVALIDATED;
    return CUDA_SUCCESS;
  }
  *status = CU_STREAM_CAPTURE_STATUS_ACTIVE;
  if (id != nullptr) *id = c->id;
  if (graph != nullptr) *graph = c->graph;
  if (dependencies != nullptr) *dependencies = nullptr;
  if (edge_data != nullptr) *edge_data = nullptr;
  if (dependency_count != nullptr) *dependency_count = 0;
  return CUDA_SUCCESS;
}

// The two entry points count as the caller's capture questions (stream_calls); the fake's own
// questions go to capture_info_of directly.
CUresult fake_cuStreamGetCaptureInfo(CUstream s, CUstreamCaptureStatus* status, cuuint64_t* id,
                                     CUgraph* graph, const CUgraphNode** dependencies,
                                     const CUgraphEdgeData** edge_data, std::size_t* dependency_count) {
  ++stream_calls.capture_questions;
  return capture_info_of(s, status, id, graph, dependencies, edge_data, dependency_count);
}
CUresult fake_cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus* status) {
  ++stream_calls.capture_questions;
  return capture_info_of(s, status, nullptr, nullptr, nullptr, nullptr, nullptr);
}

// The calling thread's calls, for the tests that check when streamalloc switches modes
// (fake_cuda_mode_exchanges): per thread, so that the driver's and the reaper's threads, which
// switch modes too, never count.
thread_local long long mode_exchanges = 0;

CUresult fake_cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode* mode) {
  ++mode_exchanges;
  if (CUresult r = need_init()) return r;
  if (mode == nullptr || static_cast<unsigned>(*mode) > CU_STREAM_CAPTURE_MODE_RELAXED)
    return CUDA_ERROR_INVALID_VALUE;
  std::swap(*mode, thread_capture_mode);
  return CUDA_SUCCESS;
}

}  // namespace fake_cuda
