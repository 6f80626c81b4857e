#pragma once

/// @file
/// @brief `pool`: a stream-ordered memory pool built on CUDA virtual memory management, with
/// the semantics of `cudaMemPool_t` and `cudaMallocAsync` / `cudaFreeAsync`; `pool_ref`, its
/// non-owning view; the current pool of each device; and the bad-free handler.

#include <streamalloc/access.hpp>
#include <streamalloc/detail/pool/pool_state.hpp>
#include <streamalloc/memory_location.hpp>
#include <streamalloc/ordering.hpp>
#include <streamalloc/placement.hpp>
#include <streamalloc/pool_properties.hpp>
#include <streamalloc/stream.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <functional>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace streamalloc {

namespace detail {

/// What a user may pass as a stream by habit and streamalloc takes only as a `stream_ref`: a
/// raw `cudaStream_t`, `0`, `NULL` or `nullptr` (see the rejecting overloads of `pool_interface`).
/// Signed integers only: an unsigned one in that place is rather an alignment, and a probe for
/// a CCCL-style `allocate(bytes, alignment)` must not find the rejecting overload.
template <class S>
concept raw_stream_argument = std::is_same_v<S, cudaStream_t> || std::is_same_v<S, std::nullptr_t> ||
                              (std::is_integral_v<S> && std::is_signed_v<S>);

/**
 * @brief What `pool` and `pool_ref` both offer: every use of a pool but owning it. Each member
 * acts on the pool's state, which lives on the heap: moving a `pool` moves the ownership of
 * that state, and every ref, resource, buffer and current-pool slot that names it stays valid.
 */
template <class Derived>
class pool_interface {
 public:
  /**
   * @brief Allocates `bytes` in the order of stream `s`: usable by work enqueued on `s` after
   * this call, and by other streams once they are ordered after it. Never blocks the host or
   * synchronizes the device. Aligned to 256 bytes. `bytes == 0` returns nullptr.
   * @param where for a request of at least the chunk size that makes the pool grow: packed
   *        with the other large allocations (fastest), or with room to grow in place after it
   * @throws out_of_memory when the pool is at its maximum size, the device has no memory, or
   *         the pool's addresses (`pool_properties::address_space`) are used up (then it says so)
   * @throws std::invalid_argument when `s` belongs to a device that cannot use the pool's
   *         memory: another device than a device pool's (for a host pool, than the one it was
   *         made for) that `set_access` has not granted access
   * @throws cuda_error when the driver fails to map the memory the pool grows by (a refused
   *         move while defragmenting is not an error: the pool grows instead); std::bad_alloc
   *         out of host memory. Nothing is lost either way (docs/pool.md, failures).
   * @throws pool_closed after `close()`, or on a moved-from pool
   */
  [[nodiscard]] void* allocate(std::size_t bytes, stream_ref s, placement where = placement::packed) const {
    return state("allocate").allocate(bytes, s, where);
  }

  /**
   * @brief Frees `p` in the order of stream `s`: work enqueued on `s` before this call may still
   * use it; every other stream that used it must be ordered before this point. nullptr is
   * ignored. This is the checking form of a free; the resources' frees never throw (see
   * `set_bad_free_handler`).
   * @throws std::invalid_argument, changing nothing, when `p` is not a live allocation of this
   *         pool (a foreign pointer, an interior pointer, or a double free), or when `s`
   *         belongs to a device whose streams `allocate` refuses
   * @throws pool_closed after `close()` (the memory is gone already)
   */
  void deallocate(void* p, stream_ref s) const { state("deallocate").deallocate(p, s); }

  /// Rejected: a raw `cudaStream_t`, `0` or `nullptr` as the stream (a stream is taken as an
  /// explicit `stream_ref`, so that an integer never becomes one by accident).
  template <raw_stream_argument S>
  void* allocate(std::size_t, S, placement = placement::packed) const {
    static_assert(sizeof(S) == 0,
                  "streamalloc::pool::allocate: pass a cudaStream_t s as streamalloc::stream_ref{s}: "
                  "pool.allocate(bytes, streamalloc::stream_ref{s}); for stream 0 say "
                  "streamalloc::stream_ref::legacy_default() (or per_thread_default())");
    return nullptr;
  }
  /// Rejected: as for `allocate`.
  template <raw_stream_argument S>
  void deallocate(void*, S) const {
    static_assert(sizeof(S) == 0,
                  "streamalloc::pool::deallocate: pass a cudaStream_t s as streamalloc::stream_ref{s}: "
                  "pool.deallocate(p, streamalloc::stream_ref{s}); for stream 0 say "
                  "streamalloc::stream_ref::legacy_default() (or per_thread_default())");
  }

