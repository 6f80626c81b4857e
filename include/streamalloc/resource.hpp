#pragma once

/// @file
/// @brief Memory resources over a pool: `pool_resource<Properties...>`, a CCCL `cuda::mr`
/// resource (synchronous and stream-ordered) whose accessibility is part of its type, and
/// `pmr_resource`, a `std::pmr::memory_resource` for host pools.
///
/// CCCL's memory resource concepts are experimental in the CCCL of CUDA 13.0 and need
/// `LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE`. The `streamalloc::streamalloc` CMake
/// target defines it; this header defines it too when it is missing, which only works if
/// `<cuda/memory_resource>` was not included before it.

#ifndef LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#if defined(_CUDA__MEMORY_RESOURCE_PROPERTIES_H)
#error "streamalloc/resource.hpp: <cuda/memory_resource> was included without LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE; define it for the whole build (the streamalloc::streamalloc target does) or include streamalloc first"
#endif
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#endif

#include <streamalloc/detail/allocation_log.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <bit>
#include <cstddef>
#include <cstdio>
#include <exception>
#include <memory>
#include <memory_resource>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace streamalloc {

/// CCCL's property of memory the device may access, used by streamalloc's types.
using device_accessible = ::cuda::mr::device_accessible;
/// CCCL's property of memory host code may access.
using host_accessible = ::cuda::mr::host_accessible;

/// True when `P...` holds `Q`.
template <class Q, class... P>
inline constexpr bool has_property_v = (std::is_same_v<Q, P> || ...);

namespace detail {

template <class P>
inline constexpr bool is_access_property_v = std::is_same_v<P, device_accessible> || std::is_same_v<P, host_accessible>;

/// Gives `Derived` the CCCL property `P` (found by argument-dependent lookup through the base).
template <class Derived, class P>
struct property_tag {
  friend constexpr void get_property(const Derived&, P) noexcept {}
};

inline void check_alignment(std::size_t alignment, const char* who) {
  if (alignment == 0 || !std::has_single_bit(alignment)) {
    throw std::invalid_argument(std::string("streamalloc::") + who + ": alignment " + std::to_string(alignment) +
                                " is not a power of two");
  }
}

}  // namespace detail

/**
 * @brief A memory resource over a streamalloc pool, with the accessibility it claims in its
 * type: `pool_resource<device_accessible>` for device memory, `pool_resource<host_accessible,
 * device_accessible>` for a host pool that kernels also use, `pool_resource<host_accessible>`
 * for a host pool used by host code. The claim is checked against the pool when the resource
 * is made (a device pool cannot claim host access), so functions that need an access can ask
 * for it at compile time (`stream_buffer`, `pmr_resource`, `cuda::mr::resource_with`).
 *
 * Models CCCL's `cuda::mr::async_resource_with<pool_resource, Properties...>`:
 * - `allocate(bytes, alignment)` / `deallocate(p, bytes, alignment)`: synchronous, like
 *   `cudaMalloc`/`cudaFree` (`pool::allocate_sync`): memory usable at once by every stream;
 *   a free promises no work still uses the memory;
 * - `allocate_async(bytes, alignment, stream)` / `deallocate_async(...)`: in stream order
 *   (`pool::allocate`), with the pool's reuse rules.
 * Alignments up to 256 cost nothing; larger powers of two over-allocate by the alignment.
 * Equal when over the same pool. Trivially copyable; the pool must outlive it.
 * @code
 * streamalloc::pool pool;
 * streamalloc::pool_resource<streamalloc::device_accessible> mr(pool);
 * cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref(mr);   // CCCL's type erasure
 * void* p = ref.allocate_async(1 << 20, 256, cuda::stream_ref(s.get()));
 * @endcode
 */
template <class... Properties>
class pool_resource : public detail::property_tag<pool_resource<Properties...>, Properties>... {
  static_assert(sizeof...(Properties) > 0,
                "streamalloc::pool_resource: name what the memory is accessible from: device_accessible, "
                "host_accessible, or both");
  static_assert((detail::is_access_property_v<Properties> && ...),
                "streamalloc::pool_resource: its properties are device_accessible and host_accessible");

 public:
  /// Does it claim `host_accessible` (a host pool's memory)?
  static constexpr bool is_host_accessible = has_property_v<host_accessible, Properties...>;
  /// Does it claim `device_accessible`?
  static constexpr bool is_device_accessible = has_property_v<device_accessible, Properties...>;

