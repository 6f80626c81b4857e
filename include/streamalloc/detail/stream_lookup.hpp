#pragma once

// How a stream handle becomes streamalloc's record of that stream's order: which handles name
// the default streams, asking CUDA a raw handle's id (never a capturing stream's, which CUDA
// refuses), the thread's recent streams, the per-thread default streams a thread met, and the
// record made when a stream is met for the first time. stream.hpp builds stream_ref, stream
// and the events on it.

#include <streamalloc/detail/core/ordering.hpp>
#include <streamalloc/detail/driver/capture.hpp>
#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/error.hpp>

#include <cuda.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace streamalloc::detail {

/// Does handle `s` name the calling thread's own default stream (a different stream on every
/// thread)? `cudaStreamPerThread` always; handle 0 where the code is built with
/// `--default-stream per-thread` (then the driver is asked through its per-thread entry points).
inline bool is_per_thread_handle(CUstream s) noexcept {
#if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
  if (s == nullptr) return true;
#endif
  return s == CU_STREAM_PER_THREAD;
}

/// Does handle `s` name the legacy default stream, the same stream on every thread for the
/// process's life?
inline bool is_legacy_handle(CUstream s) noexcept {
#if !defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
  if (s == nullptr) return true;
#endif
  return s == CU_STREAM_LEGACY;
}

/// The handle that names the same stream as `s` and is not null: a null handle (the default
/// stream, legacy or per-thread as the code is built) as the default stream's own handle,
/// any other as it is. Where null means "no stream" (a pool's synchronous calls), a stream
/// given as null must not be mistaken for it.
inline CUstream explicit_handle(CUstream s) noexcept {
  if (s != nullptr) return s;
  return is_per_thread_handle(s) ? CU_STREAM_PER_THREAD : CU_STREAM_LEGACY;
}

[[noreturn]] STREAMALLOC_COLD inline void throw_unidentified(CUresult r) {
  if (r == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) {
    throw cuda_error(r, "cuStreamGetId",
                     "identifying a stream given by its raw handle: it is being captured into a graph, and CUDA does "
                     "not tell a capturing stream's id. Resolve the stream_ref before the capture (resolved(); not "
                     "possible for the per-thread default stream, whose handle names each thread's own), or use a "
                     "streamalloc::stream, whose identity travels with it");
  }
  if (r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT) {
    throw_capture_problem(r, CU_STREAM_CAPTURE_STATUS_NONE, "identifying a stream", "cuStreamGetId");
  }
  throw_driver_failure(r, "cuStreamGetId", "identifying a stream");
}

/// Refuses the legacy default stream while a blocking stream of its context is being captured
/// (work on it would join that capture implicitly, which CUDA forbids), by asking whether it
/// is capturing: CUDA refuses that question and the id question alike then
/// (CUDA_ERROR_STREAM_CAPTURE_IMPLICIT), but the id question also invalidates the capture, in
/// every capture mode, asked from the capturing thread or another, where the capture question
/// leaves it whole (bench_stream_lookup, one H200, 2026-11-29). So the capture question
/// comes first wherever the legacy stream's id is asked; from a thread with no context, in the
/// context the id question would then make current (is_capturing).
inline void refuse_legacy_during_capture(CUstream s, const char* caller) { (void)is_capturing(s, caller); }

/// The id of the stream a raw handle names now (one driver call; a handle value is no
/// identity: CUDA gives a destroyed stream's handle to the next stream made). For a stream
/// known not to be capturing: CUDA refuses the id of a capturing stream in every capture mode
/// (measured on an H100, driver 580). Asked of any other stream it is allowed while captures
/// run, in other threads at least (measured: bench/stream_lookup.cu, which also asks it in the
/// capturing thread).
inline std::uint64_t uncaptured_stream_id_of(CUstream s) {
  unsigned long long id = 0;
  const CUresult first = cu::cuStreamGetId_nothrow(s, &id);
  if (first == CUDA_SUCCESS) [[likely]] return id;
  if (first == CUDA_ERROR_INVALID_CONTEXT) {
    // The legacy or per-thread default stream of a thread with no context.
    ensure_context(default_stream_device());
  }
  if (const CUresult again = cu::cuStreamGetId_nothrow(s, &id); again != CUDA_SUCCESS) throw_unidentified(again);
  return id;
}

/// As uncaptured_stream_id_of, in relaxed capture mode: where this thread captures in global
/// mode, a refused call would otherwise invalidate that capture. A capturing stream is still
/// refused (a clear cuda_error), and so is the legacy default stream while a blocking stream
/// captures, without breaking that capture (refuse_legacy_during_capture).
inline std::uint64_t stream_id_of(CUstream s) {
  const relaxed_capture_mode relaxed;
  if (is_legacy_handle(s)) refuse_legacy_during_capture(s, "identifying the legacy default stream");
  return uncaptured_stream_id_of(s);
}

/// The records of the last few streams a thread identified by raw handle. PyTorch and CuPy
/// hand the same few raw handles over and over, from several threads; the registry's lookup
/// takes a shared lock whose line every such thread writes. Keyed by stream id, never by
/// handle (see stream_id_of). Each entry holds its record, so a thread keeps at most
/// `size` records of destroyed streams alive, until it identifies newer ones or exits.
class recent_streams {
 public:
  static constexpr std::size_t size = 4;
  [[nodiscard]] stream_record* find(std::uint64_t id) const noexcept {
    for (const entry& e : entries_) {
      if (e.id == id) return e.record.get();
    }
    return nullptr;
  }
  void remember(std::uint64_t id, stream_record& r) noexcept {
    entries_[next_++ % size] = entry{id, record_ref(r)};
  }
  /// The calling thread's.
  static recent_streams& of_this_thread() noexcept {
    thread_local recent_streams recent;
    return recent;
  }

