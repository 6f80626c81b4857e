#pragma once

/// @file
/// @brief `device_arena`: a region taken from a pool in the order of a stream, from which
/// kernels allocate with an atomic offset (`device_arena_view::allocate`), reset and freed in
/// stream order; `device_arena_view`, the trivially copyable view kernels take; and
/// `device_block_arena`, a block's sub-arena in shared memory.
///
/// The host part compiles with any C++20 compiler; the device members are defined only where
/// a CUDA compiler reads this header (declared everywhere, so the types are the same in every
/// translation unit).

#include <streamalloc/detail/core/arena_bump.hpp>
#include <streamalloc/ordering.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/resource.hpp>
#include <streamalloc/stream.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

// The members kernels call are declared for every compiler, so that the types are the same in
// every translation unit, and defined only for a CUDA compiler (at the end of this header).
#if defined(__CUDACC__)
#define STREAMALLOC_DEVICE __device__
#define STREAMALLOC_HOST_DEVICE __host__ __device__
#else
/// Marks the members kernels call: `__device__` under a CUDA compiler, nothing for a host
/// compiler, which sees their declarations only.
#define STREAMALLOC_DEVICE
/// Marks the members both host and device code call: `__host__ __device__` under a CUDA
/// compiler, nothing for a host compiler.
#define STREAMALLOC_HOST_DEVICE
#endif

namespace streamalloc {

namespace detail {
/// The arena's pool allocation: this header (the offset at 0, the failure count at 128, apart
/// so that counting failures does not contend with allocation), then the region.
inline constexpr std::size_t arena_header_bytes = 256;
inline constexpr std::size_t arena_failures_at = 128;
/// The largest capacity: keeps the offset from wrapping however many callers fail
/// (detail/core/arena_bump.hpp, point 4).
inline constexpr std::size_t arena_max_capacity = std::size_t{1} << 40;
}  // namespace detail

class device_block_arena;
namespace detail {
struct arena_access;
}

/// The state of a block's sub-arena (`device_arena_view::for_block`), which must live in
/// `__shared__` memory: opaque, and trivially constructible (a `__shared__` variable may have
/// no initializer).
class device_block_arena_state {
  friend class device_block_arena;
  friend class device_arena_view;
  std::byte* base_;
  unsigned long long capacity_;
  unsigned long long used_;
};

/**
 * @brief What kernels take to allocate from a `device_arena`: the region's base and capacity
 * and a pointer to its offset and failure count in device memory. Trivially copyable: pass
 * it by value to a kernel enqueued on the arena's stream.
 *
 * `allocate` hands out disjoint ranges of the region and never fails but for want of room:
 * then it returns nullptr and counts the failure, readable by the host (`device_arena::usage`)
 * and by kernels (`failures()`). Lanes of a warp that call it at once share one atomic.
 * @code
 * __global__ void k(streamalloc::device_arena_view arena, int** out) {
 *   int* p = static_cast<int*>(arena.allocate(64 * sizeof(int)));
 *   if (p == nullptr) return;   // the region is full: counted, nothing else changed
 *   ...
 * }
 * @endcode
 */
class device_arena_view {
 public:
  /// An empty view: every allocation returns nullptr (and counts nothing).
  device_arena_view() = default;

  /// The region's first byte (aligned to 256).
  [[nodiscard]] STREAMALLOC_HOST_DEVICE std::byte* base() const noexcept { return base_; }
  /// The region's size in bytes.
  [[nodiscard]] STREAMALLOC_HOST_DEVICE std::size_t capacity() const noexcept { return capacity_; }
  /// The offset's address in device memory: the bytes handed out since the last reset;
  /// `capacity() + 1` once a request did not fit (the arena is closed until reset).
  [[nodiscard]] STREAMALLOC_HOST_DEVICE unsigned long long* offset() const noexcept { return offset_; }
  /// Is it a view of an arena?
  [[nodiscard]] STREAMALLOC_HOST_DEVICE explicit operator bool() const noexcept { return offset_ != nullptr; }