  /**
   * @brief Allocates `bytes` ordered with the host rather than a stream (like `cudaMalloc`):
   * the memory is usable at once by every stream, and by the host for a host pool. It never
   * comes from memory whose free may still be pending on a stream; when only such memory is
   * left, the host waits for the frees (so this may block). `bytes == 0` returns nullptr.
   * @throws out_of_memory, pool_closed
   */
  [[nodiscard]] void* allocate_sync(std::size_t bytes) const { return state("allocate_sync").allocate_sync(bytes); }

  /**
   * @brief Frees `p` now (like `cudaFree`, without its synchronization): the caller promises
   * that no work still uses it; the memory is reusable at once by every stream.
   * @throws std::invalid_argument, changing nothing, for a pointer that is not live here
   * @throws pool_closed after `close()`
   */
  void deallocate_sync(void* p) const { state("deallocate_sync").deallocate_sync(p); }

  /**
   * @brief Makes the live allocation at `p` at least `bytes` long without moving it, by taking
   * the free memory right after it or mapping new physical memory behind it. Ordered on `s`:
   * the added bytes are usable by work enqueued on `s` after the call (their contents are
   * undefined). No copy is made and `p` stays valid.
   * @return the allocation's new size (>= bytes, a multiple of 256), or 0 when the addresses
   *         after it are taken (nothing changed: allocate, copy and free instead). A large
   *         allocation made with `placement::room_to_grow` has unused addresses after it.
   *         Also 0 when the device is out of memory or refuses to map it.
   * @throws std::invalid_argument when `p` is not a live allocation of this pool
   * @throws cuda_error when mapping the new memory fails for another reason than a shortage
   *         (a sticky error, a lost context); std::bad_alloc out of host memory. The
   *         allocation is unchanged either way.
   * @throws pool_closed after `close()`
   */
  [[nodiscard]] std::size_t grow_in_place(void* p, std::size_t bytes, stream_ref s) const {
    return state("grow_in_place").grow_in_place(p, bytes, s);
  }

  /**
   * @brief Makes the live allocation at `p` `bytes` long without moving it; the rest is freed
   * in the order of `s` (work enqueued on `s` before may still use it; reusable by `s` at once).
   * @return the allocation's new size (a multiple of 256, at least 256)
   * @throws std::invalid_argument when `p` is not a live allocation of this pool
   * @throws pool_closed after `close()`
   */
  std::size_t shrink_in_place(void* p, std::size_t bytes, stream_ref s) const {
    return state("shrink_in_place").shrink_in_place(p, bytes, s);
  }

  /// True if `p` lies in the pool's address range (live or not); false once the pool is closed.
  [[nodiscard]] bool owns(const void* p) const noexcept {
    const pool_state* st = Derived::state_of(self());
    return st != nullptr && st->owns(p);
  }

  /// True once `close()` has run, or the pool was moved from. A closed pool holds nothing and
  /// refuses every use but `closed`, `owns`, `properties`, `location`, `device` and `close`; a
  /// moved-from one answers only `closed`, `owns` (false) and `close` (nothing to report).
  [[nodiscard]] bool closed() const noexcept {
    const pool_state* st = Derived::state_of(self());
    return st == nullptr || st->closed();
  }

  /// What the pool holds and hands out. @throws pool_closed after `close()`
  [[nodiscard]] pool_statistics statistics() const { return state("statistics").statistics(); }
  /// Resets the high-water marks to the current values. @throws pool_closed after `close()`
  void reset_high_water() const { state("reset_high_water").reset_high_water(); }

