#pragma once

/// @file
/// @brief Streams and events through which streamalloc learns the order of work.
///
/// `stream` / `stream_ref` and `event` / `event_ref` wrap CUDA's handles. Recording an event,
/// waiting on one, or synchronizing the host through them tells streamalloc's pools what is
/// ordered after what, so memory freed on one stream can be reused on another without waiting
/// for the device. Work ordered with raw CUDA calls stays correct; it only gets less reuse.

#include <streamalloc/detail/driver/capture.hpp>
#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/detail/core/ordering.hpp>
#include <streamalloc/detail/stream_lookup.hpp>
#include <streamalloc/error.hpp>
#include <streamalloc/ordering.hpp>

#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace streamalloc {

class event_ref;

namespace detail {

/// An event's last record through streamalloc: what waiting on it proves.
struct event_state {
  std::mutex mutex;
  clock_snapshot point;
  clock_snapshot next;        // the record being made: becomes `point` once the driver has it
  std::uint64_t records = 0;  // records made: a host wait proves the point it read only if none came between
};
}  // namespace detail

/**
 * @brief A non-owning, trivially copyable reference to a CUDA stream.
 *
 * Made explicitly from a `cudaStream_t` or a `cuda::stream_ref`; an integer or `nullptr` is
 * rejected at compile time (`stream_ref(0)` reads like "stream 0" but would silently mean the
 * legacy default stream: say `stream_ref::legacy_default()`). A `stream_ref` taken from a
 * streamalloc `stream` carries the stream's identity, so pools need no driver call to look it
 * up; one made from a raw handle asks the driver (`cuStreamGetId`, about 50 ns) when used.
 * @code
 * cudaStream_t s;
 * cudaStreamCreate(&s);
 * streamalloc::stream_ref ref{s};
 * ref.synchronize();   // like cudaStreamSynchronize, and the pools learn of it
 * @endcode
 */
class stream_ref {
 public:
  /// Views `stream`.
  constexpr explicit stream_ref(cudaStream_t stream) noexcept : stream_(stream) {}
  /// Views a CCCL stream reference.
  explicit stream_ref(::cuda::stream_ref s) noexcept : stream_(s.get()) {}
  // Rejected, with the hint on the line compilers quote for a deleted function. A template, so
  // that it takes integers only: g++ reports a plain `stream_ref(int)` for a raw cudaStream_t
  // passed where a stream_ref is wanted, whose hint about integers would mislead.
  /// Rejected: an integer is not a stream. Use `legacy_default()` for stream 0.
  template <std::integral I>
  stream_ref(I) = delete;  // an integer is not a stream: stream_ref::legacy_default() is stream 0
  /// Rejected: say `legacy_default()` or `per_thread_default()`.
  stream_ref(std::nullptr_t) = delete;  // not a stream: stream_ref::legacy_default() or per_thread_default()

  /// The legacy default stream (handle 0), which synchronizes with other blocking streams.
  [[nodiscard]] static stream_ref legacy_default() noexcept { return stream_ref(cudaStreamLegacy); }
  /// The calling thread's default stream.
  [[nodiscard]] static stream_ref per_thread_default() noexcept {
    return stream_ref(cudaStreamPerThread);
  }

  /// The underlying handle.
  [[nodiscard]] constexpr cudaStream_t get() const noexcept { return stream_; }
  /// Explicit conversion back to the CUDA handle.
  constexpr explicit operator cudaStream_t() const noexcept { return stream_; }
  /// Explicit conversion to CCCL's stream reference.
  explicit operator ::cuda::stream_ref() const noexcept { return ::cuda::stream_ref(stream_); }

  /// Same handle.
  friend constexpr bool operator==(stream_ref a, stream_ref b) noexcept { return a.stream_ == b.stream_; }

