#pragma once

/// @file
/// @brief Pools shared with other processes: `export_pool`, `export_pointer`, `imported_pool`,
/// `ipc_handle`.
///
/// The exporting process makes a pool with `pool_properties::handle_types =
/// shareable_handle_type::posix_fd` and exports it at a socket path; the pool then serves
/// importers from a thread of its own until it closes. Each allocation to share is exported as
/// an `ipc_descriptor` (64 bytes, sent by any means). An importing process connects an
/// `imported_pool` to the path and imports descriptors as `ipc_handle`s, which map the
/// allocation into its address space and unmap it when they end.
///
/// @code
/// // exporting process
/// streamalloc::pool pool({.location = streamalloc::memory_location::device(0),
///                         .handle_types = streamalloc::shareable_handle_type::posix_fd});
/// streamalloc::export_pool(pool, "/tmp/app.sock");
/// void* p = pool.allocate(n, s);
/// streamalloc::ipc_descriptor d = streamalloc::export_pointer(pool, p);  // send d, with an ipc event
///
/// // importing process
/// streamalloc::imported_pool imported("/tmp/app.sock");
/// streamalloc::ipc_handle h = imported.import_pointer(d);
/// s.wait(ready);                              // the exporter's interprocess event: its writes are done
/// kernel<<<g, b, 0, s.get()>>>(h.get());
/// h.release(s);                               // unmapped once the kernel is done
/// @endcode
///
/// What streamalloc adds to the driver's rules (which leave these undefined): while another
/// process holds an import, the exporter's memory under it is neither reused, nor released,
/// nor remapped, even if the exporter frees the allocation first; the free takes effect when
/// the last import ends. An importer that exits or is killed ends its imports (the exporter
/// sees its socket close). Synchronization of the two processes' work on the memory is the
/// user's, with interprocess events (`event::interprocess`), as with the driver.

#include <streamalloc/detail/ipc/importer.hpp>
#include <streamalloc/ipc_descriptor.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <concepts>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace streamalloc {

/**
 * @brief Shares `p` with other processes: serves importers at `socket_path` (a file system
 * path, or with a leading '@' a name in Linux's abstract socket namespace) from a thread of the
 * pool's own, until the pool closes.
 * @throws std::invalid_argument for a pool made without handle types, one exported already,
 *         a path in use by another exporter, or a bad path
 * @throws std::system_error when the socket cannot be made; pool_closed for a closed pool
 */
inline void export_pool(pool_ref p, std::string socket_path) {
  (void)p.device();  // throws pool_closed for a moved-from pool
  detail::state_of(p)->export_ipc(std::move(socket_path));
}

/**
 * @brief The descriptor another process imports live allocation `ptr` of exported pool `p`
 * with. Exporting it again gives the same descriptor; once `ptr` is freed, its descriptors are
 * refused.
 * @throws std::invalid_argument for a pool not exported, or a pointer that is not the start
 *         of a live allocation of `p`
 */
[[nodiscard]] inline ipc_descriptor export_pointer(pool_ref p, const void* ptr) {
  (void)p.device();  // throws pool_closed for a moved-from pool
  return detail::state_of(p)->export_pointer(ptr);
}

/// Processes connected to exported pool `p` now (0 when it is not exported).
[[nodiscard]] inline std::size_t importers_of(pool_ref p) {
  detail::pool_state* st = detail::state_of(p);
  return st == nullptr ? 0 : st->importers();
}

/**
 * @brief One allocation of another process's pool, mapped here; move-only. The memory stays
 * the exporter's: this process may read and write it (with the access its `imported_pool`
 * grants) until the handle ends.
 *
 * End it in stream order with `release(stream)`: it is unmapped once the work enqueued on that
 * stream so far has finished (a thread of the imported pool waits for it), then the exporter
 * is told. A handle destroyed without `release` first waits for every device with access to
 * the import (as `cudaFree` waits), then unmaps.
 */