  /**
   * @brief What the pool holds now, as a JSON document: its properties and statistics, the
   * device's free memory, its address reservations and mapped chunks, every block by address
   * (live, free, pending on a stream with the stamp of its free, held by a graph), each
   * stream's live and pending bytes, and the recent history when kept (`keep_history`).
   * docs/observability.md describes the fields; scripts/plot_snapshot.py draws it.
   *
   * Takes the pool lock for the walk (allocations on other threads wait for it), after
   * moving every stream's recently freed blocks into its pending bins as the pool's slow
   * paths do. Costs about a microsecond per block.
   * @throws pool_closed after `close()`
   */
  [[nodiscard]] std::string snapshot() const { return state("snapshot").snapshot(); }

  /**
   * @brief Keeps the last `events` allocations, frees, growths, releases and remaps (time,
   * stream, address, bytes) for `snapshot`; 0 (the default) keeps none. Each call starts a
   * new history. While it is kept, every allocation and free takes a clock reading and a
   * mutex (docs/observability.md gives the measured cost); off, it costs nothing measurable.
   * @throws pool_closed after `close()`
   */
  void keep_history(std::size_t events) const { state("keep_history").keep_history(events); }

  /**
   * @brief Calls `handler` when an allocation from this pool fails, with the `out_of_memory`
   * about to be thrown (its message says what was asked, what the pool holds, what is
   * pending on which streams and the device's free memory). The handler may free memory,
   * synchronize streams or trim other pools; returning true retries the allocation (and calls
   * the handler again if it fails again), false throws. It runs on the allocating thread with
   * no lock of the pool held; an exception from it propagates. An empty function removes it.
   * @throws pool_closed after `close()`
   */
  void set_out_of_memory_handler(std::function<bool(const out_of_memory&)> handler) const {
    state("set_out_of_memory_handler").set_out_of_memory_handler(std::move(handler));
  }

  /**
   * @brief Gives free physical memory back to the driver until at most `keep` bytes of it
   * remain. Only whole free chunks go, and only memory whose frees are known to have executed
   * (synchronize first to release everything).
   * @throws pool_closed after `close()`
   */
  void trim_to(std::size_t keep) const { state("trim_to").trim_to(keep); }

  /**
   * @brief A synchronization point for the pool: blocks the host until the device has finished
   * all work (all devices', for a host pool; for a device pool, also every device ever granted
   * access, whose streams may have freed here), so every free made before is reusable by every
   * stream, then applies the release threshold.
   * @return for a device pool, the proof that the host saw the device's work finish
   * @throws cuda_error, pool_closed
   */
  host_order synchronize() const { return state("synchronize").synchronize(); }

  /// Free memory kept at synchronization points from now on. @throws pool_closed after `close()`
  void set_release_threshold(std::size_t bytes) const {
    state("set_release_threshold").set_release_threshold(bytes);
  }
  /// The cross-stream reuse allowed from now on. @throws pool_closed after `close()`
  void set_reuse_policy(reuse_policy r) const { state("set_reuse_policy").set_reuse_policy(r); }

  /// The properties as the pool applies them (`max_size` rounded down to the granularity,
  /// `address_space` the limit in force, the latest threshold and reuse policy set).
  /// @throws pool_closed on a moved-from pool (a closed one still answers)
  [[nodiscard]] const pool_properties& properties() const { return state("properties").properties(); }
  /// Where the memory lives. @throws pool_closed on a moved-from pool
  [[nodiscard]] memory_location location() const { return state("location").location(); }
  /// The device whose streams allocate here and whose kernels use the memory (a device pool's
  /// own; for a host pool, the device it was made for); devices granted access by `set_access`
  /// may too. @throws pool_closed on a moved-from pool
  [[nodiscard]] int device() const { return state("device").device(); }
  /// The allocation granularity of the pool's memory. @throws pool_closed after `close()`
  [[nodiscard]] std::size_t granularity() const { return state("granularity").granularity(); }

  /// The live allocation containing `p`: its start and size; nullopt if none.
  /// @throws pool_closed after `close()`
  [[nodiscard]] std::optional<std::pair<void*, std::size_t>> find_allocation(const void* p) const {
    return state("find_allocation").find_allocation(p);
  }

