#pragma once

// The driver entry points streamalloc calls, each in two forms:
//   cu::cuMemMap(args...)          throws cuda_error (driver_unavailable when there is no driver)
//   cu::cuMemMap_nothrow(args...)  returns the CUresult; for destructors and probing
// Both go through one cached pointer per function (driver_loader.hpp), found on first use.

#include <streamalloc/detail/driver/driver_loader.hpp>
#include <streamalloc/error.hpp>

#include <cudaTypedefs.h>

#include <string>
#include <string_view>
#include <type_traits>

namespace streamalloc::detail {

/// Throws the exception that fits a failed call. Kept out of line and cold: callers build no
/// message unless this runs.
[[noreturn]] STREAMALLOC_COLD inline void throw_driver_failure(CUresult r, const char* call,
                                                               std::string_view context = {}) {
  const driver_state& d = driver();
  if (d.status != CUDA_SUCCESS) {
    std::string why = d.problem;
    if (!context.empty()) why += std::string("; while ") + std::string(context);
    throw driver_unavailable(d.status, call, why);
  }
  throw cuda_error(r, call, context);
}

/// Throws if `r` is a failure; `context()` builds the message's detail, on failure only.
template <class Context>
void check(CUresult r, const char* call, Context&& context) {
  if (r != CUDA_SUCCESS) [[unlikely]] {
    throw_driver_failure(r, call, std::forward<Context>(context)());
  }
}

inline void check(CUresult r, const char* call) {
  if (r != CUDA_SUCCESS) [[unlikely]] {
    throw_driver_failure(r, call);
  }
}

/// The driver calls the fast paths make that any thread may make during any capture, so that
/// they do not first check for a deferred_relaxed_capture_mode scope to honour: asking whether a
/// stream captures, switching modes (what relaxes), and a stream's id. The id is asked on every
/// call with a raw handle once the stream was found not capturing, which every mode allows
/// (measured, bench_stream_lookup: asked of a stream capturing in global mode it is refused and
/// the capture invalidated), outside the pool core's scopes; stream_id_of, which may be asked of
/// any stream, opens a relaxed scope of its own first. Every other call relaxes the thread first
/// inside such a scope.
constexpr bool capture_mode_free(std::string_view call) noexcept {
  return call == "cuStreamGetCaptureInfo" || call == "cuStreamIsCapturing" ||
         call == "cuThreadExchangeStreamCaptureMode" || call == "cuStreamGetId";
}

/// Puts the calling thread in relaxed capture mode if a deferred_relaxed_capture_mode scope of
/// its own is open and has not yet done so (defined below, after the driver's entry points).
inline void relax_if_deferred() noexcept;

template <class Entry, class... Args>
CUresult invoke_nothrow(Args... args) noexcept {
  if constexpr (Entry::relaxes_deferred) relax_if_deferred();
  CUresult status = CUDA_SUCCESS;
  auto fn = driver_entry<Entry>(status);
  if (fn == nullptr) [[unlikely]] {
    return status;
  }
  return fn(args...);
}

}  // namespace streamalloc::detail