  /**
   * @brief `bytes` of the region aligned to `alignment`, for the calling thread; nullptr when
   * the region has no room left (counted as a failure), when `bytes` or `alignment` exceeds
   * the capacity or `alignment` is not a power of two (counted too, the arena unchanged), or
   * when `bytes` is 0 (not counted). The first request that does not fit closes the arena
   * until it is reset: later requests fail too, even small ones the rest of the region would
   * have held. The lanes of a warp that call at once share one atomic add of the offset.
   * Sizes are rounded up to 16 bytes; an alignment above 16 costs up to `alignment - 16`
   * bytes more. The memory is uninitialized, and the thread's until the arena is reset or
   * freed.
   */
  STREAMALLOC_DEVICE void* allocate(std::size_t bytes, std::size_t alignment = 16) const;

  /// Bytes handed out (the capacity once the arena is closed), as this thread reads them now.
  STREAMALLOC_DEVICE std::size_t used() const;
  /// Failed allocations since the arena was made or reset, as this thread reads them now.
  STREAMALLOC_DEVICE unsigned long long failures() const;

  /**
   * @brief Makes a sub-arena of `bytes` for the calling block, kept in `shared` (a
   * `__shared__` variable): one thread takes the bytes from this arena at once (they are
   * the block's until the arena is reset; what the block leaves unused is not given back).
   * Every thread of the block must call it: it synchronizes the block, before and after
   * taking the memory, so calling it again with the same state ends the first sub-arena. If
   * the arena cannot give the bytes, the sub-arena is empty and every allocation goes to the
   * arena.
   */
  STREAMALLOC_DEVICE device_block_arena for_block(device_block_arena_state& shared, std::size_t bytes) const;

 private:
  // Made by device_arena through arena_access: a friend that is the same in every ordering
  // mode, so the view is one type wherever it is defined.
  friend struct detail::arena_access;
  friend class device_block_arena;
  STREAMALLOC_HOST_DEVICE device_arena_view(std::byte* base, std::size_t capacity, unsigned long long* offset,
                                            unsigned long long* failures) noexcept
      : base_(base), capacity_(capacity), offset_(offset), failures_(failures) {}

  std::byte* base_ = nullptr;
  std::size_t capacity_ = 0;
  unsigned long long* offset_ = nullptr;
  unsigned long long* failures_ = nullptr;
};

/**
 * @brief A block's sub-arena: memory one thread of the block took from a `device_arena_view`
 * at once, from which the block's threads allocate with shared-memory atomics. What it
 * cannot hold comes from the arena itself. Made by `device_arena_view::for_block`.
 * @code
 * __global__ void k(streamalloc::device_arena_view arena) {
 *   __shared__ streamalloc::device_block_arena_state st;
 *   auto block = arena.for_block(st, 64 << 10);   // every thread of the block calls it
 *   float* x = static_cast<float*>(block.allocate(n * sizeof(float)));
 * }
 * @endcode
 */
class device_block_arena {
 public:
  /**
   * @brief As `device_arena_view::allocate`: from the block's memory, else from the arena
   * (where a failure is counted). Any thread of the block, any number of times.
   */
  STREAMALLOC_DEVICE void* allocate(std::size_t bytes, std::size_t alignment = 16) const;
  /// Bytes of the block's memory handed out (`capacity()` once a request did not fit there).
  STREAMALLOC_DEVICE std::size_t used() const;
  /// Bytes the block took from the arena (0 when the arena could not give them).
  STREAMALLOC_DEVICE std::size_t capacity() const;