  /**
   * @brief Gives each device in `who` the access its descriptor says to all of the pool's
   * memory: every allocation made before and after, including memory mapped later by growth,
   * defragmentation, `grow_in_place` and graphs (like `cudaMemPoolSetAccess`). `access_flags::read`
   * allows loads only, `read_write` loads and stores, `none` revokes a peer's access, at once
   * over the memory mapped now. Streams of a device with access (read or read-write) may then
   * allocate from the pool and free to it; the memory stays where the pool says.
   *
   * Every descriptor is checked before anything changes: a device that cannot access the
   * memory is refused now, even on a pool that holds no memory yet (the driver would accept it
   * there and fail the next allocation). A device pool's memory is open to the peers of its
   * device (`cuDeviceCanAccessPeer`); a host pool's to every device that can map host memory
   * of its kind. This access is the pool's own: `cudaDeviceEnablePeerAccess` neither gives it
   * nor takes it away.
   *
   * Thread-safe: other threads may allocate and free meanwhile. Ordering rule: a device's
   * kernels may use the memory once this call has returned; a revocation must come after every
   * use by that device (synchronize with its work first), and its streams are refused from
   * the moment the call begins. Costs tens of microseconds per physical chunk the pool maps
   * (the driver's price): grant once, early, rather than back and forth.
   *
   * @code
   * streamalloc::pool p({.location = streamalloc::memory_location::device(0)});
   * p.set_access({{streamalloc::memory_location::device(1), streamalloc::access_flags::read_write}});
   * streamalloc::stream s1(1);
   * void* x = p.allocate(bytes, s1);   // on device 0, used by device 1's kernels
   * @endcode
   * @param who one descriptor per device (or, for a host pool, the host), each named once
   * @throws not_supported when a device cannot access the memory (naming it and where the memory lives)
   * @throws std::invalid_argument, changing nothing, for a device that does not exist, a
   *         location named twice, the host for a device pool, or a reduction of the access of
   *         the memory's own device (or, for a host pool, of the host's or of the device the
   *         pool was made for), which is read-write for the pool's life
   * @throws cuda_error when the driver refuses (nothing has changed then)
   * @throws pool_closed after `close()`
   */
  void set_access(std::span<const access_descriptor> who) const { state("set_access").set_access(who); }
  /// @overload
  void set_access(std::initializer_list<access_descriptor> who) const {
    set_access(std::span<const access_descriptor>(who.begin(), who.size()));
  }
  /// @brief Gives `where` the access `flags` (see the list form).
  void set_access(memory_location where, access_flags flags) const {
    const access_descriptor d{where, flags};
    set_access(std::span<const access_descriptor>(&d, 1));
  }

  /**
   * @brief What `where` may do with the pool's memory (like `cudaMemPoolGetAccess`): read-write
   * for the memory's own device (and, for a host pool, for the host and the device it was made
   * for), what `set_access` granted for other devices, none otherwise.
   * @throws pool_closed after `close()`
   */
  [[nodiscard]] access_flags access(memory_location where) const { return state("access").access(where); }

 private:
  [[nodiscard]] const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }
  /// The state; throws for a moved-from pool. (Whether a closed pool answers is the state's
  /// business: properties, location and device do, the rest throw.)
  pool_state& state(const char* member) const {
    pool_state* st = Derived::state_of(self());
    if (st == nullptr) [[unlikely]] pool_state::throw_moved_from(member);
    return *st;
  }
};

}  // namespace detail

/**
 * @brief A stream-ordered memory pool (the semantics of `cudaMemPool_t` with
 * `cudaMallocAsync` / `cudaFreeAsync`), implemented on the VMM API.
 *
 * The pool reserves virtual addresses as it needs them and maps physical memory in chunks as
 * it grows. Memory freed on a stream is reused by that stream at once, with no driver call;
 * other streams reuse it as the reuse policy allows. Thread-safe: any number of threads may
 * allocate and free, on their own streams or shared ones.
 *
 * A pool owns its state; it can be moved (into a container, out of a factory), and the refs,
 * resources, buffers and current-pool settings made from it follow the state, not the object.
 * A moved-from pool is closed. The members are those of `detail::pool_interface`, plus `close`.
 *
 * @code
 * streamalloc::pool pool({.location = streamalloc::memory_location::device(0),
 *                         .release_threshold = SIZE_MAX});
 * streamalloc::stream s(0);
 * float* x = static_cast<float*>(pool.allocate(n * sizeof(float), s));
 * kernel<<<grid, block, 0, s.get()>>>(x, n);
 * pool.deallocate(x, s);   // ordered after the kernel; reusable on s at once
 * @endcode
 */