  /**
   * @brief Makes work enqueued on this stream from now on wait for `e`'s last record
   * (`cudaStreamWaitEvent`); the pools learn this stream is ordered after it.
   * @return the proof that this stream runs after the stream `e` was recorded on, up to the
   *         record (for `stream_buffer::set_stream` and friends)
   * @throws cuda_error
   */
  stream_order wait(event_ref e) const;

  /**
   * @brief Blocks the host until the stream's work is done (`cudaStreamSynchronize`). Memory
   * freed on it before the call is then reusable by every stream, and pools apply their
   * release thresholds.
   * @return the proof that the host saw this stream's work, up to the call, finish
   * @throws cuda_error
   */
  host_order synchronize() const {
    const detail::record_context_scope in_its_context(stream_, record_);
    detail::stream_record& r = record();
    const std::uint64_t point = r.begin_synchronize();
    detail::check(detail::cu::cuStreamSynchronize_nothrow(stream_), "cuStreamSynchronize");
    detail::ordering().complete_stream(r, point);
    return host_order(r.id(), -1, point);
  }

  /// True if all the stream's work is done (`cudaStreamQuery`); then as `synchronize()`.
  /// @throws cuda_error for errors other than "not ready"
  [[nodiscard]] bool query() const {
    const detail::record_context_scope in_its_context(stream_, record_);
    detail::stream_record& r = record();
    const std::uint64_t point = r.begin_synchronize();
    const CUresult res = detail::cu::cuStreamQuery_nothrow(stream_);
    if (res == CUDA_ERROR_NOT_READY) return false;
    detail::check(res, "cuStreamQuery");
    detail::ordering().complete_stream(r, point);
    return true;
  }

  /// The stream's process-unique id (`cudaStreamGetId`).
  [[nodiscard]] std::uint64_t id() const { return record().id(); }
  /// The device the stream belongs to.
  [[nodiscard]] int device() const { return record().device(); }

  /// The same stream, carrying its identity: later uses make no driver call to look it up
  /// (one `cuStreamGetId` now, for a reference made from a raw handle). The per-thread default
  /// stream's handle is left as it is: it names the stream of whichever thread uses it, so it
  /// is looked up again on each use.
  [[nodiscard]] stream_ref resolved() const {
    if (detail::is_per_thread_handle(stream_) || record_ != nullptr) return *this;
    // A stream being captured into a graph cannot be asked its id (CUDA refuses it, whatever
    // the capture mode): it is looked up when used after the capture.
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    if (detail::cu::cuStreamIsCapturing_nothrow(stream_, &status) == CUDA_SUCCESS &&
        status != CU_STREAM_CAPTURE_STATUS_NONE) {
      return *this;
    }
    return stream_ref(stream_, &record());
  }

  /// The ordering record this reference carries, without looking it up (null for a reference
  /// made from a raw handle and not resolved).
  [[nodiscard]] detail::stream_record* known_record() const noexcept { return record_; }

  /// streamalloc's ordering record of this stream (for the per-thread default stream, the
  /// calling thread's).
  [[nodiscard]] detail::stream_record& record() const {
    return record_ != nullptr ? *record_ : detail::resolve_stream(stream_);
  }

 private:
  friend class stream;
  stream_ref(cudaStream_t s, detail::stream_record* r) noexcept : stream_(s), record_(r) {}
  stream_order wait_in_capture(event_ref e) const;

  cudaStream_t stream_;
  detail::stream_record* record_ = nullptr;
};

namespace detail {
/// The context of the stream `s` names, for calls that must be made in it: for a legacy
/// reference that carries its record, the context the record was made in (the handle itself
/// names the current context's legacy stream); otherwise the driver's answer.
/// @throws cuda_error
inline CUcontext context_of(stream_ref s) {
  if (const stream_record* r = s.known_record(); r != nullptr && r->context() != nullptr && is_legacy_handle(s.get())) {
    return static_cast<CUcontext>(r->context());
  }
  CUcontext ctx = nullptr;
  check(cu::cuStreamGetCtx_nothrow(s.get(), &ctx), "cuStreamGetCtx");
  return ctx;
}
}  // namespace detail