 private:
  friend class device_arena_view;
  device_block_arena_state* state_;
  device_arena_view parent_;
};

static_assert(std::is_trivially_copyable_v<device_arena_view>, "a kernel takes the view by value");
static_assert(std::is_trivially_copyable_v<device_block_arena>);
static_assert(std::is_trivially_default_constructible_v<device_block_arena_state>,
              "a __shared__ variable may have no initializer");

namespace detail {
/// Makes views for device_arena.
struct arena_access {
  static device_arena_view view(std::byte* base, std::size_t capacity, unsigned long long* offset,
                                unsigned long long* failures) noexcept {
    return {base, capacity, offset, failures};
  }
};
}  // namespace detail

/// What `device_arena::usage` read from the device.
struct device_arena_usage {
  std::size_t used;        ///< bytes handed out since the last reset (`capacity` once a request did not fit)
  std::size_t capacity;    ///< the region's size
  std::uint64_t failures;  ///< allocations that returned nullptr since the arena was made or reset
  host_order synchronized;  ///< the proof that the host saw the arena's stream finish, up to the read
};

inline namespace STREAMALLOC_ORDERING_MODE {  // see <streamalloc/ordering.hpp>

/**
 * @brief A region of device memory from which kernels allocate (`view().allocate(bytes)`),
 * taken from a pool in the order of a stream (its stream), reset and freed in that order.
 * Move-only; the memory goes back to the pool, on the arena's stream, when it is destroyed.
 *
 * The rules are those of `stream_buffer`, and spec/002's races are ruled out by them:
 * - kernels on the arena's stream use `view()`; kernels run one after another there, so
 *   allocations of one kernel never race a reset or another stream's;
 * - to allocate from it on another stream, move it there with proof that the new stream runs
 *   after its work: `set_stream(b, proof)`, or reset it there: `reset(b, proof)`;
 *   `set_stream(b)` and `reset(b)` without a proof do not compile;
 * - streams that allocate at the same time each take an arena of their own.
 * @code
 * streamalloc::stream s(0);
 * streamalloc::device_arena arena(64 << 20, s);       // 64 MiB from the current pool
 * build<<<grid, block, 0, s.get()>>>(arena.view());   // kernels allocate from it
 * consume<<<grid, block, 0, s.get()>>>(...);
 * arena.reset();                                      // on s: after both kernels
 * auto u = arena.usage();                             // copies on s and synchronizes it
 * @endcode
 */
class device_arena {
 public:
  /// Rejected: an arena is taken in the order of a stream.
  template <class U = void>
  explicit device_arena(std::size_t) {
    static_assert(detail::dependent_false_v<U>,
                  "streamalloc::device_arena: an arena is allocated in the order of a stream: "
                  "device_arena(capacity, stream) or device_arena(capacity, stream, resource)");
  }

  /**
   * @brief `capacity` bytes for kernels, on `s`, from the current pool of `s`'s device; the
   * counters are zeroed on `s`.
   * @throws std::invalid_argument for a capacity of 0 or above 2^40 bytes
   * @throws out_of_memory, cuda_error
   */
  device_arena(std::size_t capacity, stream_ref s) : device_arena(capacity, s, current_pool(s.device())) {}

  /// As above, from `r`'s pool, which must claim `device_accessible` (checked at compile time).
  template <class... Q>
  device_arena(std::size_t capacity, stream_ref s, pool_resource<Q...> r) : device_arena(capacity, s, r.pool()) {
    static_assert(has_property_v<device_accessible, Q...>,
                  "streamalloc::device_arena: kernels allocate from an arena, but the resource does not claim "
                  "device_accessible");
  }

  /// As above, from pool `p`. @throws std::invalid_argument when `s`'s device cannot use `p`'s memory
  device_arena(std::size_t capacity, stream_ref s, pool_ref p) : device_arena(capacity, s, p, nullptr) {}

  /// As above, from the pool under `r`, a `logging_resource` over a `pool_resource`: the
  /// arena's memory (region and counters) is a line of `r`'s log when taken (`allocate_async`)
  /// and one when freed (`free_async`); the log stays open while the arena lives. What kernels
  /// allocate from the arena is not logged (device code cannot write the log).
  /// @throws std::invalid_argument when `r` was moved from
  template <class... Q>
  device_arena(std::size_t capacity, stream_ref s, const logging_resource<pool_resource<Q...>>& r)
      : device_arena(capacity, s, r.upstream_resource().pool(), checked_log(detail::logging_access::log_of(r))) {
    static_assert(has_property_v<device_accessible, Q...>,
                  "streamalloc::device_arena: kernels allocate from an arena, but the resource does not claim "
                  "device_accessible");
  }

  /// Rejected: a raw `cudaStream_t` (or `0`): streams are taken as `stream_ref`, made explicitly.
  template <class... R>
  device_arena(std::size_t, cudaStream_t, R&&...) {
    static_assert(detail::dependent_false_v<R...>,
                  "streamalloc::device_arena: pass a cudaStream_t s as streamalloc::stream_ref{s}; for stream 0 say "
                  "streamalloc::stream_ref::legacy_default()");
  }

  /// Takes `o`'s memory; `o` is left empty, on the same stream and pool (its view is empty).
  device_arena(device_arena&& o) noexcept
      : pool_(o.pool_),
        log_(o.log_),
        stream_(o.stream_),
        memory_(std::exchange(o.memory_, nullptr)),
        capacity_(std::exchange(o.capacity_, 0)),
        last_use_(o.last_use_) {}
  /// Frees this arena's memory (as the destructor does), then takes `o`'s.
  device_arena& operator=(device_arena&& o) noexcept {
    if (this != &o) {
      release();
      pool_ = o.pool_;
      log_ = o.log_;
      stream_ = o.stream_;
      memory_ = std::exchange(o.memory_, nullptr);
      capacity_ = std::exchange(o.capacity_, 0);
      last_use_ = o.last_use_;
    }
    return *this;
  }
  device_arena(const device_arena&) = delete;
  device_arena& operator=(const device_arena&) = delete;

  /// Frees the whole arena back to its pool in the order of `stream()`: after every kernel
  /// enqueued there before. Once the pool is closed it does nothing (closing released it).
  ~device_arena() { release(); }

  /// The view for kernels enqueued on `stream()` (an empty one for a moved-from arena).
  [[nodiscard]] device_arena_view view() const {
    if (memory_ == nullptr) return {};
    touch();  // the kernel it is for comes after this: a proof made before it is too old
    return detail::arena_access::view(memory_ + detail::arena_header_bytes, capacity_,
                                      reinterpret_cast<unsigned long long*>(memory_),
                                      reinterpret_cast<unsigned long long*>(memory_ + detail::arena_failures_at));
  }
  /// The region's size in bytes (0 once moved from).
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }
  /// The stream the arena is ordered on.
  [[nodiscard]] stream_ref stream() const noexcept { return stream_; }
  /// The pool its memory comes from.
  [[nodiscard]] pool_ref pool() const noexcept { return pool_ref(*pool_); }

  /// Empties the arena on `stream()`: kernels enqueued after this allocate from the start
  /// again, and the failure count starts from 0. What was handed out must not be used after.
  /// @throws cuda_error
  void reset() {
    if (memory_ != nullptr) enqueue_memset(memory_, detail::arena_header_bytes);
  }

  /// Rejected: a reset on another stream needs proof that it runs after the arena's kernels.
  template <class U = void>
  void reset(stream_ref) {
    static_assert(detail::dependent_false_v<U>,
                  "streamalloc::device_arena::reset: reset() empties the arena on its own stream; on another stream "
                  "it needs proof that the stream runs after the kernels allocating from it: "
                  "reset(b, order_after(b, arena.stream())), reset(b, b.wait(event)) or reset(b, a.synchronize())");
  }

  /**
   * @brief Moves the arena to `s` (as `set_stream(s, proof)`) and empties it there.
   * @throws ordering_error (checks on) when the proof does not cover the arena's last use
   * @throws std::invalid_argument, cuda_error
   */
  template <class P>
  void reset(stream_ref s, const P& proof) {
    static_assert(ordering_proof<P>,
                  "streamalloc::device_arena::reset: the second argument must prove the ordering (a stream_order "
                  "from s.wait(event) or order_after, or a host_order from a synchronization)");
    set_stream(s, proof);
    reset();
  }

  /// Rejected: allocating on another stream needs proof that it runs after the arena's kernels.
  template <class U = void>
  void set_stream(stream_ref) {
    static_assert(detail::dependent_false_v<U>,
                  "streamalloc::device_arena::set_stream: an arena moves to another stream only with proof that the "
                  "new stream runs after the kernels allocating from it: set_stream(b, order_after(b, a)), "
                  "set_stream(b, b.wait(event)) or set_stream(b, a.synchronize())");
  }

  /**
   * @brief Moves the arena to stream `s`: its kernels, resets and free happen in `s`'s order
   * from now on. `proof` shows that `s` runs after the arena's last use on its stream.
   * @throws ordering_error (checks on) when the proof is for other streams or too old
   * @throws std::invalid_argument when `s` belongs to a device that cannot use the memory
   */
  template <class P>
  void set_stream(stream_ref s, const P& proof) {
    static_assert(ordering_proof<P>,
                  "streamalloc::device_arena::set_stream: the second argument must prove the ordering; a stream or an "
                  "event proves nothing (use the stream_order of s.wait(event) or order_after(s, current), or the "
                  "host_order of a synchronization)");
    if (s == stream_) return;
    if (pool_ != nullptr && !pool_->serves(s.device())) [[unlikely]] {
      throw std::invalid_argument("streamalloc::device_arena::set_stream: the stream belongs to device " +
                                  std::to_string(s.device()) + ", which cannot use the arena's memory");
    }
    detail::check_proof(proof, stream_.record(), last_use_, &s.record(), "device_arena::set_stream");
    stream_ = s.resolved();
    touch();
  }

  /// Rejected: freeing on another stream needs proof of ordering.
  template <class U = void>
  void free_on(stream_ref) && {
    static_assert(detail::dependent_false_v<U>,
                  "streamalloc::device_arena::free_on: freeing on another stream needs proof that it runs after the "
                  "kernels allocating from the arena: std::move(arena).free_on(b, order_after(b, a))");
  }

  /// Frees the whole arena now, in the order of `s`, which `proof` shows runs after its last
  /// use. The arena is empty afterwards. @throws ordering_error (checks on), std::invalid_argument
  template <class P>
  void free_on(stream_ref s, const P& proof) && {
    set_stream(s, proof);
    release();
  }

  /**
   * @brief Reads the counters: copies them on `stream()` and **blocks the host until that
   * stream has finished** (`stream().synchronize()`; the device and other streams are not
   * waited for). What it returns is what the work enqueued on the stream before the call left.
   * @throws cuda_error
   */
  [[nodiscard]] device_arena_usage usage() const {
    std::array<unsigned long long, detail::arena_header_bytes / sizeof(unsigned long long)> h{};
    if (memory_ != nullptr) {
      // The stream's context: the runtime refuses copies to pageable memory on another device's
      // stream.
      const detail::scoped_context in(detail::context_of(stream_));
      detail::check_runtime(cudaMemcpyAsync(h.data(), memory_, detail::arena_header_bytes, cudaMemcpyDeviceToHost,
                                            stream_.get()),
                            "cudaMemcpyAsync");
      touch();
    }
    const host_order done = stream_.synchronize();
    const std::uint64_t offset = h[0];
    return {offset < capacity_ ? static_cast<std::size_t>(offset) : capacity_, capacity_,
            h[detail::arena_failures_at / sizeof(unsigned long long)], done};
  }

 private:
  void enqueue_memset(void* p, std::size_t bytes) {
    {
      const detail::scoped_context in(detail::context_of(stream_));  // as in usage()
      detail::check_runtime(cudaMemsetAsync(p, 0, bytes, stream_.get()), "cudaMemsetAsync");
    }
    touch();
  }

  // The last use on its stream, for checking proofs made afterwards (as stream_buffer does).
  void touch() const {
    if constexpr (STREAMALLOC_CHECK_ORDERING != 0) last_use_ = stream_.record().current_epoch();
  }

  device_arena(std::size_t capacity, stream_ref s, pool_ref p, std::shared_ptr<detail::allocation_log> log)
      : log_(std::move(log)), stream_(s.resolved()), capacity_(capacity) {
    if (capacity == 0 || capacity > detail::arena_max_capacity) [[unlikely]] {
      throw std::invalid_argument("streamalloc::device_arena: capacity " + std::to_string(capacity) +
                                  " is not between 1 and 2^40 bytes");
    }
    const std::size_t bytes = detail::arena_header_bytes + capacity;
    const cudaStream_t h = stream_.get();
    memory_ = detail::logged_allocation(log_.get(), detail::log_op::allocate_async, bytes, 256, &h, [&] {
      return static_cast<std::byte*>(p.allocate(bytes, stream_));  // throws for a moved-from pool
    });
    pool_ = detail::state_of(p);
    try {
      enqueue_memset(memory_, detail::arena_header_bytes);
    } catch (...) {
      if (log_ != nullptr) log_->ok(detail::log_op::free_async, memory_, bytes, 256, &h);
      p.deallocate(memory_, stream_);
      throw;
    }
  }

  static std::shared_ptr<detail::allocation_log> checked_log(std::shared_ptr<detail::allocation_log> log) {
    if (log == nullptr) {
      throw std::invalid_argument("streamalloc::device_arena: the logging_resource was moved from (it has no log)");
    }
    return log;
  }

  void release() noexcept {
    if (memory_ == nullptr) return;
    std::byte* p = std::exchange(memory_, nullptr);
    if (log_ != nullptr && !pool_->closed()) {
      const cudaStream_t h = stream_.get();
      log_->ok(detail::log_op::free_async, p, detail::arena_header_bytes + capacity_, 256, &h);
    }
    capacity_ = 0;
    const pool_ref owner(*pool_);
    detail::free_or_report(owner, p, "streamalloc::device_arena (destroyed or reassigned)",
                           [&] { owner.deallocate(p, stream_); });
  }

  detail::pool_state* pool_ = nullptr;  // the pool's state: it stays when the pool is moved
  std::shared_ptr<detail::allocation_log> log_;  // made from a logging_resource: its log
  stream_ref stream_ = stream_ref::legacy_default();
  std::byte* memory_ = nullptr;  // the header (counters), then the region
  std::size_t capacity_ = 0;
  mutable std::uint64_t last_use_ = 0;
};

}  // namespace STREAMALLOC_ORDERING_MODE

