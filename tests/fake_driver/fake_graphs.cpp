// The fake driver's graphs, executable graphs and user objects, with the driver's
// reference-count rules: graphs built by hand or by a capture, cloned, instantiated,
// launched and uploaded, and the references they and their callers hold.

#include "fake_calls.hpp"
#include "fake_state.hpp"

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <mutex>
#include <vector>

namespace [[gnu::visibility("hidden")]] fake_cuda {

// --- graphs and executable graphs -------------------------------------------------------------

std::atomic<long long> graph_launches{0};
std::atomic<long long> graph_uploads{0};

CUresult fake_cuGraphDestroy(CUgraph graph) {
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto g = S().graphs.find(graph);
  // A capture owns its graph until cuStreamEndCapture hands it over.
  if (g == S().graphs.end() || g->second.capturing) return CUDA_ERROR_INVALID_VALUE;
  destroy_graph_locked(g);
  return CUDA_SUCCESS;
}

// A clone holds references of its own to every user object its original holds.
CUresult fake_cuGraphClone(CUgraph* clone_out, CUgraph original) {
  if (CUresult r = need_init()) return r;
  if (clone_out == nullptr) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(S().m);
  auto g = S().graphs.find(original);
  if (g == S().graphs.end() || g->second.capturing) return CUDA_ERROR_INVALID_VALUE;
  for (const auto& [obj, count] : g->second.refs) S().user_objects.at(obj).refs += count;
  const CUgraph clone = new_graph_handle_locked<CUgraph>();
  fake_graph copy;
  copy.refs = g->second.refs;
  S().graphs[clone] = std::move(copy);
  *clone_out = clone;
  return CUDA_SUCCESS;
}

// Graphs built by hand: empty nodes and their dependencies (what streamalloc's graph
// allocations add and ask), checked as the driver checks them.
CUresult fake_cuGraphCreate(CUgraph* out, unsigned flags) {
  if (CUresult r = need_context()) return r;
  if (out == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(S().m);
  *out = new_graph_handle_locked<CUgraph>();
  S().graphs[*out] = fake_graph{};
  return CUDA_SUCCESS;
}
CUresult fake_cuGraphAddEmptyNode(CUgraphNode* out, CUgraph graph, const CUgraphNode* deps, std::size_t n) {
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto g = S().graphs.find(graph);
  if (out == nullptr || g == S().graphs.end() || g->second.capturing || (n != 0 && deps == nullptr)) {
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (std::size_t i = 0; i < n; ++i) {
    auto d = S().nodes.find(deps[i]);
    if (d == S().nodes.end() || d->second.graph != graph) return CUDA_ERROR_INVALID_VALUE;
  }
  const CUgraphNode node = new_graph_handle_locked<CUgraphNode>();
  S().nodes[node] = fake_node{graph, std::vector<CUgraphNode>(deps, deps + n)};
  g->second.nodes.push_back(node);
  *out = node;
  return CUDA_SUCCESS;
}
CUresult fake_cuGraphNodeGetDependencies(CUgraphNode node, CUgraphNode* deps, CUgraphEdgeData* edges, std::size_t* n) {
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto it = S().nodes.find(node);
  if (it == S().nodes.end() || n == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const auto& d = it->second.dependencies;
  if (deps != nullptr) {
    for (std::size_t i = 0; i < std::min(*n, d.size()); ++i) {
      deps[i] = d[i];
      if (edges != nullptr) edges[i] = CUgraphEdgeData{};
    }
  }
  *n = d.size();
  return CUDA_SUCCESS;
}

CUresult fake_cuGraphInstantiateWithFlags(CUgraphExec* exec_out, CUgraph graph, unsigned long long flags) {
  if (CUresult r = need_context()) return r;
  constexpr unsigned long long valid = CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH |
                                       CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH |
                                       CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY;
  if (exec_out == nullptr || (flags & ~valid) != 0 ||
      ((flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) && (flags & CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH)))
    return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(S().m);
  auto g = S().graphs.find(graph);
  if (g == S().graphs.end() || g->second.capturing) return CUDA_ERROR_INVALID_VALUE;
  // The exec holds references of its own, so the graph may be destroyed while the exec lives.
  for (const auto& [obj, count] : g->second.refs) S().user_objects.at(obj).refs += count;
  const CUgraphExec exec = new_graph_handle_locked<CUgraphExec>();
  S().execs[exec] = fake_exec{flags, g->second.refs};
  *exec_out = exec;
  return CUDA_SUCCESS;
}

CUresult fake_cuGraphExecDestroy(CUgraphExec exec) {
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto x = S().execs.find(exec);
  if (x == S().execs.end()) return CUDA_ERROR_INVALID_VALUE;
  // The device has finished every launch already, so the references go now, not on completion.
  release_all_locked(x->second.refs);
  S().execs.erase(x);
  return CUDA_SUCCESS;
}

// A launch or upload into a stream: counted when it runs; into a capturing stream it becomes part
// of that capture's graph instead.
CUresult submit_exec(CUgraphExec exec, CUstream s, std::atomic<long long>& counter) {
  if (CUresult r = need_init()) return r;
  const stream_view v = view_of(s);
  std::lock_guard lock(S().m);
  if (S().execs.count(exec) == 0) return CUDA_ERROR_INVALID_VALUE;
  if (v.legacy && legacy_conflicts_locked(v.ctx, true)) return CUDA_ERROR_STREAM_CAPTURE_IMPLICIT;
  if (const capture* c = v.legacy ? nullptr : capture_of_locked(v.stream_key))
    return c->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
  ++counter;
  return CUDA_SUCCESS;
}
CUresult fake_cuGraphLaunch(CUgraphExec exec, CUstream s) { return submit_exec(exec, s, graph_launches); }
CUresult fake_cuGraphUpload(CUgraphExec exec, CUstream s) { return submit_exec(exec, s, graph_uploads); }

// --- user objects -----------------------------------------------------------------------------

bool valid_count(unsigned count) { return count != 0 && count <= INT_MAX; }

CUresult fake_cuUserObjectCreate(CUuserObject* out, void* ptr, CUhostFn destroy, unsigned initial_refcount,
                                 unsigned flags) {
  if (CUresult r = need_init()) return r;
  if (out == nullptr || destroy == nullptr || !valid_count(initial_refcount) ||
      flags != CU_USER_OBJECT_NO_DESTRUCTOR_SYNC)
    return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(S().m);
  const CUuserObject obj = new_graph_handle_locked<CUuserObject>();
  S().user_objects[obj] = user_object{ptr, destroy, initial_refcount, initial_refcount};
  *out = obj;
  return CUDA_SUCCESS;
}

CUresult fake_cuUserObjectRetain(CUuserObject obj, unsigned count) {
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto it = S().user_objects.find(obj);
  if (it == S().user_objects.end() || !valid_count(count)) return CUDA_ERROR_INVALID_VALUE;
  it->second.refs += count;
  it->second.caller_refs += count;
  return CUDA_SUCCESS;
}

// Releasing references the callers do not own is undefined in the driver; the fake refuses it.
CUresult fake_cuUserObjectRelease(CUuserObject obj, unsigned count) {
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto it = S().user_objects.find(obj);
  if (it == S().user_objects.end() || !valid_count(count) || count > it->second.caller_refs)
    return CUDA_ERROR_INVALID_VALUE;
  it->second.caller_refs -= count;
  release_user_object_locked(obj, count);
  return CUDA_SUCCESS;
}

// A graph being captured may take references too (through the graph cuStreamGetCaptureInfo
// reports); they pass to the graph cuStreamEndCapture returns, or die with an invalidated capture.
CUresult fake_cuGraphRetainUserObject(CUgraph graph, CUuserObject obj, unsigned count, unsigned flags) {
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto g = S().graphs.find(graph);
  auto it = S().user_objects.find(obj);
  if (g == S().graphs.end() || it == S().user_objects.end() || !valid_count(count) ||
      (flags & ~unsigned{CU_GRAPH_USER_OBJECT_MOVE}) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  if (flags & CU_GRAPH_USER_OBJECT_MOVE) {
    if (count > it->second.caller_refs) return CUDA_ERROR_INVALID_VALUE;
    it->second.caller_refs -= count;
  } else {
    it->second.refs += count;
  }
  g->second.refs[obj] += count;
  return CUDA_SUCCESS;
}

CUresult fake_cuGraphReleaseUserObject(CUgraph graph, CUuserObject obj, unsigned count) {
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto g = S().graphs.find(graph);
  if (g == S().graphs.end() || !valid_count(count)) return CUDA_ERROR_INVALID_VALUE;
  auto held = g->second.refs.find(obj);
  if (held == g->second.refs.end() || held->second < count) return CUDA_ERROR_INVALID_VALUE;
  held->second -= count;
  if (held->second == 0) g->second.refs.erase(held);
  release_user_object_locked(obj, count);
  return CUDA_SUCCESS;
}

}  // namespace fake_cuda