class ipc_handle {
 public:
  /// Holds nothing.
  ipc_handle() noexcept = default;
  /// Takes over `o`'s import; `o` is left holding nothing.
  ipc_handle(ipc_handle&& o) noexcept : from_(std::move(o.from_)), imported_(std::exchange(o.imported_, {})) {}
  /// Ends this import (as `reset`), then takes over `o`'s.
  ipc_handle& operator=(ipc_handle&& o) noexcept {
    if (this != &o) {
      reset();
      from_ = std::move(o.from_);
      imported_ = std::exchange(o.imported_, {});
    }
    return *this;
  }
  ipc_handle(const ipc_handle&) = delete;
  ipc_handle& operator=(const ipc_handle&) = delete;
  ~ipc_handle() { reset(); }

  /// The allocation's address in this process (null once ended).
  [[nodiscard]] void* get() const noexcept { return reinterpret_cast<void*>(imported_.address); }
  /// The allocation's address as a `T*`.
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return static_cast<T*>(get());
  }
  /// Its size in bytes, as exported.
  [[nodiscard]] std::size_t size() const noexcept { return imported_.size; }
  /// True until the import ends.
  [[nodiscard]] explicit operator bool() const noexcept { return imported_.address != 0; }

  /**
   * @brief Ends the import after the work enqueued on `s` so far; returns at once.
   * @throws std::invalid_argument on a stream being captured into a graph (the release
   *         cannot be part of a graph); cuda_error when the event cannot be recorded
   */
  void release(stream_ref s) {
    if (!from_) return;
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    detail::check(detail::cu::cuStreamIsCapturing_nothrow(s.get(), &status), "cuStreamIsCapturing");
    if (status != CU_STREAM_CAPTURE_STATUS_NONE) {
      throw std::invalid_argument("streamalloc::ipc_handle::release: the stream is being captured into a graph; "
                                  "release the import on a stream that runs now");
    }
    CUcontext ctx = nullptr;
    detail::check(detail::cu::cuStreamGetCtx_nothrow(s.get(), &ctx), "cuStreamGetCtx");
    CUevent e = nullptr;
    {
      detail::scoped_context in_stream_context(ctx);
      detail::check(detail::cu::cuEventCreate_nothrow(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
    }
    const CUresult r = detail::cu::cuEventRecord_nothrow(e, s.get());
    if (r != CUDA_SUCCESS) {
      (void)detail::cu::cuEventDestroy_nothrow(e);
      detail::check(r, "cuEventRecord", [] { return "releasing an imported allocation"; });
    }
    from_->release_after(imported_.id, e);
    from_.reset();
    imported_ = {};
  }

  /// Ends the import now, after every device with access to it is idle (the destructor's way).
  void reset() noexcept {
    if (!from_) return;
    bool idle = true;
    try {
      from_->synchronize_accessors();
    } catch (const cuda_error& e) {
      // A lost or broken context: none of its work runs any more. Anything else (the device
      // refusing the synchronization) proves nothing.
      idle = no_work_runs_after(e.code());
    } catch (...) {
      idle = false;
    }
    if (!idle) {
      // Not known idle: left in the imported pool, which maps it until it goes, rather than
      // unmapped under work that may still use it.
      from_.reset();
      imported_ = {};
      return;
    }
    from_->release(imported_.id);
    from_.reset();
    imported_ = {};
  }

 private:
  friend class imported_pool;
  /// After this error no work of the context runs: it is gone, or broken for good.
  static bool no_work_runs_after(CUresult r) noexcept {
    switch (r) {
      case CUDA_ERROR_DEINITIALIZED:
      case CUDA_ERROR_INVALID_CONTEXT:
      case CUDA_ERROR_CONTEXT_IS_DESTROYED:
      case CUDA_ERROR_ILLEGAL_ADDRESS:
      case CUDA_ERROR_ILLEGAL_INSTRUCTION:
      case CUDA_ERROR_MISALIGNED_ADDRESS:
      case CUDA_ERROR_INVALID_ADDRESS_SPACE:
      case CUDA_ERROR_INVALID_PC:
      case CUDA_ERROR_HARDWARE_STACK_ERROR:
      case CUDA_ERROR_LAUNCH_FAILED:
      case CUDA_ERROR_ASSERT:
        return true;
      default:
        return false;
    }
  }
  ipc_handle(std::shared_ptr<detail::ipc::importer> from, detail::ipc::importer::imported i) noexcept
      : from_(std::move(from)), imported_(i) {}

  std::shared_ptr<detail::ipc::importer> from_;
  detail::ipc::importer::imported imported_;
};

/**
 * @brief Another process's exported pool, seen from here: the allocations imported from it.
 *
 * Not a pool to allocate from (trying does not compile), nor one to make current. Its memory
 * is accessible at first only from the exporter's device, if this process sees that device
 * (CUDA_VISIBLE_DEVICES may hide it or number it otherwise); `set_access` grants others. Its
 * statistics count what this process imported, nothing else. Handles keep the connection
 * alive: they may outlive the `imported_pool` they came from.
 */
class imported_pool {
 public:
  /**
   * @brief Connects to the pool exported at `socket_path` (see `export_pool`).
   * @throws std::invalid_argument when nothing, or not a streamalloc pool of this version,
   *         answers there
   */
  explicit imported_pool(std::string socket_path)
      : state_(std::make_shared<detail::ipc::importer>(std::move(socket_path))) {}

  /**
   * @brief Maps the allocation `d` describes into this process.
   * @throws std::invalid_argument for a descriptor of another pool (foreign), of an allocation
   *         freed since (stale), one damaged or forged, or when the exporter is gone; nothing is
   *         left mapped or held on either side
   * @throws cuda_error when the driver refuses the memory
   */
  [[nodiscard]] ipc_handle import_pointer(const ipc_descriptor& d) { return ipc_handle(state_, state_->import(d)); }

  /**
   * @brief Grants device `who` `flags` access to every import, present and future
   * (`access_flags::none` revokes).
   * @throws cuda_error when the driver refuses (a device that cannot reach the memory)
   */
  void set_access(memory_location who, access_flags flags = access_flags::read_write) { state_->set_access(who, flags); }
  /// The access `who` has.
  [[nodiscard]] access_flags access(memory_location who) const { return state_->access(who); }
  /// What this process imported: `live_allocations` and `used_current` count its imports,
  /// `reserved_current` and `chunks` the exporter's physical memory under them.
  [[nodiscard]] pool_statistics statistics() const { return state_->statistics(); }
  /// Where the exporter's pool keeps its memory (device ordinal as the exporter numbers it).
  [[nodiscard]] memory_location location() const noexcept { return state_->location(); }
  /// This process's ordinal of the exporter's device; -1 when this process does not see it.
  [[nodiscard]] int device() const noexcept { return state_->device(); }

  /// An imported pool cannot allocate: allocations are made by the exporting process.
  template <class... Args>
  void* allocate(Args&&...) const {
    static_assert(detail::dependent_false_v<Args...>,
                  "streamalloc::imported_pool cannot allocate: allocate in the exporting process and import the "
                  "allocation here (export_pointer there, import_pointer here)");
    return nullptr;
  }
  /// An imported pool cannot free: end the import instead (ipc_handle::release).
  template <class... Args>
  void deallocate(Args&&...) const {
    static_assert(detail::dependent_false_v<Args...>,
                  "streamalloc::imported_pool cannot free: end the import with ipc_handle::release(stream) (the "
                  "exporting process frees the allocation)");
  }

 private:
  std::shared_ptr<detail::ipc::importer> state_;
};

/// An imported pool cannot be a current pool: it cannot allocate.
template <class T>
  requires std::same_as<std::remove_cvref_t<T>, imported_pool>
void set_current_pool(int, T&&) {
  static_assert(detail::dependent_false_v<T>,
                "streamalloc::set_current_pool: an imported_pool cannot be a current pool (it cannot allocate); "
                "make a pool of this process current");
}

}  // namespace streamalloc