  /**
   * @brief A resource over `p`.
   * @throws std::invalid_argument when the pool's memory lacks an access the type claims
   *         (host access claimed over a device pool)
   */
  explicit pool_resource(pool_ref p) : pool_(p) {
    if (detail::state_of(p) == nullptr) [[unlikely]] {
      throw pool_closed("streamalloc::pool_resource: the pool was moved from (make the resource from the pool it "
                        "was moved into)");
    }
    if (is_host_accessible && !p.location().is_host()) {
      throw std::invalid_argument("streamalloc::pool_resource: host_accessible claimed over a pool on " +
                                  p.location().to_string() + ", which host code cannot read");
    }
  }

  /// Synchronous allocation (see the class notes). @throws out_of_memory, std::invalid_argument
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = 256) {
    detail::check_alignment(alignment, "pool_resource::allocate");
    if (alignment <= 256) return pool_.allocate_sync(bytes);
    return align_up(pool_.allocate_sync(padded(bytes, alignment)), alignment);
  }
  /**
   * @brief Synchronous free: no work may still use `p`, which must be what `allocate` returned
   * with the same alignment. Never throws (containers and destructors call it): a foreign
   * pointer, a double free, or a pointer inside an allocation (for an alignment above 256, one
   * that is not the aligned pointer `allocate` returned) goes to the bad-free handler
   * (`set_bad_free_handler`; by default: a message, then abort) and changes nothing. After the
   * pool was closed it does nothing: the memory is gone already. `pool::deallocate_sync` is
   * the form that throws.
   */
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = 256) noexcept {
    detail::free_or_report(pool_, p, "streamalloc::pool_resource::deallocate",
                           [&] { deallocate_checked(p, bytes, alignment); });
  }
  /// The checking form of `deallocate`, for code that tests for bad frees: throws
  /// std::invalid_argument (changing nothing) where `deallocate` calls the bad-free handler.
  void deallocate_checked(void* p, std::size_t bytes, std::size_t alignment = 256) {
    (void)bytes;
    pool_.deallocate_sync(start_of(p, alignment));
  }
  /// Allocation in the order of `s`. @throws out_of_memory, std::invalid_argument
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment, ::cuda::stream_ref s) {
    return allocate_async(bytes, alignment, stream_ref(s));
  }
  /// Allocation in the order of `s`, aligned to `alignment` (a power of two). @throws
  /// out_of_memory, std::invalid_argument
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment, stream_ref s) {
    detail::check_alignment(alignment, "pool_resource::allocate_async");
    if (alignment <= 256) return pool_.allocate(bytes, s);
    return align_up(pool_.allocate(padded(bytes, alignment), s), alignment);
  }
  /// Allocation in the order of `s`, aligned to 256 bytes. @throws out_of_memory,
  /// std::invalid_argument
  [[nodiscard]] void* allocate_async(std::size_t bytes, stream_ref s) { return pool_.allocate(bytes, s); }
  /// Free in the order of `s` (every stream that used `p` ordered before it). `p` must be what
  /// `allocate_async` returned with the same alignment. Never throws: a bad free (as for
  /// `deallocate`, or a stream of another device) goes to the bad-free handler. `pool::deallocate`
  /// is the form that throws.
  void deallocate_async(void* p, std::size_t bytes, std::size_t alignment, ::cuda::stream_ref s) noexcept {
    deallocate_async(p, bytes, alignment, stream_ref(s));
  }
  /// As above, with streamalloc's stream reference.
  void deallocate_async(void* p, std::size_t bytes, std::size_t alignment, stream_ref s) noexcept {
    detail::free_or_report(pool_, p, "streamalloc::pool_resource::deallocate_async",
                           [&] { deallocate_async_checked(p, bytes, alignment, s); });
  }
  /// The checking form of `deallocate_async` (see `deallocate_checked`).
  void deallocate_async_checked(void* p, std::size_t bytes, std::size_t alignment, stream_ref s) {
    (void)bytes;
    pool_.deallocate(start_of(p, alignment), s);
  }
  /// Free of what `allocate_async(bytes, s)` returned, in the order of `s`.
  void deallocate_async(void* p, std::size_t bytes, stream_ref s) noexcept { deallocate_async(p, bytes, 256, s); }

  /// The pool it allocates from.
  [[nodiscard]] pool_ref pool() const noexcept { return pool_; }

  /// Equal when they allocate from the same pool (memory of one may be freed through the other).
  friend bool operator==(const pool_resource& a, const pool_resource& b) noexcept { return a.pool_ == b.pool_; }
  /// Not equal: different pools.
  friend bool operator!=(const pool_resource& a, const pool_resource& b) noexcept { return !(a == b); }

  /// The same pool, claiming fewer properties (a host-and-device resource where a host one
  /// is wanted). Claiming more needs the checking constructor.
  template <class... Others>
    requires(has_property_v<Others, Properties...> && ...)
  operator pool_resource<Others...>() const {  // NOLINT: narrowing a claim is always safe
    return pool_resource<Others...>(pool_);
  }

 private:
  static std::size_t padded(std::size_t bytes, std::size_t alignment) {
    if (bytes > (std::size_t{1} << 62) || alignment > (std::size_t{1} << 40)) {
      throw out_of_memory(bytes, "streamalloc: " + std::to_string(bytes) + " bytes aligned to " +
                                     std::to_string(alignment) + " is more than any pool can hold");
    }
    return bytes == 0 ? 0 : bytes + alignment - 256;
  }
  static void* align_up(void* p, std::size_t alignment) {
    if (p == nullptr) return nullptr;
    const auto v = reinterpret_cast<std::uintptr_t>(p);
    return reinterpret_cast<void*>((v + alignment - 1) & ~(std::uintptr_t{alignment} - 1));
  }
  // Over-aligned pointers may sit inside their allocation: the pool knows where it starts.
  // Only the pointer `allocate` returned for that start is accepted, so that a pointer into
  // the middle of an allocation does not free all of it (the pool itself refuses interior
  // pointers, which an alignment of 256 or less passes straight to it).
  void* start_of(void* p, std::size_t alignment) const {
    if (p == nullptr || alignment <= 256) return p;
    detail::check_alignment(alignment, "pool_resource::deallocate");
    auto a = pool_.find_allocation(p);
    if (!a) return p;  // not live here: the pool's free says so, naming the pointer
    if (align_up(a->first, alignment) != p) [[unlikely]] throw_not_returned(p, alignment, a->first);
    return a->first;
  }
  [[noreturn]] STREAMALLOC_COLD static void throw_not_returned(void* p, std::size_t alignment, void* start) {
    char buf[3][32];
    std::snprintf(buf[0], sizeof buf[0], "%p", p);
    std::snprintf(buf[1], sizeof buf[1], "%p", start);
    std::snprintf(buf[2], sizeof buf[2], "%p", align_up(start, alignment));
    throw std::invalid_argument(std::string("streamalloc::pool_resource::deallocate: ") + buf[0] +
                                " with alignment " + std::to_string(alignment) +
                                " is not a pointer allocate returned: it lies in the allocation at " + buf[1] +
                                ", for which allocate returns " + buf[2] +
                                " (free with the pointer and the alignment allocate was given)");
  }

  pool_ref pool_;
};