/// How a new `stream` relates to the legacy default stream.
enum class stream_flags : unsigned {
  non_blocking = CU_STREAM_NON_BLOCKING,  ///< runs concurrently with the legacy default stream
  blocking = CU_STREAM_DEFAULT,           ///< synchronizes with it
};

/**
 * @brief An owned CUDA stream, destroyed on destruction. Converts to `stream_ref`.
 *
 * The fastest way to give streams to a pool: it carries its identity, so allocation on it
 * makes no driver call.
 * @code
 * streamalloc::stream s(0);                   // non-blocking, on device 0
 * void* p = pool.allocate(1 << 20, s);
 * @endcode
 */
class stream {
 public:
  /// Creates a stream on `device` (-1: device 0 unless the thread has a current context).
  /// @throws std::invalid_argument for a negative device other than -1
  /// @throws cuda_error
  explicit stream(int device = -1, stream_flags flags = stream_flags::non_blocking, int priority = 0) {
    if (device < -1) [[unlikely]] {
      throw std::invalid_argument("streamalloc::stream: device " + std::to_string(device) +
                                  " is not a device ordinal (-1 means the current context's device)");
    }
    CUcontext current = nullptr;
    detail::cu::cuCtxGetCurrent(&current);
    CUcontext target = current;
    if (device >= 0 || current == nullptr) target = detail::primary_context(device < 0 ? 0 : device);
    CUstream s = nullptr;
    CUresult r = CUDA_SUCCESS;
    {
      // A stream belongs to the context current when it is made.
      detail::scoped_context in_target(target);
      r = detail::cu::cuStreamCreateWithPriority_nothrow(&s, static_cast<unsigned>(flags), priority);
    }
    detail::check(r, "cuStreamCreateWithPriority");
    stream_ = s;
    try {
      // Not through the thread's recent streams: they would keep this stream's record alive
      // after it is destroyed.
      record_ = detail::record_ref(detail::record_of_stream(s, detail::stream_id_of(s)));
      record_->mark_handle_stable();  // valid until reset() retires it
    } catch (...) {
      (void)detail::cu::cuStreamDestroy_nothrow(s);
      throw;
    }
  }

  /// Takes over `o`'s stream; `o` is left empty (moved from).
  stream(stream&& o) noexcept : stream_(std::exchange(o.stream_, nullptr)), record_(std::move(o.record_)) {}
  /// Destroys this stream (as the destructor does), then takes over `o`'s.
  stream& operator=(stream&& o) noexcept {
    if (this != &o) {
      reset();
      stream_ = std::exchange(o.stream_, nullptr);
      record_ = std::move(o.record_);
    }
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  ~stream() { reset(); }

  /// A reference carrying the stream's identity (pools look nothing up).
  [[nodiscard]] stream_ref ref() const noexcept { return stream_ref(stream_, record_.get()); }
  /// As `ref()`: a `stream` is passed wherever a `stream_ref` is taken.
  operator stream_ref() const noexcept { return ref(); }  // NOLINT: an owner views as its ref
  /// The CUDA handle, for kernel launches and CUDA calls.
  [[nodiscard]] cudaStream_t get() const noexcept { return stream_; }
  /// As `stream_ref::wait`: orders later work after `e`, and returns the proof.
  stream_order wait(event_ref e) const;
  /// As `stream_ref::synchronize`: waits for the stream's work; the pools learn of it.
  host_order synchronize() const { return ref().synchronize(); }
  /// As `stream_ref::query`: has all the stream's work finished?
  [[nodiscard]] bool query() const { return ref().query(); }
  /// The device the stream belongs to.
  /// @throws std::logic_error for a moved-from stream
  [[nodiscard]] int device() const {
    if (!record_) [[unlikely]] throw std::logic_error("streamalloc::stream::device: the stream was moved from");
    return record_->device();
  }

 private:
  void reset() noexcept {
    if (stream_ == nullptr) return;
    // Pools stop recording events on the stream once it is gone (its id never returns).
    detail::ordering().forget_handle(stream_, record_->id());
    detail::ordering().retire(record_->id());
    (void)detail::cu::cuStreamDestroy_nothrow(stream_);
    stream_ = nullptr;
    record_.reset();  // the record goes once the pools and buffers holding it let go too
  }

  cudaStream_t stream_ = nullptr;
  detail::record_ref record_;
};

/**
 * @brief A non-owning reference to a CUDA event.
 *
 * Taken from a streamalloc `event`, it carries what the event's last record proves; made from
 * a raw `cudaEvent_t`, waiting on it orders the work but tells the pools nothing.
 */
class event_ref {
 public:
  /// Views `e` (made explicitly: an integer or nullptr is not an event).
  constexpr explicit event_ref(cudaEvent_t e) noexcept : event_(e) {}
  event_ref(int) = delete;
  event_ref(std::nullptr_t) = delete;

