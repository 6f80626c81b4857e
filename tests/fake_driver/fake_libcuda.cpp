// A fake CUDA driver for streamalloc's CPU tests: a shared library that exports
// cuGetProcAddress_v2 and models the driver calls streamalloc makes, with the bookkeeping the
// real driver keeps (reservations, physical handles, mappings, access), so tests on machines
// without a GPU can check what streamalloc asks of the driver: that each object is released
// exactly once, that moved-from objects release nothing, that lookups happen once.
//
// Stream capture and graphs are modelled too (fake_capture.cpp, fake_graphs.cpp): capture ids,
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
//
// The model is split over the files of this folder, one part each:
//   fake_state.hpp          the state the parts share (S()), the knobs, the current context
//   fake_calls.hpp          every driver call the fake serves, by the file that defines it
//   fake_device.cpp         devices and contexts, error names
//   fake_memory.cpp         reservations, physical memory, mappings, access
//   fake_streams.cpp        streams, events, the context stack
//   fake_capture.cpp        the capture-interaction modes, stream capture
//   fake_driver_thread.cpp  the driver's internal thread, where user-object destructors run
//   fake_graphs.cpp         graphs, executable graphs, user objects
//   fake_libcuda.cpp        (this file) cuGetProcAddress_v2, the table of entry points it
//                           serves, and the fake_cuda_* hooks through which tests read the
//                           bookkeeping

#include "fake_calls.hpp"
#include "fake_state.hpp"

#include <cuda.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

using namespace fake_cuda;

namespace {

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
/// For the tests: the calling thread's cuCtxGetCurrent calls so far.
__attribute__((visibility("default"))) long long fake_cuda_context_queries() { return context_queries; }
/// For the tests: the calling thread's stream-ordered questions and calls so far.
__attribute__((visibility("default"))) fake_stream_call_counts fake_cuda_stream_calls() { return stream_calls; }

/// For the tests: waits until every user-object destructor queued so far has run (the driver
/// runs them asynchronously; this is the synchronization it does not offer).
__attribute__((visibility("default"))) void fake_cuda_quiesce() { quiesce_driver_thread(); }

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