/// Device memory from a pool.
using device_resource = pool_resource<device_accessible>;
/// Host memory from a host pool, for host code.
using host_resource = pool_resource<host_accessible>;
/// Host memory from a host pool, for host code and kernels.
using host_device_resource = pool_resource<host_accessible, device_accessible>;

static_assert(::cuda::mr::resource<device_resource>);
static_assert(::cuda::mr::async_resource_with<device_resource, device_accessible>);
static_assert(!::cuda::mr::resource_with<device_resource, host_accessible>);
static_assert(::cuda::mr::async_resource_with<host_resource, host_accessible>);
static_assert(!::cuda::mr::resource_with<host_resource, device_accessible>);
static_assert(::cuda::mr::async_resource_with<host_device_resource, host_accessible, device_accessible>);

/// A stream-ordered resource (CCCL's sense) whose memory kernels may use: for functions that
/// hand memory to the device.
template <class R>
concept device_memory_resource = ::cuda::mr::async_resource_with<R, device_accessible>;

/// A resource (CCCL's sense) whose memory host code may use.
template <class R>
concept host_memory_resource = ::cuda::mr::resource_with<R, host_accessible>;

static_assert(device_memory_resource<device_resource> && device_memory_resource<host_device_resource>);
static_assert(!device_memory_resource<host_resource>);
static_assert(host_memory_resource<host_resource> && host_memory_resource<host_device_resource>);
static_assert(!host_memory_resource<device_resource>);

/// The properties of streamalloc's resources, for constraints.
template <class R>
inline constexpr bool is_pool_resource_v = false;
/// True for every `pool_resource`.
template <class... P>
inline constexpr bool is_pool_resource_v<pool_resource<P...>> = true;

/**
 * @brief A `std::pmr::memory_resource` over a host pool, so `std::pmr` containers and any
 * pmr-aware code take streamalloc memory.
 *
 * Made from a resource that claims `host_accessible` (containers touch their elements from
 * host code; a device resource is rejected at compile time). Synchronous by default: each
 * allocation is usable by the host at once, each free promises nothing uses the memory. Made
 * with a stream, it allocates and frees in that stream's order instead: the memory is then for
 * work on that stream, and the host may touch it only where nothing else on the stream does.
 * Equal to another `pmr_resource` over the same pool and stream, writing to the same log if any
 * (so that memory freed through the other is in the log that holds its allocation). Frees never throw (containers
 * free from destructors): a pointer the pool refuses goes to the bad-free handler
 * (`set_bad_free_handler`; by default a message, then abort), and a free after the pool was
 * closed does nothing.
 * @code
 * streamalloc::pool host_pool({.location = streamalloc::memory_location::host_numa(0)});
 * streamalloc::pmr_resource mr(streamalloc::host_resource(host_pool));
 * std::pmr::vector<int> v(&mr);
 * @endcode
 */