  /// The CUDA handle.
  [[nodiscard]] constexpr cudaEvent_t get() const noexcept { return event_; }
  /// The CUDA handle, explicitly.
  constexpr explicit operator cudaEvent_t() const noexcept { return event_; }
  /// Do both view the same event?
  friend constexpr bool operator==(event_ref a, event_ref b) noexcept { return a.event_ == b.event_; }

  /// Records the event on `s` (`cudaEventRecord`).
  /// @throws cuda_error
  void record(stream_ref s) const {
    detail::stream_record* r = s.known_record();
    const detail::record_context_scope in_its_context(s.get(), r);
    if (state_ == nullptr) {
      detail::check(detail::cu::cuEventRecord_nothrow(event_, s.get()), "cuEventRecord");
      return;
    }
    // Before the lock: meeting a stream may retire another.
    // Asked first of a raw handle, whose id CUDA tells only of a stream that is not capturing,
    // and of the legacy stream, which CUDA refuses (invalidating the capture) while a blocking
    // stream of its device captures: is_capturing throws then, before CUDA sees the record.
    if (r == nullptr || detail::is_legacy_handle(s.get())) {
      if (detail::is_capturing(s.get(), "streamalloc::event::record")) [[unlikely]] return record_in_capture(s);
      if (r == nullptr) r = &detail::resolve_uncaptured_stream(s.get());
    }
    std::lock_guard lock(state_->mutex);
    r->capture_into(state_->next);  // into storage kept for it: no allocation per record
    detail::check(detail::cu::cuEventRecord_nothrow(event_, s.get()), "cuEventRecord");
    ++state_->records;
    // Recorded into a capture (this thread's, or one another thread began on the stream since
    // it was last asked), the event marks no point of the stream's work: see record_in_capture.
    if (detail::may_be_capturing(s.get())) [[unlikely]] return forget_point();
    std::swap(state_->point, state_->next);
  }

  /// Blocks the host until the event's last record has executed (`cudaEventSynchronize`).
  /// @return the proof that the host saw the recording stream's work, up to the record, finish
  /// @throws cuda_error
  host_order synchronize() const {
    const seen before = snapshot();
    detail::check(detail::cu::cuEventSynchronize_nothrow(event_), "cuEventSynchronize");
    const detail::clock_snapshot& point = completed(before);
    return host_order(point.stream, -1, point.epoch);
  }

  /// True if the last record has executed (`cudaEventQuery`).
  /// @throws cuda_error for errors other than "not ready"
  [[nodiscard]] bool query() const {
    const seen before = snapshot();
    const CUresult r = detail::cu::cuEventQuery_nothrow(event_);
    if (r == CUDA_ERROR_NOT_READY) return false;
    detail::check(r, "cuEventQuery");
    (void)completed(before);
    return true;
  }

 private:
  friend class event;
  friend class stream_ref;
  event_ref(cudaEvent_t e, detail::event_state* st) noexcept : event_(e), state_(st) {}

