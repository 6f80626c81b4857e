#pragma once

/// @file
/// @brief `pool`: a stream-ordered memory pool built on CUDA virtual memory management, with
/// the semantics of `cudaMemPool_t` and `cudaMallocAsync` / `cudaFreeAsync`.

#include <streamalloc/access.hpp>
#include <streamalloc/detail/context.hpp>
#include <streamalloc/detail/pool_core.hpp>
#include <streamalloc/detail/vmm_backend.hpp>
#include <streamalloc/driver.hpp>
#include <streamalloc/memory_location.hpp>
#include <streamalloc/physical_allocation.hpp>
#include <streamalloc/placement.hpp>
#include <streamalloc/shareable_handle.hpp>
#include <streamalloc/stream.hpp>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace streamalloc {

/**
 * @brief Which cross-stream reuse a pool may make without a host synchronization. A block
 * freed on a stream is always reusable at once by that stream, and by every stream once the
 * host has synchronized with it (or with an event recorded after the free).
 */
struct reuse_policy {
  /// Reuse on stream B memory freed on A when B waited, through streamalloc's `stream_ref::wait`,
  /// on an event recorded on A after the free (directly or through other streams).
  bool follow_event_dependencies = true;
  /// Reuse memory whose free the device has already executed (found by querying an event the
  /// pool records on the freeing stream). Makes reuse depend on timing, so run-to-run
  /// allocation patterns can differ.
  bool opportunistic = true;
  /// When the pool cannot grow (at its maximum size, or out of device memory), make the
  /// allocating stream wait on a pending free instead of failing. Can serialize streams.
  bool internal_dependencies = true;
};

/// A pool's properties, validated when the pool is made.
struct pool_properties {
  /// Where the memory lives: a device, or a host NUMA node (readable and writable by the host).
  memory_location location = memory_location::device(0);
  /// The most physical memory the pool may hold; 0 for no limit but the device's. The pool
  /// holds whole granules of physical memory, so a size off the allocation granularity is
  /// rounded down to it (3 MiB with a 2 MiB granularity holds at most 2 MiB), and
  /// `pool::properties().max_size` gives the rounded value. Below one granule, or above 2^50
  /// bytes, it is refused.
  std::size_t max_size = 0;
  /// Free physical memory the pool keeps at synchronization points; the rest goes back to the
  /// driver. 0 (the default, as for cudaMemPool_t) keeps nothing; SIZE_MAX keeps everything.
  std::size_t release_threshold = 0;
  reuse_policy reuse{};
  /// Physical memory is created in chunks of this size (a multiple of the allocation
  /// granularity); a request at least this large gets a chunk of its own size. 0: 64 MiB, the
  /// smallest size at which `cudaMemcpy` over the memory runs within 2% of cudaMalloc memory
  /// (docs/vmm-bandwidth.md), and with which the pool grows as fast as the driver's.
  std::size_t chunk_size = 0;
  /// Stay compact under fragmentation: chunks of the allocation granularity (2 MiB; or
  /// `chunk_size` if set), large requests built from them, so single chunks can be remapped to
  /// defragment. On a fragmenting workload the pool then holds about 1.08 times the live bytes
  /// instead of about 1.25 (docs/pool.md), at a cost: growth makes one physical allocation per
  /// 2 MiB (about 30 us each, against about 50 us per 64 MiB), and one large `cudaMemcpy` over
  /// an allocation spread over many chunks runs slower (docs/vmm-bandwidth.md).
  bool compact = false;
  /// Handle types the pool's memory can be exported as (kept for IPC).
  shareable_handle_type handle_types = shareable_handle_type::none;
  /// The most virtual addresses the pool reserves; 0: four times the maximum size, or four
  /// times the memory of the location (at most 2^50 bytes). Defragmentation and growth in
  /// place need addresses beyond the physical memory, and the pool never grows past them: each
  /// growth maps a chunk (`chunk_size`) or a large request whole into unmapped addresses. They
  /// are reserved as needed: 8 GiB (or 16 chunks, or all of them if less) when the pool is
  /// made, then each time at least as much again as the pool holds, so thousands of pools fit
  /// in a process. Above 2^50 bytes it is refused (no device's address space is that large).
  std::size_t address_space = 0;
};