// `#fn` is the name the driver knows (cuMemGetInfo); `&::fn` expands cuda.h's versioning macros
// (cuMemGetInfo -> cuMemGetInfo_v2), giving the signature calls go through. `abi` is the CUDA
// version that introduced that signature: cudaTypedefs.h names it PFN_<fn>_v<abi>, and the
// static_assert fails the build if a future cuda.h declares `fn` differently. `request` is the
// version cuGetProcAddress is asked for: the newest one that still has that signature.
#define STREAMALLOC_DRIVER_FUNCTION(fn, abi, request)                                              \
  struct fn##_entry {                                                                              \
    static constexpr const char* name = #fn;                                                       \
    static constexpr int version = request;                                                        \
    static constexpr bool relaxes_deferred = !::streamalloc::detail::capture_mode_free(#fn);       \
    using pointer = decltype(&::fn);                                                               \
    static_assert(std::is_same_v<pointer, PFN_##fn##_v##abi>,                                      \
                  "cuda.h declares " #fn " with another signature than streamalloc requests");    \
  };                                                                                               \
  template <class... Args>                                                                         \
  CUresult fn##_nothrow(Args... args) noexcept {                                                   \
    return ::streamalloc::detail::invoke_nothrow<fn##_entry>(args...);                             \
  }                                                                                                \
  template <class... Args>                                                                         \
  void fn(Args... args) {                                                                          \
    ::streamalloc::detail::check(::streamalloc::detail::invoke_nothrow<fn##_entry>(args...),       \
                                 fn##_entry::name);                                                \
  }

namespace streamalloc::detail::cu {

STREAMALLOC_DRIVER_FUNCTION(cuDeviceGetCount, 2000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuDeviceGet, 2000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuDeviceGetAttribute, 2000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuDeviceGetName, 2000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuDeviceGetUuid, 11040, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuDevicePrimaryCtxRetain, 7000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuCtxGetCurrent, 4000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuCtxSetCurrent, 4000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuCtxGetDevice, 2000, 12090)
STREAMALLOC_DRIVER_FUNCTION(cuMemGetInfo, 3020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemAddressReserve, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemAddressFree, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemCreate, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemRelease, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemMap, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemUnmap, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemSetAccess, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemGetAccess, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemGetAllocationGranularity, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemGetAllocationPropertiesFromHandle, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemExportToShareableHandle, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemImportFromShareableHandle, 10020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuMemRetainAllocationHandle, 11000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuPointerGetAttribute, 4000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuCtxPushCurrent, 4000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuCtxPopCurrent, 4000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuCtxSynchronize, 2000, 12090)
STREAMALLOC_DRIVER_FUNCTION(cuDeviceCanAccessPeer, 4000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuStreamCreateWithPriority, 5050, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuStreamDestroy, 4000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuStreamGetId, 12000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuStreamGetCtx, 9020, 12040)
STREAMALLOC_DRIVER_FUNCTION(cuStreamSynchronize, 2000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuStreamQuery, 2000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuStreamWaitEvent, 3020, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuEventCreate, 2000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuEventDestroy, 4000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuEventRecord, 2000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuEventQuery, 2000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuEventSynchronize, 2000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuIpcGetEventHandle, 4010, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuIpcOpenEventHandle, 4010, 13000)
// Stream capture and graphs: detecting a capture, the graph it builds, tying memory to it.
STREAMALLOC_DRIVER_FUNCTION(cuStreamGetCaptureInfo, 12030, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuStreamIsCapturing, 10000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuThreadExchangeStreamCaptureMode, 10010, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuStreamBeginCapture, 10010, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuStreamEndCapture, 10000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuGraphInstantiateWithFlags, 11040, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuGraphLaunch, 10000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuGraphUpload, 11010, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuGraphExecDestroy, 10000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuGraphDestroy, 10000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuGraphClone, 10000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuGraphCreate, 10000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuGraphAddEmptyNode, 10000, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuGraphNodeGetDependencies, 12030, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuUserObjectCreate, 11030, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuUserObjectRetain, 11030, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuUserObjectRelease, 11030, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuGraphRetainUserObject, 11030, 13000)
STREAMALLOC_DRIVER_FUNCTION(cuGraphReleaseUserObject, 11030, 13000)

}  // namespace streamalloc::detail::cu

namespace streamalloc::detail {

/// A thread's relaxed capture-mode scopes (relaxed_capture_mode and
/// deferred_relaxed_capture_mode): how many are open, and whether the outermost has put the
/// thread in relaxed mode, with the mode to restore when it closes. Scopes nest strictly (each
/// is an object on one thread's stack), so one record per thread serves them all.
struct capture_mode_scopes {
  unsigned open = 0;
  bool relaxed = false;
  CUstreamCaptureMode saved = CU_STREAM_CAPTURE_MODE_RELAXED;
};
inline capture_mode_scopes& this_thread_capture_mode_scopes() noexcept {
  static thread_local capture_mode_scopes scopes;  // trivial: no guard, no destructor to register
  return scopes;
}

/// Relaxes the calling thread now (its scopes are open; they have not relaxed it yet).
STREAMALLOC_COLD inline void relax_now(capture_mode_scopes& scopes) noexcept {
  scopes.saved = CU_STREAM_CAPTURE_MODE_RELAXED;
  scopes.relaxed = cu::cuThreadExchangeStreamCaptureMode_nothrow(&scopes.saved) == CUDA_SUCCESS;
}

inline void relax_if_deferred() noexcept {
  capture_mode_scopes& scopes = this_thread_capture_mode_scopes();
  if (scopes.open != 0 && !scopes.relaxed) [[unlikely]] relax_now(scopes);
}

/// Puts the calling thread in relaxed capture mode, at the first driver call made while it
/// lives (none: no switch), and back in the mode it had when it goes. While any thread captures
/// a stream in global mode (the default mode), CUDA refuses "potentially unsafe" calls (event
/// queries, stream ids, memory mapping) to every thread in global mode, and the refused call
/// invalidates that capture: streamalloc's own bookkeeping calls, which never touch the
/// captured stream's work, run relaxed. A call on a capturing stream is still captured;
/// streamalloc makes none. Deferred, because the switch and the switch back are two driver
/// calls (26 ns together on an H200, bench_stream_lookup) and the pool's slow path, which runs
/// in such a scope, usually calls the driver not at all (a request served from free blocks).
class deferred_relaxed_capture_mode {
 public:
  deferred_relaxed_capture_mode() noexcept { ++this_thread_capture_mode_scopes().open; }
  ~deferred_relaxed_capture_mode() {
    capture_mode_scopes& scopes = this_thread_capture_mode_scopes();
    if (--scopes.open == 0 && scopes.relaxed) {
      scopes.relaxed = false;
      (void)cu::cuThreadExchangeStreamCaptureMode_nothrow(&scopes.saved);
    }
  }
  deferred_relaxed_capture_mode(const deferred_relaxed_capture_mode&) = delete;
  deferred_relaxed_capture_mode& operator=(const deferred_relaxed_capture_mode&) = delete;
};

/// As deferred_relaxed_capture_mode, relaxed at once: for code that calls the driver through
/// other libraries (the runtime, a graph's launch) as well as through streamalloc's entry points.
class relaxed_capture_mode : deferred_relaxed_capture_mode {
 public:
  relaxed_capture_mode() noexcept { relax_if_deferred(); }
};

}  // namespace streamalloc::detail
