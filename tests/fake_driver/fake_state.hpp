// The fake driver's shared state (see fake_libcuda.cpp for what the fake models): the
// bookkeeping behind S(), the current context, the knobs read from the environment, and what
// the files of the fake share with each other, each declared here and defined in the file
// named above it. Everything is in namespace fake_cuda, which every file opens hidden (the
// attribute holds only where it is written): the library exports only cuGetProcAddress_v2 and
// the fake_cuda_* hooks (fake_libcuda.cpp), whatever the visibility it is compiled with.

#pragma once

#include "fake_stream_calls.hpp"

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace [[gnu::visibility("hidden")]] fake_cuda {

inline constexpr std::size_t granularity = 2u << 20;

inline int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoi(v) : fallback;
}

struct physical {
  std::size_t size = 0;
  CUmemLocation location{};
  unsigned handle_types = 0;
  int handles = 0;   // open handles (create/import/retain) not yet released
  int mappings = 0;  // mapped ranges using it
};

struct mapped {
  std::size_t size = 0;
  CUmemGenericAllocationHandle handle = 0;
  unsigned long long access_flags[8] = {};  // per device
  unsigned long long host_access = 0;
};

// One stream taking part in a capture: the one that began it, or one that joined it by waiting
// on an event recorded in it.
struct capture_member {
  const void* stream_key;  // see stream_view
  bool blocking;           // synchronizes with the legacy stream
  CUcontext ctx;
};

struct capture {
  cuuint64_t id = 0;
  CUgraph graph = nullptr;
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  std::thread::id began_on;
  const void* origin = nullptr;  // the stream it must be ended on
  bool invalidated = false;
  bool member_destroyed = false;  // a stream that joined it was destroyed: its end gives no graph
  std::vector<capture_member> members;  // origin first
};

using user_object_refs = std::map<CUuserObject, unsigned long long>;

struct fake_graph {
  bool capturing = false;  // still being built by a capture: not instantiable, not destroyable
  user_object_refs refs;
  std::vector<CUgraphNode> nodes;  // added by cuGraphAddEmptyNode (captured work has none here)
};

struct fake_node {
  CUgraph graph;
  std::vector<CUgraphNode> dependencies;
};

struct fake_exec {
  unsigned long long flags = 0;
  user_object_refs refs;  // its own copy of its graph's references, taken at instantiation
};

struct user_object {
  void* ptr = nullptr;
  CUhostFn destroy = nullptr;
  unsigned long long refs = 0;         // all references: the callers' and every graph's and exec's
  unsigned long long caller_refs = 0;  // those owned by callers, which Release and MOVE take from
};

struct state {
  std::mutex m;
  std::map<CUdeviceptr, std::size_t> reservations;
  std::map<CUmemGenericAllocationHandle, std::uint64_t> handles;  // handle -> physical id
  std::map<std::uint64_t, physical> physicals;
  std::map<CUdeviceptr, mapped> mappings;
  std::map<int, std::uint64_t> exported_fds;
  std::map<std::string, int> lookups;
  // Above the 47 bits of x86-64 user space: no host pointer (a stack variable, a heap block) can
  // fall in a fake reservation, so tests may hand host addresses as "not pool memory". Starting
  // at 0x7f00'0000'0000, as the real driver does, put the fake ranges among thread stacks and
  // mmap'd libraries, and a test's stack variable once landed inside one.
  CUdeviceptr next_address = 0x9000'0000'0000ULL;
  CUmemGenericAllocationHandle next_handle = 0x1000;
  std::uint64_t next_physical = 1;
  std::size_t used[8] = {};
  bool initialized = false;
  // Stream capture and graphs.
  std::map<cuuint64_t, capture> captures;  // begun and not yet ended
  std::unordered_map<const void*, cuuint64_t> capturing_streams;  // stream key -> capture id
  std::map<CUgraph, fake_graph> graphs;
  std::map<CUgraphNode, fake_node> nodes;
  std::map<CUgraphExec, fake_exec> execs;
  std::map<CUuserObject, user_object> user_objects;
  cuuint64_t next_capture_id = 1;  // 0 is never an id: callers may use it for "none"
  // Graph, exec and user-object handles come from one counter and are never reused, so a handle
  // used after its destroy, or a graph passed as an exec, is refused rather than misread.
  std::uintptr_t next_graph_handle = 0x6a0000000000ULL;
};

inline state& S() {
  static state s;
  return s;
}

// The library is dlopened; its thread-locals use the static TLS block (initial-exec) rather than
// __tls_get_addr, whose dynamic blocks GCC 12's LeakSanitizer misreads at exit on glibc 2.36
// ("Tracer caught signal 11" after every test passed).
[[gnu::tls_model("initial-exec")]] inline thread_local CUcontext current_context = nullptr;
inline CUcontext primary_contexts[8] = {};