/// A pool's statistics. "Current" values are exact; see `used_high` for concurrency.
struct pool_statistics {
  std::size_t reserved_current = 0;  ///< physical memory the pool holds
  std::size_t reserved_high = 0;     ///< its high-water mark since creation or reset
  std::size_t used_current = 0;      ///< bytes of live allocations (rounded to 256)
  /// High-water mark of used_current. Exact when one stream allocates at a time; with several
  /// streams allocating at once, a peak is caught whenever one of them reaches a peak of its
  /// own, so a combined peak between those moments can be missed.
  std::size_t used_high = 0;
  std::size_t live_allocations = 0;
  std::size_t free_clear = 0;        ///< free bytes every stream may reuse now
  std::size_t free_pending = 0;      ///< free bytes awaiting proof of stream order
  /// The largest free block: the largest allocation that could be served without growing
  /// (by the stream that freed it, if it is still pending).
  std::size_t largest_free_block = 0;
  std::size_t chunks = 0;            ///< physical allocations mapped
  std::size_t remapped_chunks = 0;   ///< chunks moved to defragment, since creation
};

/**
 * @brief An allocation failed: the pool is at its maximum size, or the device is out of
 * memory. `what()` gives the requested size and the pool's state.
 */
class out_of_memory : public std::bad_alloc {
 public:
  out_of_memory(std::size_t requested, std::string message)
      : requested_(requested), message_(std::move(message)) {}
  [[nodiscard]] const char* what() const noexcept override { return message_.c_str(); }
  [[nodiscard]] std::size_t requested() const noexcept { return requested_; }

 private:
  std::size_t requested_;
  std::string message_;
};

/**
 * @brief A pool was used after `close()`: its memory and addresses are gone. `what()` names
 * the member that was called.
 */
class pool_closed : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

class pool;

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
  const pool* owner;      ///< the pool it was freed to
  const char* operation;  ///< the free that was called, as "streamalloc::pool_resource::deallocate"
  const char* reason;     ///< what the checking form would have thrown
};

/// Called with each bad free found by a free that may not throw. It must not throw; it may
/// return (the free is then ignored: nothing is freed, nothing changes), log, or end the program.
using bad_free_handler = void (*)(const bad_free&) noexcept;

namespace detail {
/// The default handler (defined after `pool`, whose location it names).
inline void abort_on_bad_free(const bad_free& b) noexcept;
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

/// What was left when a pool was closed.
struct pool_close_report {
  std::size_t live_allocations = 0;
  std::size_t live_bytes = 0;
};

class pool_ref;

namespace detail {
using vmm_pool_core = pool_core<vmm_backend>;

/// Every live pool's reservations, by address, for finding the pool of a pointer (a lookup in
/// a process with thousands of pools costs a map search, not a walk over them).
class pool_directory {
 public:
  void add(pool* p, std::uint64_t base, std::uint64_t size) {
    std::unique_lock lock(mutex_);
    entries_[base] = {base + size, p};
  }
  void remove(pool* p) {
    std::unique_lock lock(mutex_);
    std::erase_if(entries_, [p](const auto& e) { return e.second.owner == p; });
  }
  pool* find(std::uint64_t addr) {
    std::shared_lock lock(mutex_);
    auto it = entries_.upper_bound(addr);
    if (it == entries_.begin()) return nullptr;
    --it;
    return addr < it->second.end ? it->second.owner : nullptr;
  }