class pool : public detail::pool_interface<pool> {
 public:
  /**
   * @brief Makes a pool. Everything the properties ask of the device is checked here, not at
   * the first allocation: the pool creates and releases one granule of physical memory with
   * them, so a location or handle type the driver refuses fails now.
   * @throws std::invalid_argument for properties that cannot work (a chunk size off the
   *         granularity, a maximum below one granule, a size above 2^50 bytes, unknown handle
   *         type bits...)
   * @throws not_supported when the location or a handle type is unsupported
   * @throws driver_unavailable, cuda_error (also when the driver refuses the location or the
   *         handle types, saying which)
   */
  explicit pool(pool_properties props = {}) : state_(std::make_unique<detail::pool_state>(props)) {}

  pool(const pool&) = delete;
  pool& operator=(const pool&) = delete;
  /// Takes `other`'s state; `other` is left closed.
  pool(pool&& other) noexcept = default;
  /// Destroys this pool's state (as the destructor does: refs, resources and buffers made from
  /// it must be gone by then), then takes `other`'s.
  pool& operator=(pool&& other) noexcept {
    if (this != &other) {
      state_.reset();
      state_ = std::move(other.state_);
    }
    return *this;
  }

  /// Destroys the pool. Live allocations are reported on stderr (use `close()` to get the
  /// report instead) and their memory is released after the device has finished its work.
  ~pool() = default;

  /**
   * @brief Releases everything now and reports what was never freed. Work ordered before the
   * pool's frees is waited for: when a free may still be running on the device, or allocations
   * are still live, the host first synchronizes with the devices whose streams use the memory
   * (its own, and every device ever granted access), so nothing is unmapped under running
   * work. The pool cannot be used afterwards (every
   * member but `closed`, `owns`, `properties`, `location`, `device` and `close` throws
   * `pool_closed`); if it is some device's current pool, that device's default pool becomes
   * current again.
   */
  pool_close_report close() noexcept { return state_ ? state_->close() : pool_close_report{}; }

 private:
  friend class detail::pool_interface<pool>;
  friend class pool_ref;
  static detail::pool_state* state_of(const pool& p) noexcept { return p.state_.get(); }

  std::unique_ptr<detail::pool_state> state_;
};

/**
 * @brief A non-owning, trivially copyable reference to a pool, with everything a pool offers
 * but `close`. It names the pool's state, so it stays valid when the `pool` is moved; the pool
 * (wherever it was moved) must outlive it.
 */
class pool_ref : public detail::pool_interface<pool_ref> {
 public:
  /// Refers to `p` (which must outlive the reference; moving `p` does not invalidate it).
  pool_ref(const pool& p) noexcept : state_(pool::state_of(p)) {}  // NOLINT: an owner views as its ref
  // A temporary pool dies at the end of the full expression, taking its state: a ref to it
  // would dangle at once.
  pool_ref(pool&&) = delete;
  pool_ref(const pool&&) = delete;
  /// For the library's own lookups (the current pool, the pool of a pointer).
  explicit pool_ref(detail::pool_state& s) noexcept : state_(&s) {}

  /// Do both refer to the same pool?
  friend bool operator==(pool_ref a, pool_ref b) noexcept { return a.state_ == b.state_; }

 private:
  friend class detail::pool_interface<pool_ref>;
  friend detail::pool_state* detail_state_of(pool_ref r) noexcept { return r.state_; }
  static detail::pool_state* state_of(const pool_ref& r) noexcept { return r.state_; }

  detail::pool_state* state_;
};

namespace detail {
/// The state a ref names (null for a moved-from pool's), for the library's own types.
inline pool_state* state_of(pool_ref r) noexcept { return detail_state_of(r); }
}  // namespace detail

// --- bad frees where nothing may throw ------------------------------------------------------

/**
 * @brief What a free that may not throw found wrong: the pointer was not a live allocation of
 * the pool (foreign, interior, or freed already), or the stream was of the wrong device.
 *
 * Two kinds of free exist. `pool::deallocate`, `pool::deallocate_sync` and
 * `streamalloc::deallocate` are the checking form: a bad free throws `std::invalid_argument`
 * and changes nothing, for code that wants to test for it. The frees that containers and
 * destructors call (`pool_resource::deallocate` and `deallocate_async`, `pmr_resource`'s) are
 * `noexcept`: an exception there would end the program through `std::terminate` with no word
 * of the cause, so they hand a `bad_free` to the bad-free handler instead.
 */
