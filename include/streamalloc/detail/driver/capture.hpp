#pragma once

// Asking whether the stream of a stream-ordered call is being captured into a graph.

#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/error.hpp>

#include <cuda.h>

#include <cstdint>
#include <string>

namespace streamalloc::detail {

/// What cuStreamGetCaptureInfo says of the stream of a stream-ordered call: the id of the
/// capture it is in and the graph being built, or id 0 when it is not capturing.
struct capture_info {
  std::uint64_t id = 0;
  CUgraph graph = nullptr;
};

/// `call`: the driver call that answered `r`.
[[noreturn]] STREAMALLOC_COLD inline void throw_capture_problem(CUresult r, CUstreamCaptureStatus status,
                                                               const char* caller,
                                                               const char* call = "cuStreamGetCaptureInfo") {
  const std::string who = std::string(caller) + ": ";
  if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) {
    throw cuda_error(r, call,
                     who + "the legacy default stream was used while a blocking stream of its device is being "
                           "captured into a graph: its work would join the capture implicitly, which CUDA forbids. "
                           "Use the capturing stream, or a non-blocking stream");
  }
  if (r == CUDA_SUCCESS && status == CU_STREAM_CAPTURE_STATUS_INVALIDATED) {
    throw cuda_error(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, call,
                     who + "the stream's capture was invalidated by an earlier error; end the capture "
                           "(cudaStreamEndCapture reports the error) before using the stream");
  }
  throw_driver_failure(r, call, who + "asking whether the stream is being captured");
}

/// The capture status of `s` (cuStreamGetCaptureInfo), with the capture's id and graph when it
/// is active. Throws only when the driver will not answer (the legacy stream while a blocking
/// stream captures, a destroyed stream); an invalidated capture is a status like another.
STREAMALLOC_COLD inline capture_info capture_status(CUstream s, CUstreamCaptureStatus& status, const char* caller) {
  status = CU_STREAM_CAPTURE_STATUS_NONE;
  capture_info c;
  CUresult r = cu::cuStreamGetCaptureInfo_nothrow(s, &status, &c.id, &c.graph, nullptr, nullptr, nullptr);
  if (r == CUDA_ERROR_INVALID_CONTEXT) {
    // A default stream's handle, on a thread with no context yet: it names device 0's, as a
    // CUDA runtime call there would, or the device the C interface was told.
    ensure_context(default_stream_device());
    r = cu::cuStreamGetCaptureInfo_nothrow(s, &status, &c.id, &c.graph, nullptr, nullptr, nullptr);
  }
  if (r != CUDA_SUCCESS) throw_capture_problem(r, status, caller);
  if (status != CU_STREAM_CAPTURE_STATUS_ACTIVE) return {};  // the driver promises the rest only then
  return c;
}

/// The capture `s` is in, asked in full (cuStreamGetCaptureInfo), once cuStreamIsCapturing
/// said it is in one or failed. Throws for an invalidated capture: nothing may be added to it.
STREAMALLOC_COLD inline capture_info capture_in_full(CUstream s, const char* caller) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  const capture_info c = capture_status(s, status, caller);
  if (status == CU_STREAM_CAPTURE_STATUS_INVALIDATED) throw_capture_problem(CUDA_SUCCESS, status, caller);
  return c;  // empty when the capture ended meanwhile
}

/// Whether stream `s` is being captured into a graph: one driver query, made by every
/// stream-ordered call, because any stream may begin a capture at any time, by code that never
/// heard of streamalloc. The driver takes 25 to 40 ns to answer on an H100 host, a third of the
/// pool's pair (docs/graphs.md, "What detection costs"). The status alone
/// (cuStreamIsCapturing) is asked first; the capture's id and graph only when it is active.
inline capture_info capture_of(CUstream s, const char* caller) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUresult r = cu::cuStreamIsCapturing_nothrow(s, &status);
  if (r == CUDA_SUCCESS && status == CU_STREAM_CAPTURE_STATUS_NONE) [[likely]] return {};
  // The legacy stream while a blocking stream captures: refused here, not asked again.
  if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) throw_capture_problem(r, status, caller, "cuStreamIsCapturing");
  return capture_in_full(s, caller);
}

/// Is `s` being captured into a graph (its capture active, or invalidated and not yet ended)?
/// One cuStreamIsCapturing, which CUDA allows in every capture mode, for the calls that need no
/// capture id. Throws, as capture_of, for a stream CUDA will not answer for: the legacy stream
/// while a blocking stream of its device captures (work on it would join that capture, which
/// CUDA forbids and answers by invalidating it).
inline bool is_capturing(CUstream s, const char* caller) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUresult r = cu::cuStreamIsCapturing_nothrow(s, &status);
  if (r == CUDA_SUCCESS) [[likely]] return status != CU_STREAM_CAPTURE_STATUS_NONE;
  if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) throw_capture_problem(r, status, caller, "cuStreamIsCapturing");
  return capture_in_full(s, caller).id != 0;  // throws unless it was a context missing
}

/// As is_capturing, never throwing: a stream CUDA will not answer for counts as capturing. For
/// a question asked after the fact, where the only safe answer to doubt is "learn nothing".
inline bool may_be_capturing(CUstream s) noexcept {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  return cu::cuStreamIsCapturing_nothrow(s, &status) != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE;
}

}  // namespace streamalloc::detail