 private:
  struct entry {
    std::uint64_t end;
    pool* owner;
  };
  std::shared_mutex mutex_;
  std::map<std::uint64_t, entry> entries_;  // reservation base -> its end, its pool
};

inline pool_directory& pools() {
  static pool_directory* d = new pool_directory;  // outlives every pool, default pools included
  return *d;
}

inline stream_key key_of(stream_ref s) { return {&s.record(), s.get()}; }

/// A closing pool stops being any device's current pool (defined after `pool`).
inline void forget_current_pool(pool* p) noexcept;

/// The largest `max_size`, `address_space` or `chunk_size` a pool accepts: 2^50 bytes (1 PiB).
/// No device addresses that much (Hopper's virtual address space is 2^49 bytes), and keeping
/// sizes far below 2^64 leaves the pool's arithmetic (four times the size, rounding up to the
/// granularity) free of overflow.
inline constexpr std::size_t max_pool_bytes = std::size_t{1} << 50;

/// The handle types streamalloc knows; any other bit is refused when a pool is made.
inline constexpr unsigned known_handle_types =
    static_cast<unsigned>(shareable_handle_type::posix_fd) | static_cast<unsigned>(shareable_handle_type::fabric);

/// "posix_fd", "posix_fd | fabric", for messages.
inline std::string handle_type_names(shareable_handle_type t) {
  std::string s;
  if (has_handle_type(t, shareable_handle_type::posix_fd)) s = "posix_fd";
  if (has_handle_type(t, shareable_handle_type::fabric)) s += s.empty() ? "fabric" : " | fabric";
  return s.empty() ? "none" : s;
}

/// The pseudo-stream of synchronous allocations: no CUDA stream, and every free on it is
/// complete when made (the caller promises no work uses the memory any more), so what it
/// frees is reusable by every stream as soon as the pool looks.
inline stream_key host_key() {
  static stream_record& r = [] () -> stream_record& {
    stream_record& rec = ordering().record(~std::uint64_t{0});
    rec.mark_completed(~std::uint64_t{0} >> 1);
    return rec;
  }();
  return {&r, nullptr};
}
}  // namespace detail

/**
 * @brief A stream-ordered memory pool (the semantics of `cudaMemPool_t` with
 * `cudaMallocAsync` / `cudaFreeAsync`), implemented on the VMM API.
 *
 * The pool reserves virtual addresses up front and maps physical memory in chunks as it grows.
 * Memory freed on a stream is reused by that stream at once, with no driver call; other
 * streams reuse it as the reuse policy allows. Thread-safe: any number of threads may allocate
 * and free, on their own streams or shared ones.
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
class pool {
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
  explicit pool(pool_properties props = {}) : props_(props) {
    require_driver();
    const int device = props.location.is_device() ? props.location.id() : 0;
    device_ = device;
    if (props.location.is_device() && props.location.id() >= device_count()) {
      throw std::invalid_argument("streamalloc::pool: there is no device " + std::to_string(props.location.id()));
    }
    check_sizes(props);
    if ((static_cast<unsigned>(props.handle_types) & ~detail::known_handle_types) != 0) {
      throw std::invalid_argument("streamalloc::pool: pool_properties::handle_types " +
                                  std::to_string(static_cast<unsigned>(props.handle_types)) +
                                  " has bits no shareable_handle_type names (posix_fd, fabric)");
    }
    require_location(props.location, device);
    if (props.handle_types != shareable_handle_type::none && props.location.is_device()) {
      require_handle_types(device, props.handle_types);
    }
    const allocation_options opts{props.handle_types, false};
    const std::size_t g = allocation_granularity(props.location, granularity_kind::minimum, opts);
    if (props.chunk_size != 0 && props.chunk_size % g != 0) {
      throw std::invalid_argument("streamalloc::pool: chunk_size " + std::to_string(props.chunk_size) +
                                  " is not a multiple of the allocation granularity " + std::to_string(g));
    }
    if (props.max_size != 0 && props.max_size < g) {
      throw std::invalid_argument("streamalloc::pool: max_size " + std::to_string(props.max_size) +
                                  " is below the allocation granularity " + std::to_string(g));
    }
    // Physical memory comes in granules: a limit between two holds the smaller, so that the
    // pool never holds more than max_size.
    props_.max_size = props.max_size / g * g;
    probe(props.location, opts, g);
    std::size_t space = props.address_space;
    if (space == 0) {
      std::size_t physical = props_.max_size;
      if (physical == 0) {
        physical = props.location.is_device()
                       ? device_memory(device).total
                       : static_cast<std::size_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
      }
      // Room for runs to grow in place (large allocations start in the middle of free
      // addresses) and for defragmentation to remap into: addresses cost nothing until mapped.
      // Capped, so that neither a huge memory nor the product overflows.
      space = physical > detail::max_pool_bytes / 4 ? detail::max_pool_bytes : 4 * physical;
    }
    std::vector<access_descriptor> access{{props.location, access_flags::read_write}};
    if (props.location.is_host()) access.push_back({memory_location::device(device), access_flags::read_write});
    detail::core_options o;
    o.max_size = props_.max_size;
    o.release_threshold = props.release_threshold;
    o.chunk_size = props.compact && props.chunk_size == 0 ? g : props.chunk_size;
    o.own_chunk_for_large = !props.compact;
    o.address_space = space;
    props_.address_space = space;  // properties() reports the limit in force
    o.on_reserve = [this](std::uint64_t base, std::uint64_t size) { detail::pools().add(this, base, size); };
    o.reuse = {props.reuse.follow_event_dependencies, props.reuse.opportunistic, props.reuse.internal_dependencies};
    detail::ensure_context(device);
    try {
      core_ = std::make_unique<detail::vmm_pool_core>(detail::vmm_backend(props.location, opts, std::move(access)), o);
    } catch (...) {
      detail::pools().remove(this);
      throw;
    }
  }

  pool(const pool&) = delete;
  pool& operator=(const pool&) = delete;

  /// Destroys the pool. Live allocations are reported on stderr (use `close()` to get the
  /// report instead) and their memory is released after the device has finished its work.
  ~pool() {
    if (!core_) return;
    const pool_close_report r = close();
    if (r.live_allocations != 0) {
      std::fprintf(stderr,
                   "streamalloc: a pool on %s was destroyed with %zu live allocation(s), %zu bytes; "
                   "their memory has been released\n",
                   props_.location.to_string().c_str(), r.live_allocations, r.live_bytes);
    }
  }

  /**
   * @brief Releases everything now and reports what was never freed. Work ordered before the
   * pool's frees is waited for: when a free may still be running on the device, or allocations
   * are still live, the host first synchronizes with the device whose streams use the memory,
   * so nothing is unmapped under running work. The pool cannot be used afterwards (every
   * member but `closed`, `owns`, `properties`, `location`, `device` and `close` throws
   * `pool_closed`); if it is some device's current pool, that device's default pool becomes
   * current again.
   */
  pool_close_report close() noexcept {
    if (!core_) return {};
    detail::pools().remove(this);
    detail::forget_current_pool(this);
    const auto live = core_->statistics().live_allocations;
    if (live != 0 || core_->frees_in_flight()) {
      try {
        synchronize_device(device_);
      } catch (...) {  // a lost context: no work of it runs any more
      }
    }
    const auto [count, bytes] = core_->shutdown();
    core_.reset();
    return {static_cast<std::size_t>(count), static_cast<std::size_t>(bytes)};
  }