 private:
  struct entry {
    std::uint64_t id = 0;  // stream ids start at 1
    record_ref record;
  };
  std::array<entry, size> entries_{};
  std::size_t next_ = 0;
};

/// The per-thread default streams a thread met, one per context. CUDA destroys them when the
/// thread ends, and from then on no call can name them (the handle names another thread's
/// stream everywhere else), so they are retired then, as a `stream` is when destroyed: a
/// process whose threads come and go keeps records and pool states for the threads alive.
/// Not from the thread's end itself: the driver's and other libraries' thread-local state may
/// be gone by then, so the ids are handed to the registry, which retires them at its next
/// chance (ordering.hpp, note_gone), without using their handles.
class per_thread_streams {
 public:
  static per_thread_streams& of_this_thread() {
    thread_local per_thread_streams streams;
    return streams;
  }
  void add(std::uint64_t id) {
    if (std::find(ids_.begin(), ids_.end(), id) == ids_.end()) ids_.push_back(id);
  }
  per_thread_streams() = default;
  per_thread_streams(const per_thread_streams&) = delete;
  per_thread_streams& operator=(const per_thread_streams&) = delete;
  ~per_thread_streams() {
    for (const std::uint64_t id : ids_) ordering().note_gone(id);
  }

 private:
  std::vector<std::uint64_t> ids_;
};

/// Tells the registry which stream raw handle `s` names: stream `id`, met for the first time. A stream that handle named before is gone, and is retired (ordering.hpp,
/// note_handle). The per-thread default stream's handle names a stream of each thread: it is
/// retired when its thread ends instead. The legacy default stream is never destroyed.
inline void note_stream_handle(CUstream s, std::uint64_t id) {
  ordering().retire_found_gone();  // ended threads' streams, while a new stream is met
  if (is_legacy_handle(s)) return;
  if (is_per_thread_handle(s)) {
    per_thread_streams::of_this_thread().add(id);
    return;
  }
  if (const std::uint64_t gone = ordering().note_handle(s, id); gone != 0) ordering().retire_gone(gone);
}

/// The ordering record of stream `id`, whose handle is `s`, made on first use.
inline stream_record& record_of_stream(CUstream s, std::uint64_t id) {
  stream_record& r = ordering().record(id);
  if (r.device() < 0) {
    // Once per stream: the calls below are not among those measured safe during a capture.
    const relaxed_capture_mode relaxed;
    CUcontext ctx = nullptr;
    cu::cuStreamGetCtx(s, &ctx);
    note_stream_handle(s, id);
    CUdevice d{};
    CUresult res = CUDA_SUCCESS;
    {
      // cuCtxGetDevice answers for the current context: make the stream's current for it.
      scoped_context in_stream_context(ctx);
      res = cu::cuCtxGetDevice_nothrow(&d);
    }
    check(res, "cuCtxGetDevice");
    r.set_context(ctx);
    r.set_device(static_cast<int>(d));
    if (is_legacy_handle(s)) {
      r.mark_handle_stable();
      r.mark_legacy();
    }
  }
  return r;
}

/// The ordering record of a raw stream handle, made on first use: one driver call per use,
/// and no lock for the last few streams the calling thread used. For the per-thread default
/// stream's handle it is the calling thread's stream's record.
inline stream_record& resolve_stream_id(CUstream s, std::uint64_t id) {
  recent_streams& recent = recent_streams::of_this_thread();
  if (stream_record* known = recent.find(id)) [[likely]] return *known;
  stream_record& r = record_of_stream(s, id);
  recent.remember(id, r);
  return r;
}
inline stream_record& resolve_stream(CUstream s) { return resolve_stream_id(s, stream_id_of(s)); }
/// As resolve_stream, for a stream the caller has just found not capturing (the pools'
/// stream-ordered calls): no switch of capture mode around the lookup, two driver calls fewer.
inline stream_record& resolve_uncaptured_stream(CUstream s) { return resolve_stream_id(s, uncaptured_stream_id_of(s)); }

/// The legacy default stream's handle names the legacy stream of whichever context is current.
/// A reference that carries the record of one of them (stream_ref::resolved, and the buffers,
/// resources and arenas made on it) must reach that one, whatever the caller made current
/// since: while this guard lives, the record's context is current, pushed when another is.
/// Other handles name one stream everywhere, and a reference without a record is looked up in
/// the current context: nothing to do for them.
class record_context_scope {
 public:
  /// @throws cuda_error when the driver refuses to tell or change the current context
  record_context_scope(CUstream s, const stream_record* r) {
    if (r == nullptr || !is_legacy_handle(s)) return;
    const auto ctx = static_cast<CUcontext>(r->context());
    if (ctx == nullptr) return;
    CUcontext current = nullptr;
    cu::cuCtxGetCurrent(&current);
    if (current == ctx) return;
    cu::cuCtxPushCurrent(ctx);
    pushed_ = true;
  }
  ~record_context_scope() {
    CUcontext popped = nullptr;
    if (pushed_) (void)cu::cuCtxPopCurrent_nothrow(&popped);
  }
  record_context_scope(const record_context_scope&) = delete;
  record_context_scope& operator=(const record_context_scope&) = delete;

 private:
  bool pushed_ = false;
};

}  // namespace streamalloc::detail