  // Recorded into a capture, the event marks a point of the graph being built (work captured
  // later may depend on it), not a point of the stream's work: the graph runs whenever, and into whichever stream, it is launched. A
  // stream that waits on it joins the capture, and is ordered after nothing in real time, so
  // the event proves nothing from now on. (CUDA refuses to synchronize with or query it.)
  STREAMALLOC_COLD void record_in_capture(stream_ref s) const {
    std::lock_guard lock(state_->mutex);
    detail::check(detail::cu::cuEventRecord_nothrow(event_, s.get()), "cuEventRecord");
    ++state_->records;
    forget_point();
  }
  /// The event proves nothing from now on (its state's mutex held).
  void forget_point() const noexcept {
    state_->point.stream = 0;
    state_->point.epoch = 0;
    state_->point.after.clear();
  }

  /// The event's last record as the host read it before waiting for it.
  struct seen {
    detail::clock_snapshot point;
    std::uint64_t records = 0;
  };
  seen snapshot() const {
    if (state_ == nullptr) return {};
    std::lock_guard lock(state_->mutex);
    return {state_->point, state_->records};
  }
  /// The host saw the event's record done: the pools learn `before`'s point, which is returned,
  /// if no record came since it was read (the driver waits for the record current when it is
  /// asked, which may be another thread's newer one, perhaps on another stream); else nothing.
  const detail::clock_snapshot& completed(const seen& before) const {
    static const detail::clock_snapshot nothing{};
    if (before.point.stream == 0) return nothing;
    {
      std::lock_guard lock(state_->mutex);
      if (state_->records != before.records) return nothing;
    }
    detail::ordering().complete(before.point);
    detail::ordering().notify(before.point.stream);
    return before.point;
  }

  cudaEvent_t event_;
  detail::event_state* state_ = nullptr;
};

/// An interprocess event as another process opens it (`event::export_ipc`, `event::import_ipc`):
/// 64 opaque bytes, trivially copyable.
struct ipc_event_handle {
  CUipcEventHandle native{};  ///< the driver's handle
};

/**
 * @brief An owned CUDA event (timing disabled by default), destroyed on destruction.
 *
 * Recording it on stream A and waiting on it from stream B, through streamalloc, lets pools
 * reuse on B memory freed on A before the record:
 * @code
 * streamalloc::event e;
 * pool.deallocate(p, a);
 * e.record(a);
 * b.wait(e);
 * void* q = pool.allocate(n, b);   // may reuse p's memory, with no device synchronization
 * @endcode
 */
class event {
 public:
  /// Creates an event in the current context (device 0's if the thread has none).
  explicit event(bool timing = false) : state_(std::make_unique<detail::event_state>()) {
    detail::ensure_context(0);
    detail::check(detail::cu::cuEventCreate_nothrow(&event_, timing ? CU_EVENT_DEFAULT : CU_EVENT_DISABLE_TIMING),
                  "cuEventCreate");
  }