  /// True once `close()` has run: the pool then holds nothing and refuses every use.
  [[nodiscard]] bool closed() const noexcept { return core_ == nullptr; }

  /**
   * @brief Allocates `bytes` in the order of stream `s`: usable by work enqueued on `s` after
   * this call, and by other streams once they are ordered after it. Never blocks the host or
   * synchronizes the device. Aligned to 256 bytes. `bytes == 0` returns nullptr.
   * @param where for a request of at least the chunk size that makes the pool grow: packed
   *        with the other large allocations (fastest), or with room to grow in place after it
   * @throws out_of_memory when the pool is at its maximum size, the device has no memory, or
   *         the pool's addresses (`pool_properties::address_space`) are used up (then it says so)
   * @throws std::invalid_argument when `s` belongs to a device that cannot use the pool's
   *         memory (another device than a device pool's; for a host pool, another device than
   *         the one it was made for)
   * @throws pool_closed after `close()`
   */
  [[nodiscard]] void* allocate(std::size_t bytes, stream_ref s, placement where = placement::packed) {
    if (!core_) [[unlikely]] throw_closed("allocate");
    if (bytes == 0) return nullptr;
    const detail::stream_key key = detail::key_of(s);
    if (key.record->device() != device_) [[unlikely]] throw_wrong_device("allocate", key.record->device());
    return allocate_keyed(bytes, key, where);
  }

  /**
   * @brief Frees `p` in the order of stream `s`: work enqueued on `s` before this call may still
   * use it; every other stream that used it must be ordered before this point. nullptr is
   * ignored.
   * @throws std::invalid_argument, changing nothing, when `p` is not a live allocation of this
   *         pool (a foreign pointer, an interior pointer, or a double free), or when `s`
   *         belongs to another device than the one `allocate` takes streams of
   * @throws pool_closed after `close()` (the memory is gone already)
   */
  void deallocate(void* p, stream_ref s) {
    if (!core_) [[unlikely]] throw_closed("deallocate");
    if (p == nullptr) return;
    const detail::stream_key key = detail::key_of(s);
    if (key.record->device() != device_) [[unlikely]] throw_wrong_device("deallocate", key.record->device());
    core_->deallocate(reinterpret_cast<std::uint64_t>(p), key);
  }

