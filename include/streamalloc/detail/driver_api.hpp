#pragma once

// The driver entry points streamalloc calls, each in two forms:
//   cu::cuMemMap(args...)          throws cuda_error (driver_unavailable when there is no driver)
//   cu::cuMemMap_nothrow(args...)  returns the CUresult; for destructors and probing
// Both go through one cached pointer per function (driver_loader.hpp), found on first use.

#include <streamalloc/detail/driver_loader.hpp>
#include <streamalloc/error.hpp>

#include <string>
#include <string_view>

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

template <class Entry, class... Args>
CUresult invoke_nothrow(Args... args) noexcept {
  CUresult status = CUDA_SUCCESS;
  auto fn = driver_entry<Entry>(status);
  if (fn == nullptr) [[unlikely]] {
    return status;
  }
  return fn(args...);
}

}  // namespace streamalloc::detail

// `#fn` is the name the driver knows (cuMemGetInfo); `&::fn` expands cuda.h's versioning macros
// (cuMemGetInfo -> cuMemGetInfo_v2), so the pointer type matches the ABI of the headers, and
// cuGetProcAddress is asked for the same ABI through CUDA_VERSION.
#define STREAMALLOC_DRIVER_FUNCTION(fn)                                                            \
  struct fn##_entry {                                                                              \
    static constexpr const char* name = #fn;                                                       \
    using pointer = decltype(&::fn);                                                               \
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

STREAMALLOC_DRIVER_FUNCTION(cuDeviceGetCount)
STREAMALLOC_DRIVER_FUNCTION(cuDeviceGet)
STREAMALLOC_DRIVER_FUNCTION(cuDeviceGetAttribute)
STREAMALLOC_DRIVER_FUNCTION(cuDeviceGetName)
STREAMALLOC_DRIVER_FUNCTION(cuDevicePrimaryCtxRetain)
STREAMALLOC_DRIVER_FUNCTION(cuCtxGetCurrent)
STREAMALLOC_DRIVER_FUNCTION(cuCtxSetCurrent)
STREAMALLOC_DRIVER_FUNCTION(cuCtxGetDevice)
STREAMALLOC_DRIVER_FUNCTION(cuMemGetInfo)
STREAMALLOC_DRIVER_FUNCTION(cuMemAddressReserve)
STREAMALLOC_DRIVER_FUNCTION(cuMemAddressFree)
STREAMALLOC_DRIVER_FUNCTION(cuMemCreate)
STREAMALLOC_DRIVER_FUNCTION(cuMemRelease)
STREAMALLOC_DRIVER_FUNCTION(cuMemMap)
STREAMALLOC_DRIVER_FUNCTION(cuMemUnmap)
STREAMALLOC_DRIVER_FUNCTION(cuMemSetAccess)
STREAMALLOC_DRIVER_FUNCTION(cuMemGetAccess)
STREAMALLOC_DRIVER_FUNCTION(cuMemGetAllocationGranularity)
STREAMALLOC_DRIVER_FUNCTION(cuMemGetAllocationPropertiesFromHandle)
STREAMALLOC_DRIVER_FUNCTION(cuMemExportToShareableHandle)
STREAMALLOC_DRIVER_FUNCTION(cuMemImportFromShareableHandle)
STREAMALLOC_DRIVER_FUNCTION(cuMemRetainAllocationHandle)
STREAMALLOC_DRIVER_FUNCTION(cuPointerGetAttribute)

}  // namespace streamalloc::detail::cu
