// A fake CUDA driver for streamalloc's CPU tests: a shared library that exports
// cuGetProcAddress_v2 and models the driver calls streamalloc makes, with the bookkeeping the
// real driver keeps (reservations, physical handles, mappings, access), so tests on machines
// without a GPU can check what streamalloc asks of the driver: that each object is released
// exactly once, that moved-from objects release nothing, that lookups happen once.
//
// Stream capture and graphs are modelled too (the section "stream capture" below): capture ids,
// fork and join through events, the capture-interaction modes that refuse unsafe calls, graphs,
// executable graphs and user objects with the driver's reference-count rules, whose destructors
// run on a driver thread of their own. Tests read the bookkeeping through the fake_cuda_* hooks.
//
// It is a model, not the driver: the GPU tests check the real one. Environment knobs:
//   FAKE_CUDA_DRIVER_VERSION  reported version (default 13000)
//   FAKE_CUDA_INIT_RESULT     what cuInit returns (default 0)
//   FAKE_CUDA_DEVICES         device count (default 1, at most 8)
//   FAKE_CUDA_NO_PEER         devices that are no other device's peer, comma-separated ("2" or
//                             "0,2"): cuDeviceCanAccessPeer says 0 for every pair with one of
//                             them, and cuMemSetAccess refuses to open device memory across such
//                             a pair (the others are all peers of each other)
//   FAKE_CUDA_NO_VMM          1: devices report no VMM support, cuMemCreate fails
//   FAKE_CUDA_NO_POSIX_FD     1: devices cannot export POSIX file descriptors
//   FAKE_CUDA_MISSING         a symbol cuGetProcAddress reports as not found
//   FAKE_CUDA_DEVICE_MEMORY   bytes of memory per device (default 8 GiB)
//   FAKE_CUDA_ADDRESS_SPACE   bytes of virtual addresses the process may reserve (default 64 TiB)

#include <cuda.h>

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

constexpr std::size_t granularity = 2u << 20;