  /**
   * @brief Allocates `bytes` ordered with the host rather than a stream (like `cudaMalloc`):
   * the memory is usable at once by every stream, and by the host for a host pool. It never
   * comes from memory whose free may still be pending on a stream; when only such memory is
   * left, the host waits for the frees (so this may block). `bytes == 0` returns nullptr.
   * @throws out_of_memory, pool_closed
   */
  [[nodiscard]] void* allocate_sync(std::size_t bytes) {
    if (!core_) [[unlikely]] throw_closed("allocate_sync");
    return allocate_keyed(bytes, detail::host_key());
  }

  /**
   * @brief Frees `p` now (like `cudaFree`, without its synchronization): the caller promises
   * that no work still uses it; the memory is reusable at once by every stream.
   * @throws std::invalid_argument, changing nothing, for a pointer that is not live here
   * @throws pool_closed after `close()`
   */
  void deallocate_sync(void* p) {
    if (!core_) [[unlikely]] throw_closed("deallocate_sync");
    if (p == nullptr) return;
    core_->deallocate(reinterpret_cast<std::uint64_t>(p), detail::host_key());
  }

  /**
   * @brief Makes the live allocation at `p` at least `bytes` long without moving it, by taking
   * the free memory right after it or mapping new physical memory behind it. Ordered on `s`:
   * the added bytes are usable by work enqueued on `s` after the call (their contents are
   * undefined). No copy is made and `p` stays valid.
   * @return the allocation's new size (>= bytes, a multiple of 256), or 0 when the addresses
   *         after it are taken (nothing changed: allocate, copy and free instead). A large
   *         allocation made with `placement::room_to_grow` has unused addresses after it.
   * @throws std::invalid_argument when `p` is not a live allocation of this pool
   * @throws pool_closed after `close()`
   */
  std::size_t grow_in_place(void* p, std::size_t bytes, stream_ref s) {
    if (!core_) [[unlikely]] throw_closed("grow_in_place");
    if (bytes > (std::size_t{1} << 62)) [[unlikely]] return 0;
    const detail::stream_key key = detail::key_of(s);
    if (key.record->device() != device_) [[unlikely]] throw_wrong_device("grow_in_place", key.record->device());
    return static_cast<std::size_t>(core_->grow_in_place(reinterpret_cast<std::uint64_t>(p), bytes, key));
  }

  /**
   * @brief Makes the live allocation at `p` `bytes` long without moving it; the rest is freed
   * in the order of `s` (work enqueued on `s` before may still use it; reusable by `s` at once).
   * @return the allocation's new size (a multiple of 256, at least 256)
   * @throws std::invalid_argument when `p` is not a live allocation of this pool
   * @throws pool_closed after `close()`
   */
  std::size_t shrink_in_place(void* p, std::size_t bytes, stream_ref s) {
    if (!core_) [[unlikely]] throw_closed("shrink_in_place");
    const detail::stream_key key = detail::key_of(s);
    if (key.record->device() != device_) [[unlikely]] throw_wrong_device("shrink_in_place", key.record->device());
    return static_cast<std::size_t>(core_->shrink_in_place(reinterpret_cast<std::uint64_t>(p), bytes, key));
  }

  /// True if `p` lies in the pool's address range (live or not); false once the pool is closed.
  [[nodiscard]] bool owns(const void* p) const noexcept {
    return core_ && core_->owns(reinterpret_cast<std::uint64_t>(p));
  }

  /// @throws pool_closed after `close()`
  [[nodiscard]] pool_statistics statistics() const {
    const auto c = core("statistics").statistics();
    pool_statistics s;
    s.reserved_current = c.reserved_current;
    s.reserved_high = c.reserved_high;
    s.used_current = c.used_current;
    s.used_high = c.used_high;
    s.live_allocations = c.live_allocations;
    s.free_clear = c.free_clear;
    s.free_pending = c.free_pending;
    s.largest_free_block = c.largest_free_block;
    s.chunks = c.chunks;
    s.remapped_chunks = c.remapped_chunks;
    return s;
  }
  /// Resets the high-water marks to the current values. @throws pool_closed after `close()`
  void reset_high_water() { core("reset_high_water").reset_high_water(); }

  /**
   * @brief Gives free physical memory back to the driver until at most `keep` bytes of it
   * remain. Only whole free chunks go, and only memory whose frees are known to have executed
   * (synchronize first to release everything).
   * @throws pool_closed after `close()`
   */
  void trim_to(std::size_t keep) { core("trim_to").trim_to(keep); }