inline int devices() { return env_int("FAKE_CUDA_DEVICES", 1); }
inline std::size_t device_memory() {
  const char* v = std::getenv("FAKE_CUDA_DEVICE_MEMORY");
  return v != nullptr ? std::strtoull(v, nullptr, 10) : (8ULL << 30);
}

inline CUresult need_init() { return S().initialized ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED; }

inline bool isolated(int device) {
  const char* v = std::getenv("FAKE_CUDA_NO_PEER");
  if (v == nullptr) return false;
  const std::string list = std::string(",") + v + ",";
  return list.find("," + std::to_string(device) + ",") != std::string::npos;
}
// Can `device` access memory that lives on `peer`? Never its own through this question (the
// driver answers 0 for a device and itself).
inline bool peers(int device, int peer) { return device != peer && !isolated(device) && !isolated(peer); }

// Calls reaching each device's legacy default stream (the handle names the current context's):
// tests check that a pool reaches the legacy stream of the device it meant.
inline std::atomic<long long> legacy_stream_calls[8] = {};
inline std::atomic<long long> set_access_calls{0};
// cuMemMap refused with CUDA_ERROR_OUT_OF_MEMORY, as a device short of memory may: after
// `maps_before_refusal` more succeed, the next `maps_refused` (fake_cuda_refuse_maps).
inline long long maps_before_refusal = 0, maps_refused = 0;

// --- shared between the files: defined in the file named above each group ---------------

// fake_device.cpp
// The device of context `c` (a primary context), or -1.
int device_of(CUcontext c);
void note_legacy_call();
CUresult need_context();

// fake_capture.cpp: capture-interaction modes
extern std::atomic<int> active_captures;
extern std::atomic<long long> unsafe_call_refusals;
bool any_capture();
CUresult refuse_if_unsafe();

// fake_streams.cpp
extern std::atomic<int> live_streams;
extern std::atomic<int> live_events;

// What the capture model needs to know of a stream handle.
struct stream_view {
  bool legacy;             // handle 0 (the fake serves the legacy-stream ABI) or CU_STREAM_LEGACY
  const void* stream_key;  // identity for capture membership; null for the legacy stream
  bool blocking;           // synchronizes with the legacy stream (not CU_STREAM_NON_BLOCKING)
  CUcontext ctx;
};

stream_view view_of(CUstream s);
extern std::mutex held_mutex;
extern std::unordered_map<const void*, unsigned long long> held_streams;  // stream key -> hold number
extern std::atomic<int> holds;
extern std::atomic<unsigned long long> next_hold;
capture* capture_of_locked(const void* stream_key);
bool legacy_conflicts_locked(CUcontext ctx, bool invalidate);
extern std::atomic<void (*)(void*)> next_stream_query_hook;
extern std::atomic<void*> next_stream_query_arg;
extern std::atomic<long long> captured_event_records;
extern std::atomic<void (*)(void*)> next_event_record_hook;
extern std::atomic<void*> next_event_record_arg;
extern std::atomic<void (*)(void*)> next_event_wait_hook;
extern std::atomic<void*> next_event_wait_arg;

// fake_driver_thread.cpp
[[gnu::tls_model("initial-exec")]] extern thread_local bool on_driver_thread;
extern std::atomic<long long> destructors_run;
extern std::atomic<long long> driver_thread_violations;
void post_to_driver_thread(CUhostFn fn, void* arg);
void quiesce_driver_thread();

// fake_capture.cpp: stream capture (the template is defined here: fake_graphs.cpp uses it too)
template <class Handle>
Handle new_graph_handle_locked() {
  S().next_graph_handle += 0x10;
  return reinterpret_cast<Handle>(S().next_graph_handle);
}

void release_user_object_locked(CUuserObject obj, unsigned long long count);
void release_all_locked(const user_object_refs& refs);
void destroy_graph_locked(std::map<CUgraph, fake_graph>::iterator g);
extern thread_local long long mode_exchanges;
extern thread_local long long context_queries;
// The calling thread's stream-ordered questions and calls (fake_cuda_stream_calls), per thread
// as mode_exchanges.
extern thread_local fake_stream_call_counts stream_calls;
// A stream's capture status (cuStreamGetCaptureInfo's answer) without counting a question.
CUresult capture_info_of(CUstream s, CUstreamCaptureStatus* status, cuuint64_t* id = nullptr,
                         CUgraph* graph = nullptr, const CUgraphNode** dependencies = nullptr,
                         const CUgraphEdgeData** edge_data = nullptr, std::size_t* dependency_count = nullptr);

// fake_graphs.cpp
extern std::atomic<long long> graph_launches;
extern std::atomic<long long> graph_uploads;

}  // namespace fake_cuda