int env_int(const char* name, int fallback) {
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

state& S() {
  static state s;
  return s;
}

// The library is dlopened; its thread-locals use the static TLS block (initial-exec) rather than
// __tls_get_addr, whose dynamic blocks GCC 12's LeakSanitizer misreads at exit on glibc 2.36
// ("Tracer caught signal 11" after every test passed).
[[gnu::tls_model("initial-exec")]] thread_local CUcontext current_context = nullptr;
CUcontext primary_contexts[8] = {};

int devices() { return env_int("FAKE_CUDA_DEVICES", 1); }
std::size_t device_memory() {
  const char* v = std::getenv("FAKE_CUDA_DEVICE_MEMORY");
  return v != nullptr ? std::strtoull(v, nullptr, 10) : (8ULL << 30);
}

CUresult need_init() { return S().initialized ? CUDA_SUCCESS : CUDA_ERROR_NOT_INITIALIZED; }

bool isolated(int device) {
  const char* v = std::getenv("FAKE_CUDA_NO_PEER");
  if (v == nullptr) return false;
  const std::string list = std::string(",") + v + ",";
  return list.find("," + std::to_string(device) + ",") != std::string::npos;
}
// Can `device` access memory that lives on `peer`? Never its own through this question (the
// driver answers 0 for a device and itself).
bool peers(int device, int peer) { return device != peer && !isolated(device) && !isolated(peer); }

// Calls reaching each device's legacy default stream (the handle names the current context's):
// tests check that a pool reaches the legacy stream of the device it meant.
std::atomic<long long> legacy_stream_calls[8] = {};
std::atomic<long long> set_access_calls{0};
// cuMemMap refused with CUDA_ERROR_OUT_OF_MEMORY, as a device short of memory may: after
// `maps_before_refusal` more succeed, the next `maps_refused` (fake_cuda_refuse_maps).
long long maps_before_refusal = 0, maps_refused = 0;

// --- device and context -------------------------------------------------------------------

CUresult fake_cuInit(unsigned flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  CUresult r = static_cast<CUresult>(env_int("FAKE_CUDA_INIT_RESULT", 0));
  if (r == CUDA_SUCCESS) S().initialized = true;
  return r;
}
CUresult fake_cuDriverGetVersion(int* v) {
  if (v == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *v = env_int("FAKE_CUDA_DRIVER_VERSION", 13000);
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGetCount(int* n) {
  if (CUresult r = need_init()) return r;
  *n = devices();
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGet(CUdevice* d, int ordinal) {
  if (CUresult r = need_init()) return r;
  if (ordinal < 0 || ordinal >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGetName(char* name, int len, CUdevice d) {
  if (d < 0 || d >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  std::snprintf(name, static_cast<std::size_t>(len), "Fake GPU %d", d);
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceGetAttribute(int* v, CUdevice_attribute a, CUdevice d) {
  if (CUresult r = need_init()) return r;
  if (d < 0 || d >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  switch (a) {
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *v = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *v = env_int("FAKE_CUDA_NO_VMM", 0) ? 0 : 1; break;
    case CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: *v = env_int("FAKE_CUDA_NO_POSIX_FD", 0) ? 0 : 1; break;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID: *v = 0; break;
    case CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: *v = 1; break;
    default: *v = 0; break;
  }
  return CUDA_SUCCESS;
}
CUresult fake_cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
  if (CUresult r = need_init()) return r;
  if (d < 0 || d >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  *c = reinterpret_cast<CUcontext>(&primary_contexts[d]);
  return CUDA_SUCCESS;
}
CUresult fake_cuCtxGetCurrent(CUcontext* c) {
  if (CUresult r = need_init()) return r;
  *c = current_context;
  return CUDA_SUCCESS;
}
CUresult fake_cuCtxSetCurrent(CUcontext c) {
  if (CUresult r = need_init()) return r;
  current_context = c;
  return CUDA_SUCCESS;
}
CUresult fake_cuCtxGetDevice(CUdevice* d) {
  if (current_context == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  *d = static_cast<CUdevice>(reinterpret_cast<CUcontext*>(current_context) - primary_contexts);
  return CUDA_SUCCESS;
}
CUresult fake_cuDeviceCanAccessPeer(int* can, CUdevice d, CUdevice peer) {
  if (CUresult r = need_init()) return r;
  if (can == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (d < 0 || d >= devices() || peer < 0 || peer >= devices()) return CUDA_ERROR_INVALID_DEVICE;
  *can = peers(d, peer) ? 1 : 0;
  return CUDA_SUCCESS;
}
// The device of context `c` (a primary context), or -1.
int device_of(CUcontext c) {
  const auto* p = reinterpret_cast<CUcontext*>(c);
  return p >= primary_contexts && p < primary_contexts + 8 ? static_cast<int>(p - primary_contexts) : -1;
}
void note_legacy_call() {
  const int d = device_of(current_context);
  if (d >= 0) ++legacy_stream_calls[d];
}
CUresult need_context() {
  if (CUresult r = need_init()) return r;
  return current_context != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

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

CUresult fake_cuGetErrorName(CUresult r, const char** s) {
  switch (r) {
    case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; return CUDA_SUCCESS;
    case CUDA_ERROR_NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_PERMITTED: *s = "CUDA_ERROR_NOT_PERMITTED"; return CUDA_SUCCESS;
    case CUDA_ERROR_ILLEGAL_STATE: *s = "CUDA_ERROR_ILLEGAL_STATE"; return CUDA_SUCCESS;
    case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: *s = "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"; return CUDA_SUCCESS;
    case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: *s = "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"; return CUDA_SUCCESS;
    case CUDA_ERROR_STREAM_CAPTURE_MERGE: *s = "CUDA_ERROR_STREAM_CAPTURE_MERGE"; return CUDA_SUCCESS;
    case CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: *s = "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED"; return CUDA_SUCCESS;
    case CUDA_ERROR_STREAM_CAPTURE_ISOLATION: *s = "CUDA_ERROR_STREAM_CAPTURE_ISOLATION"; return CUDA_SUCCESS;
    case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: *s = "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT"; return CUDA_SUCCESS;
    case CUDA_ERROR_CAPTURED_EVENT: *s = "CUDA_ERROR_CAPTURED_EVENT"; return CUDA_SUCCESS;
    case CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: *s = "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"; return CUDA_SUCCESS;
    default: *s = nullptr; return CUDA_ERROR_INVALID_VALUE;
  }
}
CUresult fake_cuGetErrorString(CUresult r, const char** s) {
  switch (r) {
    case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; return CUDA_SUCCESS;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory"; return CUDA_SUCCESS;
    default: *s = "fake driver error"; return CUDA_SUCCESS;
  }
}

// --- memory -------------------------------------------------------------------------------

std::size_t& used_on(const CUmemLocation& l) {
  return S().used[l.type == CU_MEM_LOCATION_TYPE_DEVICE ? l.id : 7];
}

CUresult fake_cuMemGetInfo(std::size_t* free, std::size_t* total) {
  if (CUresult r = need_context()) return r;
  std::lock_guard lock(S().m);
  CUdevice d = 0;
  fake_cuCtxGetDevice(&d);
  *total = device_memory();
  *free = *total - S().used[d];
  return CUDA_SUCCESS;
}

CUresult fake_cuMemGetAllocationGranularity(std::size_t* g, const CUmemAllocationProp* p,
                                            CUmemAllocationGranularity_flags) {
  if (CUresult r = need_context()) return r;
  if (p == nullptr || g == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (p->location.type == CU_MEM_LOCATION_TYPE_DEVICE && (p->location.id < 0 || p->location.id >= devices()))
    return CUDA_ERROR_INVALID_DEVICE;
  *g = granularity;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressReserve(CUdeviceptr* p, std::size_t size, std::size_t alignment,
                                  CUdeviceptr hint, unsigned long long flags) {
  if (CUresult r = need_context()) return r;
  if (CUresult r = refuse_if_unsafe()) return r;
  if (size == 0 || size % 4096 != 0 || flags != 0 || (alignment & (alignment - 1)) != 0)
    return CUDA_ERROR_INVALID_VALUE;
  const char* space = std::getenv("FAKE_CUDA_ADDRESS_SPACE");
  const std::size_t limit = space != nullptr && *space != '\0' ? std::strtoull(space, nullptr, 10) : (1ULL << 46);
  std::lock_guard lock(S().m);
  std::size_t reserved = 0;
  for (const auto& [at, bytes] : S().reservations) reserved += bytes;
  if (size > limit - std::min(limit, reserved)) return CUDA_ERROR_OUT_OF_MEMORY;
  std::size_t align = alignment > granularity ? alignment : granularity;
  // The hint is honoured when the range there is free, as the driver usually does.
  if (hint != 0 && hint % align == 0) {
    auto next = S().reservations.lower_bound(hint);
    const bool free_after = next == S().reservations.end() || next->first >= hint + size;
    const bool free_before = next == S().reservations.begin() || std::prev(next)->first + std::prev(next)->second <= hint;
    if (free_after && free_before) {
      S().reservations[hint] = size;
      if (hint + size + granularity > S().next_address) S().next_address = hint + size + granularity;
      *p = hint;
      return CUDA_SUCCESS;
    }
  }
  CUdeviceptr a = (S().next_address + align - 1) / align * align;
  S().next_address = a + size + granularity;  // a guard gap, so ranges never touch
  S().reservations[a] = size;
  *p = a;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemAddressFree(CUdeviceptr p, std::size_t size) {
  if (CUresult r = need_context()) return r;
  std::lock_guard lock(S().m);
  auto it = S().reservations.find(p);
  if (it == S().reservations.end() || it->second != size) return CUDA_ERROR_INVALID_VALUE;
  auto m = S().mappings.lower_bound(p);
  if (m != S().mappings.end() && m->first < p + size) return CUDA_ERROR_INVALID_VALUE;  // still mapped
  S().reservations.erase(it);
  return CUDA_SUCCESS;
}

void maybe_free(std::uint64_t id) {
  auto it = S().physicals.find(id);
  if (it != S().physicals.end() && it->second.handles == 0 && it->second.mappings == 0) {
    used_on(it->second.location) -= it->second.size;
    S().physicals.erase(it);
  }
}

CUresult fake_cuMemCreate(CUmemGenericAllocationHandle* h, std::size_t size,
                          const CUmemAllocationProp* p, unsigned long long flags) {
  if (CUresult r = need_context()) return r;
  if (CUresult r = refuse_if_unsafe()) return r;
  if (p == nullptr || flags != 0 || size == 0 || size % granularity != 0) return CUDA_ERROR_INVALID_VALUE;
  if (env_int("FAKE_CUDA_NO_VMM", 0)) return CUDA_ERROR_NOT_SUPPORTED;
  if (p->location.type == CU_MEM_LOCATION_TYPE_DEVICE && (p->location.id < 0 || p->location.id >= devices()))
    return CUDA_ERROR_INVALID_DEVICE;
  if ((p->requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) && env_int("FAKE_CUDA_NO_POSIX_FD", 0))
    return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(S().m);
  if (used_on(p->location) + size > device_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
  used_on(p->location) += size;
  std::uint64_t id = S().next_physical++;
  S().physicals[id] = physical{size, p->location, static_cast<unsigned>(p->requestedHandleTypes), 1, 0};
  *h = S().next_handle++;
  S().handles[*h] = id;
  return CUDA_SUCCESS;
}

// Unmapping and releasing need no current context: the real driver (580, H100) accepts both
// from a thread that never made one, and the pool gives memory back from any thread.
CUresult fake_cuMemRelease(CUmemGenericAllocationHandle h) {
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto it = S().handles.find(h);
  if (it == S().handles.end()) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t id = it->second;
  S().handles.erase(it);
  S().physicals[id].handles--;
  maybe_free(id);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemMap(CUdeviceptr p, std::size_t size, std::size_t offset,
                       CUmemGenericAllocationHandle h, unsigned long long flags) {
  if (CUresult r = need_context()) return r;
  if (CUresult r = refuse_if_unsafe()) return r;
  if (flags != 0 || size == 0 || p % granularity != 0 || size % granularity != 0 || offset % granularity != 0)
    return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard lock(S().m);
  auto hit = S().handles.find(h);
  if (hit == S().handles.end()) return CUDA_ERROR_INVALID_HANDLE;
  physical& ph = S().physicals[hit->second];
  if (offset > ph.size || size > ph.size - offset) return CUDA_ERROR_INVALID_VALUE;
  auto r = S().reservations.upper_bound(p);
  if (r == S().reservations.begin()) return CUDA_ERROR_INVALID_VALUE;
  --r;
  if (p < r->first || p + size > r->first + r->second) return CUDA_ERROR_INVALID_VALUE;
  auto next = S().mappings.lower_bound(p);
  if (next != S().mappings.end() && next->first < p + size) return CUDA_ERROR_INVALID_VALUE;
  if (next != S().mappings.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second.size > p) return CUDA_ERROR_INVALID_VALUE;
  }
  if (maps_refused != 0 && maps_before_refusal != 0) {
    --maps_before_refusal;
  } else if (maps_refused != 0) {
    --maps_refused;
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  S().mappings[p] = mapped{size, h};
  ph.mappings++;
  // the mapping refers to the physical memory, not the handle value
  S().mappings[p].handle = static_cast<CUmemGenericAllocationHandle>(hit->second);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemUnmap(CUdeviceptr p, std::size_t size) {  // no context needed (see cuMemRelease)
  if (CUresult r = need_init()) return r;
  std::lock_guard lock(S().m);
  auto it = S().mappings.find(p);
  if (it == S().mappings.end() || it->second.size != size) return CUDA_ERROR_INVALID_VALUE;
  std::uint64_t id = it->second.handle;
  S().mappings.erase(it);
  S().physicals[id].mappings--;
  maybe_free(id);
  return CUDA_SUCCESS;
}

// Every mapping inside [p, p + size), which must be covered without gaps; null if not.
template <class F>
CUresult for_each_mapping(CUdeviceptr p, std::size_t size, F f) {
  CUdeviceptr at = p;
  auto it = S().mappings.upper_bound(p);
  if (it == S().mappings.begin()) return CUDA_ERROR_INVALID_VALUE;
  --it;
  if (it->first + it->second.size <= p) return CUDA_ERROR_INVALID_VALUE;
  while (at < p + size) {
    if (it == S().mappings.end() || it->first > at) return CUDA_ERROR_INVALID_VALUE;
    f(it->second);
    at = it->first + it->second.size;
    ++it;
  }
  return CUDA_SUCCESS;
}

CUresult fake_cuMemSetAccess(CUdeviceptr p, std::size_t size, const CUmemAccessDesc* d, std::size_t n) {
  if (CUresult r = need_context()) return r;
  ++set_access_calls;
  std::lock_guard lock(S().m);
  for (std::size_t i = 0; i < n; ++i) {
    if (d[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE && (d[i].location.id < 0 || d[i].location.id >= devices()))
      return CUDA_ERROR_INVALID_DEVICE;
  }
  CUresult covered = for_each_mapping(p, size, [](mapped&) {});
  if (covered != CUDA_SUCCESS) return covered;
  // A device given access to another device's memory must be its peer (the driver's check,
  // made only over memory that is mapped: hence the trap of granting on an empty pool).
  bool refused = false;
  (void)for_each_mapping(p, size, [&](mapped& m) {
    const CUmemLocation& where = S().physicals[m.handle].location;
    if (where.type != CU_MEM_LOCATION_TYPE_DEVICE) return;
    for (std::size_t i = 0; i < n; ++i) {
      if (d[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE && d[i].flags != CU_MEM_ACCESS_FLAGS_PROT_NONE &&
          d[i].location.id != where.id && !peers(d[i].location.id, where.id)) {
        refused = true;
      }
    }
  });
  if (refused) return CUDA_ERROR_INVALID_DEVICE;
  return for_each_mapping(p, size, [&](mapped& m) {
    for (std::size_t i = 0; i < n; ++i) {
      if (d[i].location.type == CU_MEM_LOCATION_TYPE_DEVICE)
        m.access_flags[d[i].location.id] = d[i].flags;
      else
        m.host_access = d[i].flags;
    }
  });
}

CUresult fake_cuMemGetAccess(unsigned long long* flags, const CUmemLocation* l, CUdeviceptr p) {
  if (CUresult r = need_context()) return r;
  std::lock_guard lock(S().m);
  return for_each_mapping(p, 1, [&](mapped& m) {
    *flags = l->type == CU_MEM_LOCATION_TYPE_DEVICE ? m.access_flags[l->id] : m.host_access;
  });
}

CUresult fake_cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp* p, CUmemGenericAllocationHandle h) {
  std::lock_guard lock(S().m);
  auto it = S().handles.find(h);
  if (it == S().handles.end()) return CUDA_ERROR_INVALID_VALUE;
  const physical& ph = S().physicals[it->second];
  *p = CUmemAllocationProp{};
  p->type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p->location = ph.location;
  p->requestedHandleTypes = static_cast<CUmemAllocationHandleType>(ph.handle_types);
  return CUDA_SUCCESS;
}

CUresult fake_cuMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h,
                                           CUmemAllocationHandleType type, unsigned long long) {
  std::lock_guard lock(S().m);
  auto it = S().handles.find(h);
  if (it == S().handles.end()) return CUDA_ERROR_INVALID_VALUE;
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR ||
      !(S().physicals[it->second].handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    return CUDA_ERROR_INVALID_VALUE;
  int fd = ::eventfd(0, EFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
  S().exported_fds[fd] = it->second;
  *static_cast<int*>(out) = fd;
  return CUDA_SUCCESS;
}

CUresult fake_cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os_handle,
                                             CUmemAllocationHandleType type) {
  if (CUresult r = need_context()) return r;
  std::lock_guard lock(S().m);
  int fd = static_cast<int>(reinterpret_cast<std::intptr_t>(os_handle));
  auto it = S().exported_fds.find(fd);
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || it == S().exported_fds.end() ||
      S().physicals.count(it->second) == 0)
    return CUDA_ERROR_INVALID_VALUE;
  S().physicals[it->second].handles++;
  *h = S().next_handle++;
  S().handles[*h] = it->second;
  return CUDA_SUCCESS;
}

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

// What the capture model needs to know of a stream handle.
struct stream_view {
  bool legacy;             // handle 0 (the fake serves the legacy-stream ABI) or CU_STREAM_LEGACY
  const void* stream_key;  // identity for capture membership; null for the legacy stream
  bool blocking;           // synchronizes with the legacy stream (not CU_STREAM_NON_BLOCKING)
  CUcontext ctx;
};

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
    // A capture keeps its streams by address; destroying one in the middle would leave the
    // capture naming a dead stream, so the fake refuses and invalidates the capture.
    std::lock_guard lock(S().m);
    if (capture* c = capture_of_locked(s)) {
      c->invalidated = true;
      return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
  }
  {
    std::lock_guard lock(spare_streams_mutex);
    spare_streams.push_back(reinterpret_cast<fake_stream*>(s));
  }
  --live_streams;
  return CUDA_SUCCESS;
}
CUresult fake_cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus* status);
CUresult fake_cuStreamGetId(CUstream s, unsigned long long* id) {
  const auto v = reinterpret_cast<std::uintptr_t>(s);
  if (v <= 2) {  // the default streams of the current context: other streams in each context
    if (CUresult r = need_context()) return r;
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    if (s == CU_STREAM_PER_THREAD && fake_cuStreamIsCapturing(s, &status) == CUDA_SUCCESS &&
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
    *id = 1 + v + 4 * device;
    return CUDA_SUCCESS;
  }
  // As measured on the H100 (driver 580): refused for a capturing stream, in every mode.
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (fake_cuStreamIsCapturing(s, &status) == CUDA_SUCCESS && status != CU_STREAM_CAPTURE_STATUS_NONE) {
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
  const CUresult r = host_waits_for_event(e);
  return r == CUDA_SUCCESS && event_held(e) ? CUDA_ERROR_NOT_READY : r;
}
CUresult fake_cuEventSynchronize(CUevent e) {
  const CUresult r = host_waits_for_event(e);
  if (r == CUDA_SUCCESS && event_held(e)) let_go(event_of(e).held_on.load());  // the host waits: it runs
  return r;
}

// --- the driver's internal thread: user-object destructors run there --------------------------

// The real driver runs user-object destructors asynchronously on an internal thread, and they
// may not call CUDA. The fake does the same with one worker and a queue, so a test sees a
// destructor that assumed it runs on the releasing thread, or that calls the driver.
[[gnu::tls_model("initial-exec")]] thread_local bool on_driver_thread = false;
std::atomic<long long> destructors_run{0};
std::atomic<long long> driver_thread_violations{0};

class driver_thread {
 public:
  // Built after S(), so destroyed before it: no destructor still running can outlive the state.
  driver_thread() { (void)S(); }

  // Joined at library unload (process exit: the library is never closed), after the queue is
  // drained, so the sanitizers see no thread left running. A forked child has no worker.
  ~driver_thread() {
    if (worker_ == nullptr || owner_ != ::getpid()) return;
    {
      std::lock_guard lock(m_);
      stopping_ = true;
    }
    work_.notify_all();
    worker_->join();
    delete worker_;
  }

  void post(CUhostFn fn, void* arg) {
    std::lock_guard lock(m_);
    if (worker_ == nullptr) {  // started on first use: tests without user objects start no thread
      owner_ = ::getpid();
      worker_ = new std::thread([this] { run(); });
    }
    queue_.emplace_back(fn, arg);
    work_.notify_one();
  }

  void quiesce() {
    std::unique_lock lock(m_);
    idle_.wait(lock, [&] { return queue_.empty() && !running_; });
  }

 private:
  void run() {
    on_driver_thread = true;
    std::unique_lock lock(m_);
    for (;;) {
      work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and nothing left to run
      auto [fn, arg] = queue_.front();
      queue_.pop_front();
      running_ = true;
      lock.unlock();  // a destructor may take its own locks, or post (through a release) again
      fn(arg);
      ++destructors_run;
      lock.lock();
      running_ = false;
      if (queue_.empty()) idle_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable work_;
  std::condition_variable idle_;
  std::deque<std::pair<CUhostFn, void*>> queue_;
  bool running_ = false;
  bool stopping_ = false;
  std::thread* worker_ = nullptr;  // a pointer, so a forked child can leave it unjoined
  pid_t owner_ = 0;
};

driver_thread& D() {
  static driver_thread d;
  return d;
}

// --- stream capture ---------------------------------------------------------------------------

template <class Handle>
Handle new_graph_handle_locked() {
  S().next_graph_handle += 0x10;
  return reinterpret_cast<Handle>(S().next_graph_handle);
}

void release_user_object_locked(CUuserObject obj, unsigned long long count) {
  auto it = S().user_objects.find(obj);
  it->second.refs -= count;
  if (it->second.refs == 0) {
    D().post(it->second.destroy, it->second.ptr);
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
  S().captures.erase(c->id);
  active_captures.fetch_sub(1, std::memory_order_release);
  auto g = S().graphs.find(graph);
  g->second.capturing = false;
  if (invalidated) {  // the graph dies with the capture, and its user-object references with it
    destroy_graph_locked(g);
    *graph_out = nullptr;
    return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
  }
  *graph_out = graph;
  return CUDA_SUCCESS;
}

// The nodes a capture would hang the next one on are not modelled: an active capture reports
// no dependencies. Out-parameters other than the status are written only for an active capture,
// the only case in which the driver promises them.
CUresult fake_cuStreamGetCaptureInfo(CUstream s, CUstreamCaptureStatus* status, cuuint64_t* id,
                                     CUgraph* graph, const CUgraphNode** dependencies,
                                     const CUgraphEdgeData** edge_data, std::size_t* dependency_count) {
  if (status == nullptr || (edge_data != nullptr && dependencies == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult r = need_init()) return r;
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

CUresult fake_cuStreamIsCapturing(CUstream s, CUstreamCaptureStatus* status) {
  return fake_cuStreamGetCaptureInfo(s, status, nullptr, nullptr, nullptr, nullptr, nullptr);
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

// The real driver hands out a newer ABI under the same name when asked for a new enough
// version (cuStreamGetCtx_v2 from 12.5, cuCtxGetDevice_v2 and cuCtxSynchronize_v2 from 13.0).
// These stand-ins for the newer ABIs fail loudly, so a loader asking for the wrong version is
// caught on machines without a GPU.
CUresult fake_newer_abi() { return CUDA_ERROR_NOT_SUPPORTED; }
struct versioned {
  const char* name;
  int since;
};
constexpr versioned newer_abis[] = {{"cuStreamGetCtx", 12050}, {"cuCtxGetDevice", 13000}, {"cuCtxSynchronize", 13000}};

// Likewise for older ABIs: asked for a version before `since`, the driver hands out an older
// signature under the same name (cuStreamGetCaptureInfo without edge data before 12.3, and with
// neither graph nor dependencies before 11.3; cuStreamBeginCapture without a mode before 10.1).
CUresult fake_older_abi() { return CUDA_ERROR_NOT_SUPPORTED; }
constexpr versioned older_abis[] = {
    {"cuStreamGetCaptureInfo", 12030}, {"cuStreamBeginCapture", 10010}, {"cuGraphNodeGetDependencies", 12030}};

struct symbol {
  const char* name;
  void* fn;
};

// Every entry point, seen from the driver thread: a user-object destructor may not call CUDA,
// so a call from there is counted and refused instead of served.
template <auto Fn>
struct refused_on_driver_thread;
template <class... Args, CUresult (*Fn)(Args...)>
struct refused_on_driver_thread<Fn> {
  static CUresult call(Args... args) {
    if (on_driver_thread) [[unlikely]] {
      ++driver_thread_violations;
      return CUDA_ERROR_NOT_PERMITTED;
    }
    return Fn(args...);
  }
};

#define FAKE(name) symbol{#name, reinterpret_cast<void*>(&refused_on_driver_thread<&fake_##name>::call)}
const symbol symbols[] = {
    FAKE(cuInit), FAKE(cuDriverGetVersion), FAKE(cuDeviceGetCount), FAKE(cuDeviceGet),
    FAKE(cuDeviceGetName), FAKE(cuDeviceGetAttribute), FAKE(cuDevicePrimaryCtxRetain),
    FAKE(cuCtxGetCurrent), FAKE(cuCtxSetCurrent), FAKE(cuCtxGetDevice), FAKE(cuDeviceCanAccessPeer), FAKE(cuGetErrorName),
    FAKE(cuGetErrorString), FAKE(cuMemGetInfo), FAKE(cuMemGetAllocationGranularity),
    FAKE(cuMemAddressReserve), FAKE(cuMemAddressFree), FAKE(cuMemCreate), FAKE(cuMemRelease),
    FAKE(cuMemMap), FAKE(cuMemUnmap), FAKE(cuMemSetAccess), FAKE(cuMemGetAccess),
    FAKE(cuMemGetAllocationPropertiesFromHandle), FAKE(cuMemExportToShareableHandle),
    FAKE(cuMemImportFromShareableHandle), FAKE(cuCtxPushCurrent), FAKE(cuCtxPopCurrent),
    FAKE(cuCtxSynchronize), FAKE(cuStreamCreateWithPriority), FAKE(cuStreamDestroy),
    FAKE(cuStreamGetId), FAKE(cuStreamGetCtx), FAKE(cuStreamSynchronize), FAKE(cuStreamQuery),
    FAKE(cuStreamWaitEvent), FAKE(cuEventCreate), FAKE(cuEventDestroy), FAKE(cuEventRecord),
    FAKE(cuEventQuery), FAKE(cuEventSynchronize), FAKE(cuStreamGetCaptureInfo),
    FAKE(cuStreamIsCapturing), FAKE(cuThreadExchangeStreamCaptureMode), FAKE(cuStreamBeginCapture),
    FAKE(cuStreamEndCapture), FAKE(cuGraphInstantiateWithFlags), FAKE(cuGraphLaunch),
    FAKE(cuGraphUpload), FAKE(cuGraphExecDestroy), FAKE(cuGraphDestroy), FAKE(cuGraphClone), FAKE(cuUserObjectCreate),
    FAKE(cuUserObjectRetain), FAKE(cuUserObjectRelease), FAKE(cuGraphRetainUserObject),
    FAKE(cuGraphReleaseUserObject), FAKE(cuGraphCreate), FAKE(cuGraphAddEmptyNode),
    FAKE(cuGraphNodeGetDependencies),
};
#undef FAKE

}  // namespace

extern "C" {

__attribute__((visibility("default"))) CUresult cuGetProcAddress_v2(
    const char* name, void** fn, int version, cuuint64_t, CUdriverProcAddressQueryResult* status) {
  if (on_driver_thread) ++driver_thread_violations;  // served all the same: it calls no entry point
  {
    std::lock_guard lock(S().m);
    S().lookups[name]++;
  }
  const char* missing = std::getenv("FAKE_CUDA_MISSING");
  for (const versioned& v : newer_abis) {
    if (std::strcmp(v.name, name) == 0 && version >= v.since) {
      *fn = reinterpret_cast<void*>(&fake_newer_abi);
      if (status) *status = CU_GET_PROC_ADDRESS_SUCCESS;
      return CUDA_SUCCESS;
    }
  }
  for (const versioned& v : older_abis) {
    if (std::strcmp(v.name, name) == 0 && version < v.since) {
      *fn = reinterpret_cast<void*>(&fake_older_abi);
      if (status) *status = version >= 12000 ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      return CUDA_SUCCESS;
    }
  }
  for (const symbol& s : symbols) {
    if (std::strcmp(s.name, name) == 0 && !(missing != nullptr && std::strcmp(missing, name) == 0)) {
      *fn = s.fn;
      if (status) *status = version >= 12000 ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
      return CUDA_SUCCESS;
    }
  }
  *fn = nullptr;
  if (status) *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return CUDA_ERROR_NOT_FOUND;
}

/// For the tests: how many objects the fake driver holds now.
struct fake_cuda_counts {
  int reservations;
  int handles;
  int physicals;
  int mappings;
  std::size_t used_device0;
  int streams;
  int events;
};

__attribute__((visibility("default"))) fake_cuda_counts fake_cuda_live() {
  std::lock_guard lock(S().m);
  return {static_cast<int>(S().reservations.size()), static_cast<int>(S().handles.size()),
          static_cast<int>(S().physicals.size()), static_cast<int>(S().mappings.size()),
          S().used[0], live_streams.load(), live_events.load()};
}

/// For the tests: the stream-capture and graph bookkeeping. Alive counts are objects that exist
/// now; the others count events since the library was loaded.
struct fake_cuda_graph_counts {
  int active_captures;  ///< begun and not yet ended, invalidated ones included
  int graphs;           ///< graphs alive, those still being captured included
  int execs;            ///< executable graphs alive
  int user_objects;     ///< user objects with references left
  long long destructors_run;                ///< user-object destructors run on the driver thread
  long long launches;                       ///< cuGraphLaunch calls that ran (not captured ones)
  long long uploads;                        ///< cuGraphUpload calls likewise
  long long captured_event_records;         ///< cuEventRecord calls captured into a graph
  long long unsafe_call_refusals;           ///< calls refused with CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
  long long destructor_thread_violations;   ///< driver calls made from a user-object destructor
};

__attribute__((visibility("default"))) fake_cuda_graph_counts fake_cuda_graphs() {
  std::lock_guard lock(S().m);
  return {active_captures.load(),
          static_cast<int>(S().graphs.size()),
          static_cast<int>(S().execs.size()),
          static_cast<int>(S().user_objects.size()),
          destructors_run.load(),
          graph_launches.load(),
          graph_uploads.load(),
          captured_event_records.load(),
          unsafe_call_refusals.load(),
          driver_thread_violations.load()};
}

/// For the tests: the calling thread's cuThreadExchangeStreamCaptureMode calls so far.
__attribute__((visibility("default"))) long long fake_cuda_mode_exchanges() { return mode_exchanges; }

/// For the tests: waits until every user-object destructor queued so far has run (the driver
/// runs them asynchronously; this is the synchronization it does not offer).
__attribute__((visibility("default"))) void fake_cuda_quiesce() { D().quiesce(); }

/// For the tests: all references `obj` has now (its callers', graphs' and execs'), or -1 once
/// they are all gone.
__attribute__((visibility("default"))) long long fake_cuda_user_object_refs(CUuserObject obj) {
  std::lock_guard lock(S().m);
  auto it = S().user_objects.find(obj);
  return it == S().user_objects.end() ? -1 : static_cast<long long>(it->second.refs);
}

/// For the tests: the flags `exec` was instantiated with, or -1 if there is no such exec.
__attribute__((visibility("default"))) long long fake_cuda_exec_flags(CUgraphExec exec) {
  std::lock_guard lock(S().m);
  auto it = S().execs.find(exec);
  return it == S().execs.end() ? -1 : static_cast<long long>(it->second.flags);
}

/// For the tests: mappings whose access for `device` (-1: the host) is `flags` now.
__attribute__((visibility("default"))) int fake_cuda_mappings_with_access(int device, unsigned long long flags) {
  std::lock_guard lock(S().m);
  int n = 0;
  for (const auto& [at, m] : S().mappings) {
    const unsigned long long f = device < 0 ? m.host_access : m.access_flags[device];
    n += f == flags ? 1 : 0;
  }
  return n;
}

/// For the tests: after `after` more cuMemMap calls succeed, the next `count` are refused with
/// CUDA_ERROR_OUT_OF_MEMORY (0, 0: none is).
__attribute__((visibility("default"))) void fake_cuda_refuse_maps(long long after, long long count) {
  std::lock_guard lock(S().m);
  maps_before_refusal = after;
  maps_refused = count;
}

/// For the tests: `hook(arg)` runs once, inside the next cuEventQuery or cuEventSynchronize,
/// before it answers (as if another thread acted while the host waited).
__attribute__((visibility("default"))) void fake_cuda_before_next_event_wait(void (*hook)(void*), void* arg) {
  next_event_wait_arg = arg;
  next_event_wait_hook = hook;
}

/// For the tests: `hook(arg)` runs once, inside the next cuEventRecord, before it records.
__attribute__((visibility("default"))) void fake_cuda_before_next_event_record(void (*hook)(void*), void* arg) {
  next_event_record_arg = arg;
  next_event_record_hook = hook;
}

/// For the tests: `hook(arg)` runs once, inside the next cuStreamQuery, before it answers.
__attribute__((visibility("default"))) void fake_cuda_before_next_stream_query(void (*hook)(void*), void* arg) {
  next_stream_query_arg = arg;
  next_stream_query_hook = hook;
}

/// For the tests: holds stream `s` busy (`hold`) or lets it go: while held, cuStreamQuery on it
/// and cuEventQuery of events recorded on it answer CUDA_ERROR_NOT_READY; a host wait for it
/// (cuStreamSynchronize, cuEventSynchronize, cuCtxSynchronize) lets it go.
__attribute__((visibility("default"))) void fake_cuda_hold_stream(CUstream s, bool hold) {
  const void* key = view_of(s).stream_key;
  std::lock_guard lock(held_mutex);
  if (hold) {
    if (held_streams.emplace(key, next_hold++).second) ++holds;
  } else if (held_streams.erase(key) != 0) {
    --holds;
  }
}

/// For the tests: cuMemSetAccess calls since the library was loaded.
__attribute__((visibility("default"))) long long fake_cuda_set_access_calls() { return set_access_calls.load(); }

/// For the tests: calls that reached device `device`'s legacy default stream (cuEventRecord,
/// cuStreamQuery, cuStreamSynchronize on the legacy handle with that device's context current).
__attribute__((visibility("default"))) long long fake_cuda_legacy_stream_calls(int device) {
  return device >= 0 && device < 8 ? legacy_stream_calls[device].load() : 0;
}

/// For the tests: how many times cuGetProcAddress was asked for `name`.
__attribute__((visibility("default"))) int fake_cuda_lookups(const char* name) {
  std::lock_guard lock(S().m);
  auto it = S().lookups.find(name);
  return it == S().lookups.end() ? 0 : it->second;
}
}