class pmr_resource final : public std::pmr::memory_resource {
 public:
  /// Synchronous: allocations usable by the host at once. `r` must claim `host_accessible`.
  template <class... P>
  explicit pmr_resource(pool_resource<P...> r) : pool_(r.pool()) {
    static_assert(has_property_v<host_accessible, P...>,
                  "streamalloc::pmr_resource: std::pmr containers touch their memory from host code, so the "
                  "resource must be host_accessible (a host pool's host_resource); device memory goes through "
                  "pool_resource<device_accessible> or stream_buffer");
  }
  /// Allocating and freeing in the order of `s` (see the class).
  template <class... P>
  pmr_resource(pool_resource<P...> r, stream_ref s) : pmr_resource(r) {
    stream_ = s.resolved();
    ordered_ = true;
  }
  /// As above, from the pool under `r`, a `logging_resource` over a `pool_resource`: every
  /// allocate and free is a line of `r`'s log (`allocate` and `free`; `allocate_async` and
  /// `free_async` made with a stream), which stays open while this resource lives.
  /// @throws std::invalid_argument when `r` was moved from
  template <class... P>
  explicit pmr_resource(const logging_resource<pool_resource<P...>>& r) : pmr_resource(r.upstream_resource()) {
    log_ = detail::logging_access::log_of(r);
    if (log_ == nullptr) {
      throw std::invalid_argument("streamalloc::pmr_resource: the logging_resource was moved from (it has no log)");
    }
  }
  /// As above, in the order of `s`.
  template <class... P>
  pmr_resource(const logging_resource<pool_resource<P...>>& r, stream_ref s) : pmr_resource(r) {
    stream_ = s.resolved();
    ordered_ = true;
  }

  /// The pool it allocates from.
  [[nodiscard]] pool_ref pool() const noexcept { return pool_; }
  /// The stream allocations are ordered on, if any.
  [[nodiscard]] std::optional<stream_ref> stream() const noexcept {
    return ordered_ ? std::optional<stream_ref>(stream_) : std::nullopt;
  }

 private:
  void* do_allocate(std::size_t bytes, std::size_t alignment) override {
    detail::check_alignment(alignment, "pmr_resource::allocate");
    // std::pmr never asks for 0 bytes' nullptr: give the smallest block instead.
    const std::size_t n = bytes == 0 ? 1 : bytes;
    const auto allocate = [&] {
      if (alignment <= 256) return ordered_ ? pool_.allocate(n, stream_) : pool_.allocate_sync(n);
      host_resource r(pool_);
      return ordered_ ? r.allocate_async(n, alignment, stream_) : r.allocate(n, alignment);
    };
    if (log_ == nullptr) [[likely]] return allocate();
    const cudaStream_t h = stream_.get();
    return detail::logged_allocation(log_.get(), ordered_ ? detail::log_op::allocate_async : detail::log_op::allocate,
                                     bytes, alignment, ordered_ ? &h : nullptr, allocate);
  }
  // Never throws: std::pmr containers free from their destructors, where an exception would
  // end the program (std::terminate). A pointer the pool refuses (foreign, interior, a double
  // free) goes to the bad-free handler, which by default aborts with a message; after the pool
  // was closed its memory is gone already, so there is nothing to free.
  void do_deallocate(void* p, std::size_t bytes, std::size_t alignment) noexcept override {
    if (log_ != nullptr) [[unlikely]] {
      const cudaStream_t h = stream_.get();
      log_->ok(ordered_ ? detail::log_op::free_async : detail::log_op::free, p, bytes, alignment, ordered_ ? &h : nullptr);
    }
    detail::free_or_report(pool_, p, "streamalloc::pmr_resource::deallocate", [&] {
      host_resource r(pool_);
      if (ordered_) {
        r.deallocate_async_checked(p, bytes, alignment, stream_);
      } else {
        r.deallocate_checked(p, bytes, alignment);
      }
    });
  }
  bool do_is_equal(const std::pmr::memory_resource& other) const noexcept override {
    const auto* o = dynamic_cast<const pmr_resource*>(&other);
    return o != nullptr && o->pool_ == pool_ && o->ordered_ == ordered_ && (!ordered_ || o->stream_ == stream_) &&
           o->log_ == log_;
  }

  pool_ref pool_;
  stream_ref stream_ = stream_ref::legacy_default();
  bool ordered_ = false;
  std::shared_ptr<detail::allocation_log> log_;  // made from a logging_resource: its log
};

}  // namespace streamalloc