  /**
   * @brief A synchronization point for the pool: blocks the host until the device has finished
   * all work (all devices', for a host pool), so every free made before is reusable by every
   * stream, then applies the release threshold.
   * @return for a device pool, the proof that the host saw the device's work finish
   * @throws cuda_error, pool_closed
   */
  host_order synchronize() {
    if (!core_) [[unlikely]] throw_closed("synchronize");
    if (props_.location.is_device()) return synchronize_device(props_.location.id());
    host_order last = synchronize_device(0);
    for (int d = 1; d < device_count(); ++d) last = synchronize_device(d);
    return last;
  }

  /// @throws pool_closed after `close()`
  void set_release_threshold(std::size_t bytes) {
    core("set_release_threshold").set_release_threshold(bytes);
    props_.release_threshold = bytes;
  }
  /// @throws pool_closed after `close()`
  void set_reuse_policy(reuse_policy r) {
    core("set_reuse_policy").set_reuse({r.follow_event_dependencies, r.opportunistic, r.internal_dependencies});
    props_.reuse = r;
  }

  /// The properties as the pool applies them (`max_size` rounded down to the granularity).
  [[nodiscard]] const pool_properties& properties() const noexcept { return props_; }
  [[nodiscard]] memory_location location() const noexcept { return props_.location; }
  /// The device whose streams allocate here and whose kernels use the memory (a device pool's
  /// own; for a host pool, the device it was made for).
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The allocation granularity of the pool's memory. @throws pool_closed after `close()`
  [[nodiscard]] std::size_t granularity() const { return core("granularity").granularity(); }

  /// The live allocation containing `p`: its start and size; nullopt if none.
  /// @throws pool_closed after `close()`
  [[nodiscard]] std::optional<std::pair<void*, std::size_t>> find_allocation(const void* p) {
    auto r = core("find_allocation").find_live(reinterpret_cast<std::uint64_t>(p));
    if (!r) return std::nullopt;
    return std::pair{reinterpret_cast<void*>(r->first), static_cast<std::size_t>(r->second)};
  }

 private:
  /// The core, for a member that is not on an allocation's path; throws once closed.
  detail::vmm_pool_core& core(const char* member) const {
    if (!core_) [[unlikely]] throw_closed(member);
    return *core_;
  }

  [[noreturn]] STREAMALLOC_COLD static void throw_closed(const char* member) {
    throw pool_closed(std::string("streamalloc::pool::") + member +
                      ": the pool is closed (close() released its memory and addresses)");
  }

  [[noreturn]] STREAMALLOC_COLD void throw_wrong_device(const char* member, int stream_device) const {
    const std::string advice = std::string(member) == "allocate"
                                   ? "allocate from that device's pool (streamalloc::current_pool(" +
                                         std::to_string(stream_device) + "))"
                                   : "use a stream of device " + std::to_string(device_);
    throw std::invalid_argument(std::string("streamalloc::pool::") + member + ": the stream belongs to device " +
                                std::to_string(stream_device) + ", but this pool's memory (" +
                                props_.location.to_string() + ") is for device " + std::to_string(device_) + "; " +
                                advice);
  }

  /// Refuses sizes no device could serve, before anything is computed from them.
  static void check_sizes(const pool_properties& props) {
    const auto refuse = [](const char* name, std::size_t v) {
      throw std::invalid_argument(std::string("streamalloc::pool: pool_properties::") + name + " " + std::to_string(v) +
                                  " is above 2^50 bytes (1 PiB): no device address space is that large");
    };
    if (props.max_size > detail::max_pool_bytes) refuse("max_size", props.max_size);
    if (props.address_space > detail::max_pool_bytes) refuse("address_space", props.address_space);
    if (props.chunk_size > detail::max_pool_bytes) refuse("chunk_size", props.chunk_size);
  }

  /**
   * Creates and releases one granule with the pool's properties, so that a property the
   * driver refuses (a host NUMA node that does not exist, a handle type the device cannot
   * create, such as fabric without its service) fails when the pool is made, not at its first
   * allocation. A lack of memory is no fault of the properties: the pool may still be used
   * once memory is freed.
   */
  static void probe(memory_location where, const allocation_options& opts, std::size_t g) {
    try {
      const physical_allocation granule(g, where, opts);
    } catch (const driver_unavailable&) {
      throw;
    } catch (const cuda_error& e) {
      if (e.code() == CUDA_ERROR_OUT_OF_MEMORY) return;
      refuse_properties(e, where, opts, g);
    }
  }