// --- device members ---------------------------------------------------------------------------

#if defined(__CUDACC__)

inline __device__ void* device_arena_view::allocate(std::size_t bytes, std::size_t alignment) const {
  if (offset_ == nullptr) return nullptr;
  return detail::bump_allocate<cuda::thread_scope_device>(base_, capacity_, offset_, bytes, alignment, failures_)
      .pointer;
}

inline __device__ std::size_t device_arena_view::used() const {
  return offset_ == nullptr ? 0 : detail::bump_used<cuda::thread_scope_device>(offset_, capacity_);
}

inline __device__ unsigned long long device_arena_view::failures() const {
  return failures_ == nullptr
             ? 0
             : cuda::atomic_ref<unsigned long long, cuda::thread_scope_device>(*failures_).load(cuda::memory_order_relaxed);
}

inline __device__ device_block_arena device_arena_view::for_block(device_block_arena_state& shared,
                                                                  std::size_t bytes) const {
  __syncthreads();  // a state made again: every thread is done with the old sub-arena
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    // Not counted as a failure when the arena is full: the block's requests go to the arena
    // then, and those that fail there are counted.
    // At 16: the sub-arena aligns each allocation by its address, and needs no more.
    void* p = offset_ == nullptr ? nullptr
                                 : detail::bump_allocate<cuda::thread_scope_device>(base_, capacity_, offset_, bytes,
                                                                                    detail::bump_granule, nullptr)
                                       .pointer;
    shared.base_ = static_cast<std::byte*>(p);
    shared.capacity_ = p != nullptr ? bytes : 0;
    shared.used_ = 0;
  }
  __syncthreads();
  device_block_arena b;
  b.state_ = &shared;
  b.parent_ = *this;
  return b;
}

inline __device__ void* device_block_arena::allocate(std::size_t bytes, std::size_t alignment) const {
  const detail::bump_result r = detail::bump_allocate<cuda::thread_scope_block>(
      state_->base_, state_->capacity_, &state_->used_, bytes, alignment, nullptr);
  if (!r.failed) return r.pointer;
  return parent_.allocate(bytes, alignment);  // counted there if the arena cannot either
}

inline __device__ std::size_t device_block_arena::used() const {
  return detail::bump_used<cuda::thread_scope_block>(&state_->used_, state_->capacity_);
}

inline __device__ std::size_t device_block_arena::capacity() const { return state_->capacity_; }

#endif  // __CUDACC__

}  // namespace streamalloc