struct bad_free {
  const void* pointer;    ///< what was freed
  pool_ref owner;         ///< the pool it was freed to
  const char* operation;  ///< the free that was called, as "streamalloc::pool_resource::deallocate"
  const char* reason;     ///< what the checking form would have thrown; valid during the handler's call only
};

/// Called with each bad free found by a free that may not throw. It must not throw; it may
/// return (the free is then ignored: nothing is freed, nothing changes), log, or end the program.
using bad_free_handler = void (*)(const bad_free&) noexcept;

namespace detail {
/// Like a C library's double-free check: say what happened and abort, because a program that
/// frees what it does not own has already lost track of its memory.
inline void abort_on_bad_free(const bad_free& b) noexcept {
  std::string where = "a closed pool";
  try {
    if (!b.owner.closed()) where = "the pool on " + b.owner.location().to_string();
  } catch (...) {  // out of memory: the message goes without the pool's location
  }
  std::fprintf(stderr, "streamalloc: %s: bad free of %p to %s: %s\n", b.operation, b.pointer, where.c_str(), b.reason);
  std::abort();
}
inline std::atomic<bad_free_handler>& bad_free_handler_slot() noexcept {
  static std::atomic<bad_free_handler> h{&abort_on_bad_free};
  return h;
}
}  // namespace detail

/// Installs `h` as the bad-free handler for the whole process and returns the one it replaces;
/// nullptr puts back the default (print the pointer, the pool and the reason to stderr, then
/// abort). Thread-safe.
inline bad_free_handler set_bad_free_handler(bad_free_handler h) noexcept {
  return detail::bad_free_handler_slot().exchange(h != nullptr ? h : &detail::abort_on_bad_free,
                                                  std::memory_order_acq_rel);
}
/// The bad-free handler in force.
[[nodiscard]] inline bad_free_handler get_bad_free_handler() noexcept {
  return detail::bad_free_handler_slot().load(std::memory_order_acquire);
}

namespace detail {
/// Runs a checking free (one that throws) where a free may not throw: a bad free goes to the
/// bad-free handler; any other failure (out of host memory for the stream's state) leaves the
/// allocation live, which the pool reports when it is closed, and says so on stderr. A pool
/// closed already gave its memory back: there is nothing left to free.
template <class Free>
void free_or_report(pool_ref owner, const void* p, const char* operation, Free&& free) noexcept {
  if (owner.closed()) return;
  try {
    free();
  } catch (const std::invalid_argument& e) {
    get_bad_free_handler()(bad_free{p, owner, operation, e.what()});
  } catch (const pool_closed&) {  // nothing may escape a noexcept free (close() racing a free is undefined)
  } catch (const std::exception& e) {
    std::fprintf(stderr, "streamalloc: %s: the free of %p was not made and the allocation stays live: %s\n",
                 operation, p, e.what());
  } catch (...) {
    std::fprintf(stderr, "streamalloc: %s: the free of %p was not made and the allocation stays live\n", operation,
                 p);
  }
}
}  // namespace detail

// --- the current pool of each device ---------------------------------------------------------

namespace detail {
// The device count cannot change while the process runs: asked once, not on every allocation
// through streamalloc::allocate.
inline int cached_device_count() {
  static const int n = device_count();
  return n;
}
inline void check_device(int device) {
  if (device < 0 || device >= cached_device_count()) {
    throw std::invalid_argument("streamalloc: there is no device " + std::to_string(device));
  }
}
/// Each device's default pool, null until made (default_pool). Never destroyed once made.
inline std::array<std::atomic<pool*>, max_devices>& default_pools() {
  static std::array<std::atomic<pool*>, max_devices> defaults{};
  return defaults;
}
/// Device `device`'s default pool when it is the current pool (none set) and has been made,
/// else null; current_pool's rule without making the pool. Never destroyed, so usable without
/// the directory's lock, where a pool set current may be closed by another thread meanwhile.
inline pool* current_default_pool(int device) noexcept {
  if (device < 0 || device >= max_devices) return nullptr;
  if (current_pools()[device].load(std::memory_order_acquire) != nullptr) return nullptr;
  return default_pools()[device].load(std::memory_order_acquire);
}
}  // namespace detail

