// The fake driver's devices and contexts: initialization, device count and attributes, peer
// access, the primary contexts and the current one; and the names of error codes.

#include "fake_calls.hpp"
#include "fake_state.hpp"

#include <cuda.h>

#include <cstdio>

namespace [[gnu::visibility("hidden")]] fake_cuda {

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
// The calling thread's cuCtxGetCurrent calls (fake_cuda_context_queries), per thread as
// mode_exchanges.
thread_local long long context_queries = 0;
thread_local fake_stream_call_counts stream_calls{};

CUresult fake_cuCtxGetCurrent(CUcontext* c) {
  ++context_queries;
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

}  // namespace fake_cuda