  [[noreturn]] STREAMALLOC_COLD static void refuse_properties(const cuda_error& e, memory_location where,
                                                               const allocation_options& opts, std::size_t g) {
    // The driver's code rarely says which property it refused: when the same location
    // without handle types works, the handle types are at fault.
    bool handle_types_refused = false;
    if (opts.handle_types != shareable_handle_type::none) {
      try {
        physical_allocation plain(g, where, {});
        handle_types_refused = true;
      } catch (const cuda_error&) {
      }
    }
    const std::string property =
        handle_types_refused ? "pool_properties::handle_types (" + detail::handle_type_names(opts.handle_types) +
                                   ") on " + where.to_string()
                             : "pool_properties::location (" + where.to_string() + ")";
    const std::string what = "streamalloc::pool: the driver refused " + property + ": creating one granule (" +
                             std::to_string(g) + " bytes) with it failed when the pool was made";
    if (dynamic_cast<const not_supported*>(&e) != nullptr) throw not_supported(what + " (" + e.what() + ")");
    throw cuda_error(e.code(), e.call(), what);
  }

  /// The part of an out-of-memory message that blames the addresses, when they are short:
  /// when the least the pool could have grown by for `bytes` does not fit in the addresses it
  /// may still use (every mapped byte takes one address, so at most `address_space - reserved`
  /// are left), or when the driver refused to reserve more (the process's addresses ran out),
  /// growing was impossible whatever memory the device has. Addresses too fragmented for the
  /// growth are not detected: the message then says nothing rather than blame them wrongly.
  std::string address_shortage(std::size_t bytes) const {
    const auto& o = core_->options();
    const std::uint64_t g = core_->granularity();
    const std::uint64_t space = core_->address_space();
    const std::uint64_t mapped = core_->statistics().reserved_current;
    const std::uint64_t taken = core_->addresses_reserved();
    // A request of a chunk or more (outside compact pools) grows by its own size, rounded to
    // the granularity; any other by whole chunks, at least one (fewer bytes when extending a
    // free tail, but never less than a chunk), except under max_size, where a single granule
    // may do.
    std::uint64_t least = o.max_size == 0 ? o.chunk_size : g;
    if (o.own_chunk_for_large && bytes >= o.chunk_size) least = (bytes + g - 1) / g * g;
    if (const std::uint64_t refused = core_->refused_reservation(); refused != 0) {
      return " (the process's virtual addresses ran out: the driver refused to reserve " + std::to_string(refused) +
             " more bytes of addresses for the pool, which holds " + std::to_string(taken) + " bytes of addresses, " +
             std::to_string(mapped) + " of them mapped)";
    }
    if (mapped <= space && least <= space - mapped) return {};
    return " (the pool's addresses are used up: it may reserve " + std::to_string(space) + " bytes of addresses, " +
           std::to_string(mapped) + " of them mapped, and growing for this request needs " + std::to_string(least) +
           " more: raise pool_properties::address_space)";
  }

  void* allocate_keyed(std::size_t bytes, detail::stream_key key, placement where = placement::packed) {
    if (bytes == 0) return nullptr;
    if (bytes > (std::size_t{1} << 62)) [[unlikely]] {
      throw out_of_memory(bytes, "streamalloc: " + std::to_string(bytes) + " bytes is more than any pool can hold");
    }
    try {
      return reinterpret_cast<void*>(core_->allocate(bytes, key, where));
    } catch (const detail::core_out_of_memory& e) {
      throw out_of_memory(bytes, "streamalloc: cannot allocate " + std::to_string(bytes) + " bytes from a pool on " +
                                     props_.location.to_string() + ": " + e.reason + address_shortage(bytes));
    }
  }

  pool_properties props_;
  int device_ = 0;  ///< the device whose streams may allocate here
  std::unique_ptr<detail::vmm_pool_core> core_;
};

/**
 * @brief A non-owning, trivially copyable reference to a `pool`.
 */
class pool_ref {
 public:
  pool_ref(pool& p) noexcept : pool_(&p) {}  // NOLINT: an owner views as its ref
  [[nodiscard]] void* allocate(std::size_t bytes, stream_ref s, placement where = placement::packed) const {
    return pool_->allocate(bytes, s, where);
  }
  void deallocate(void* p, stream_ref s) const { pool_->deallocate(p, s); }
  [[nodiscard]] bool owns(const void* p) const noexcept { return pool_->owns(p); }
  [[nodiscard]] pool_statistics statistics() const { return pool_->statistics(); }
  void trim_to(std::size_t keep) const { pool_->trim_to(keep); }
  [[nodiscard]] pool& get() const noexcept { return *pool_; }
  friend bool operator==(pool_ref a, pool_ref b) noexcept { return a.pool_ == b.pool_; }