/**
 * @brief Device `device`'s default pool, made on first use (default properties on that
 * device). It lives until the process ends.
 * @throws std::invalid_argument for a device that does not exist
 */
inline pool_ref default_pool(int device) {
  detail::check_device(device);
  std::array<std::atomic<pool*>, detail::max_devices>& defaults = detail::default_pools();
  static std::mutex m;
  if (pool* p = defaults[device].load(std::memory_order_acquire)) return *p;
  std::lock_guard lock(m);
  if (pool* p = defaults[device].load(std::memory_order_relaxed)) return *p;
  // Never destroyed: memory from it may be freed by static destructors anywhere. At exit it
  // gives back the free memory it caches, so leak checkers see only what was never freed.
  auto* p = new pool(pool_properties{.location = memory_location::device(device)});
  defaults[device].store(p, std::memory_order_release);
  static const bool trim_at_exit = [] {
    std::atexit([] {
      for (auto& slot : detail::default_pools()) {
        if (pool* q = slot.load(std::memory_order_acquire)) {
          try {
            q->trim_to(0);
          } catch (...) {  // the driver may already be shutting down: nothing more to do
          }
        }
      }
    });
    return true;
  }();
  (void)trim_at_exit;
  return *p;
}

/// Device `device`'s current pool: the one `set_current_pool` set, else its default pool.
/// Closing, destroying or moving from the pool set makes the default current again.
inline pool_ref current_pool(int device) {
  detail::check_device(device);
  if (detail::pool_state* p = detail::current_pools()[device].load(std::memory_order_acquire)) return pool_ref(*p);
  return default_pool(device);  // checks again: cached, no driver call
}

/// Makes `p` the current pool of `device`. The pool's memory must live on that device.
/// @throws std::invalid_argument otherwise, or when `p` is closed
inline void set_current_pool(int device, pool_ref p) {
  detail::check_device(device);
  if (p.closed()) throw std::invalid_argument("streamalloc::set_current_pool: the pool is closed");
  if (!(p.location() == memory_location::device(device))) {
    throw std::invalid_argument("streamalloc::set_current_pool: the pool's memory is on " + p.location().to_string() +
                                ", not on device " + std::to_string(device));
  }
  detail::current_pools()[device].store(detail::state_of(p), std::memory_order_release);
}

/// Allocates from the current pool of the stream's device. See `pool::allocate`.
[[nodiscard]] inline void* allocate(std::size_t bytes, stream_ref s) {
  return current_pool(s.device()).allocate(bytes, s);
}

/// Rejected: a raw `cudaStream_t`, `0` or `nullptr` as the stream (as for `pool::allocate`).
template <detail::raw_stream_argument S>
void* allocate(std::size_t, S) {
  static_assert(sizeof(S) == 0,
                "streamalloc::allocate: pass a cudaStream_t s as streamalloc::stream_ref{s}: "
                "streamalloc::allocate(bytes, streamalloc::stream_ref{s}); for stream 0 say "
                "streamalloc::stream_ref::legacy_default() (or per_thread_default())");
  return nullptr;
}

/// The pool whose address range holds `p`, if any.
[[nodiscard]] inline std::optional<pool_ref> find_pool(const void* p) {
  if (detail::pool_state* owner = detail::pools().find(reinterpret_cast<std::uint64_t>(p))) return pool_ref(*owner);
  return std::nullopt;
}

/// Frees memory from whichever streamalloc pool it came from. See `pool::deallocate`.
/// @throws std::invalid_argument for a pointer no pool owns
inline void deallocate(void* p, stream_ref s) {
  if (p == nullptr) return;
  auto owner = find_pool(p);
  if (!owner) throw std::invalid_argument("streamalloc::deallocate: the pointer belongs to no streamalloc pool");
  owner->deallocate(p, s);
}

/// Rejected: as for `allocate`.
template <detail::raw_stream_argument S>
void deallocate(void*, S) {
  static_assert(sizeof(S) == 0,
                "streamalloc::deallocate: pass a cudaStream_t s as streamalloc::stream_ref{s}: "
                "streamalloc::deallocate(p, streamalloc::stream_ref{s}); for stream 0 say "
                "streamalloc::stream_ref::legacy_default() (or per_thread_default())");
}

}  // namespace streamalloc