  /**
   * @brief An event other processes can wait on and record (timing disabled, as CUDA requires
   * of interprocess events), in the current context (device 0's if the thread has none).
   *
   * Imported pointers do not wait for the exporter's work, nor the exporter for the
   * importer's: an interprocess event recorded after the writes and waited on by the reader is
   * how each side orders its work after the other's (`export_ipc`, `import_ipc`).
   */
  [[nodiscard]] static event interprocess() {
    event e(adopt_tag{}, nullptr);
    detail::ensure_context(0);
    detail::check(detail::cu::cuEventCreate_nothrow(&e.event_, CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING),
                  "cuEventCreate", [] { return "an interprocess event"; });
    return e;
  }
  /**
   * @brief What another process passes to `import_ipc` to use this event: 64 bytes, sent by
   * any means.
   * @throws std::invalid_argument for an event not made by `interprocess()`
   */
  [[nodiscard]] ipc_event_handle export_ipc() const {
    ipc_event_handle h;
    const CUresult r = detail::cu::cuIpcGetEventHandle_nothrow(&h.native, event_);
    if (r == CUDA_ERROR_INVALID_VALUE || r == CUDA_ERROR_INVALID_HANDLE) {
      throw std::invalid_argument("streamalloc::event::export_ipc: the event was not made by event::interprocess()");
    }
    detail::check(r, "cuIpcGetEventHandle");
    return h;
  }
  /**
   * @brief Opens an interprocess event another process exported. Recording it here and
   * waiting on it there (or the other way round) orders work across the two processes; the
   * pools of this process learn nothing from it (stream order within a process is theirs,
   * across processes it is the user's).
   * @throws std::invalid_argument for a handle the driver does not know (not exported, or
   *         its event destroyed): CUDA reports CUDA_ERROR_INVALID_VALUE
   * @throws cuda_error otherwise (a handle exported by this same process is refused:
   *         CUDA_ERROR_INVALID_CONTEXT)
   */
  [[nodiscard]] static event import_ipc(const ipc_event_handle& h) {
    event e(adopt_tag{}, nullptr);
    detail::ensure_context(0);
    const CUresult r = detail::cu::cuIpcOpenEventHandle_nothrow(&e.event_, h.native);
    if (r == CUDA_ERROR_INVALID_VALUE) {
      throw std::invalid_argument("streamalloc::event::import_ipc: the driver knows no event by that handle (not "
                                  "exported, or destroyed by its process)");
    }
    detail::check(r, "cuIpcOpenEventHandle");
    return e;
  }
  /// Takes over `o`'s event; `o` is left empty.
  event(event&& o) noexcept : event_(std::exchange(o.event_, nullptr)), state_(std::move(o.state_)) {}
  /// Destroys this event, then takes over `o`'s.
  event& operator=(event&& o) noexcept {
    if (this != &o) {
      reset();
      event_ = std::exchange(o.event_, nullptr);
      state_ = std::move(o.state_);
    }
    return *this;
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  ~event() { reset(); }

  /// A reference carrying what streamalloc knows of the event.
  [[nodiscard]] event_ref ref() const noexcept { return event_ref(event_, state_.get()); }
  /// As `ref()`: an `event` is passed wherever an `event_ref` is taken.
  operator event_ref() const noexcept { return ref(); }  // NOLINT: an owner views as its ref
  /// The CUDA handle.
  [[nodiscard]] cudaEvent_t get() const noexcept { return event_; }
  /// As `event_ref::record`.
  void record(stream_ref s) const { ref().record(s); }
  /// As `event_ref::synchronize`.
  host_order synchronize() const { return ref().synchronize(); }
  /// As `event_ref::query`.
  [[nodiscard]] bool query() const { return ref().query(); }

 private:
  void reset() noexcept {
    if (event_ != nullptr) (void)detail::cu::cuEventDestroy_nothrow(event_);
    event_ = nullptr;
  }
  struct adopt_tag {};
  event(adopt_tag, cudaEvent_t e) : event_(e), state_(std::make_unique<detail::event_state>()) {}

  cudaEvent_t event_ = nullptr;
  std::unique_ptr<detail::event_state> state_;
};

inline stream_order stream_ref::wait(event_ref e) const {
  detail::stream_record* known = record_;
  const detail::record_context_scope in_its_context(stream_, known);
  if (known == nullptr || detail::is_legacy_handle(stream_)) {  // asked first, as in event_ref::record
    if (detail::is_capturing(stream_, "streamalloc::stream_ref::wait")) [[unlikely]] return wait_in_capture(e);
    if (known == nullptr) known = &detail::resolve_uncaptured_stream(stream_);
  }
  detail::stream_record& r = *known;
  if (e.state_ == nullptr) {
    detail::check(detail::cu::cuStreamWaitEvent_nothrow(stream_, e.event_, 0), "cuStreamWaitEvent");
    return stream_order(0, 0, r.id());
  }
  std::lock_guard lock(e.state_->mutex);  // the point and the wait refer to the same record
  detail::check(detail::cu::cuStreamWaitEvent_nothrow(stream_, e.event_, 0), "cuStreamWaitEvent");
  // A stream that is capturing now (its own capture, or one it joined by this very wait, on an
  // event recorded in it) is ordered after nothing in real time by the wait: it learns nothing.
  // The event's point is empty when streamalloc recorded it in the capture, but not when a raw
  // cudaEventRecord did during the capture: asked after the wait, this covers both. (A raw
  // record outside captures cannot be seen: docs/pool.md, "What is checked, what is undefined".)
  if (detail::may_be_capturing(stream_)) [[unlikely]] return stream_order(0, 0, r.id());
  r.wait_for(e.state_->point);
  return stream_order(e.state_->point.stream, e.state_->point.epoch, r.id());
}

// A capturing stream's wait (asked first: a raw handle or the legacy stream) is an edge of the
// graph being built: the stream's own work is ordered after nothing by it in real time. The
// pools learn nothing, and the token proves nothing: its earlier stream is 0, and so is its
// later one unless the reference carries its record (CUDA does not tell a capturing stream's id).
STREAMALLOC_COLD inline stream_order stream_ref::wait_in_capture(event_ref e) const {
  detail::check(detail::cu::cuStreamWaitEvent_nothrow(stream_, e.event_, 0), "cuStreamWaitEvent");
  return stream_order(0, 0, record_ != nullptr ? record_->id() : 0);
}

inline stream_order stream::wait(event_ref e) const { return ref().wait(e); }

namespace detail {
/// A new event of context `ctx` (events belong to the context current when they are made),
/// whatever context the calling thread has current.
inline std::unique_ptr<event> make_event_in(CUcontext ctx) {
  scoped_context in_ctx(ctx);  // popped whether or not the event is made
  return std::make_unique<event>();
}
}  // namespace detail

/**
 * @brief Orders `later` after everything enqueued on `earlier` so far (an event recorded on
 * `earlier` and waited for by `later`, through streamalloc), without blocking the host.
 * @return the proof, for handing memory from `earlier` to `later`
 * @throws cuda_error
 */
inline stream_order order_after(stream_ref later, stream_ref earlier) {
  // One event per thread and device, recorded again for each call: a wait uses the record
  // made before it, so a later record cannot disturb an earlier wait.
  thread_local std::array<std::unique_ptr<event>, detail::max_devices> scratch{};
  const int device = earlier.device();
  if (device < 0 || device >= detail::max_devices) {
    throw std::invalid_argument("streamalloc::order_after: the earlier stream's device is unknown");
  }
  if (!scratch[device]) scratch[device] = detail::make_event_in(detail::primary_context(device));
  scratch[device]->record(earlier);
  return later.wait(*scratch[device]);
}

/**
 * @brief Blocks the host until all work on `device` is done (`cudaDeviceSynchronize`); memory
 * freed on any of its streams before the call becomes reusable by every stream.
 * @return the proof that the host saw all the device's work, up to the call, finish
 * @throws cuda_error
 */
inline host_order synchronize_device(int device) {
  detail::ordering().retire_found_gone();  // ended threads' streams: this synchronization frees them
  const std::uint64_t sync = detail::ordering().begin_device_sync(device);
  auto points = detail::ordering().begin_synchronize_all();
  std::erase_if(points, [device](auto& p) { return p.first->device() != device; });
  CUresult r = CUDA_SUCCESS;
  {
    // cuCtxSynchronize waits for the current context: make the device's current for it.
    detail::scoped_context on_device(detail::primary_context(device));
    r = detail::cu::cuCtxSynchronize_nothrow();
  }
  detail::check(r, "cuCtxSynchronize");
  detail::ordering().end_device_sync(device, sync);
  detail::ordering().complete_all(points);
  return host_order(0, device, 0);
}

}  // namespace streamalloc