 private:
  pool* pool_;
};

namespace detail {
/// Like a C library's double-free check: say what happened and abort, because a program that
/// frees what it does not own has already lost track of its memory.
inline void abort_on_bad_free(const bad_free& b) noexcept {
  std::string where = "a closed pool";
  try {
    if (b.owner != nullptr && !b.owner->closed()) where = "the pool on " + b.owner->location().to_string();
  } catch (...) {  // out of memory: the message goes without the pool's location
  }
  std::fprintf(stderr, "streamalloc: %s: bad free of %p to %s: %s\n", b.operation, b.pointer, where.c_str(), b.reason);
  std::abort();
}

/// Runs a checking free (one that throws) where a free may not throw: a bad free goes to the
/// bad-free handler; any other failure (out of host memory for the stream's state) leaves the
/// allocation live, which the pool reports when it is closed, and says so on stderr. A pool
/// closed already gave its memory back: there is nothing left to free.
template <class Free>
void free_or_report(const pool& owner, const void* p, const char* operation, Free&& free) noexcept {
  if (owner.closed()) return;
  try {
    free();
  } catch (const std::invalid_argument& e) {
    get_bad_free_handler()(bad_free{p, &owner, operation, e.what()});
  } catch (const pool_closed&) {  // closed meanwhile by another thread: as above
  } catch (const std::exception& e) {
    std::fprintf(stderr, "streamalloc: %s: the free of %p was not made and the allocation stays live: %s\n",
                 operation, p, e.what());
  } catch (...) {
    std::fprintf(stderr, "streamalloc: %s: the free of %p was not made and the allocation stays live\n", operation,
                 p);
  }
}

inline std::array<std::atomic<pool*>, max_devices>& current_pools() {
  static std::array<std::atomic<pool*>, max_devices> p{};
  return p;
}
inline void forget_current_pool(pool* p) noexcept {
  for (auto& slot : current_pools()) {
    pool* expected = p;
    slot.compare_exchange_strong(expected, nullptr, std::memory_order_acq_rel);
  }
}
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
}  // namespace detail

/**
 * @brief Device `device`'s default pool, made on first use (default properties on that
 * device). It lives until the process ends.
 * @throws std::invalid_argument for a device that does not exist
 */
inline pool_ref default_pool(int device) {
  detail::check_device(device);
  static std::array<std::atomic<pool*>, detail::max_devices> defaults{};
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
      for (auto& slot : defaults) {
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
inline pool_ref current_pool(int device) {
  detail::check_device(device);
  if (pool* p = detail::current_pools()[device].load(std::memory_order_acquire)) return *p;
  return default_pool(device);  // checks again: cached, no driver call
}

/// Makes `p` the current pool of `device`. The pool's memory must live on that device.
/// @throws std::invalid_argument otherwise
inline void set_current_pool(int device, pool_ref p) {
  detail::check_device(device);
  if (!(p.get().location() == memory_location::device(device))) {
    throw std::invalid_argument("streamalloc::set_current_pool: the pool's memory is on " +
                                p.get().location().to_string() + ", not on device " + std::to_string(device));
  }
  detail::current_pools()[device].store(&p.get(), std::memory_order_release);
}

/// Allocates from the current pool of the stream's device. See `pool::allocate`.
[[nodiscard]] inline void* allocate(std::size_t bytes, stream_ref s) {
  return current_pool(s.device()).allocate(bytes, s);
}

/// Frees memory from whichever streamalloc pool it came from. See `pool::deallocate`.
/// @throws std::invalid_argument for a pointer no pool owns
inline void deallocate(void* p, stream_ref s);

/// The pool whose address range holds `p`, if any.
[[nodiscard]] inline std::optional<pool_ref> find_pool(const void* p) {
  if (pool* owner = detail::pools().find(reinterpret_cast<std::uint64_t>(p))) return pool_ref(*owner);
  return std::nullopt;
}

inline void deallocate(void* p, stream_ref s) {
  if (p == nullptr) return;
  auto owner = find_pool(p);
  if (!owner) throw std::invalid_argument("streamalloc::deallocate: the pointer belongs to no streamalloc pool");
  owner->deallocate(p, s);
}

}  // namespace streamalloc
