#pragma once

/// @file
/// @brief `stream_buffer<T>`: a typed, move-only buffer allocated and freed in the order of a
/// stream, that grows in place, and that moves to another stream only with proof of ordering.

#include <streamalloc/detail/buffer_readers.hpp>
#include <streamalloc/ordering.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/resource.hpp>
#include <streamalloc/stream.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <limits>
#include <memory>
#include <ranges>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace streamalloc {

/// What `reserve` or `resize` did to the buffer's memory.
enum class growth {
  unchanged,  ///< the capacity was enough
  in_place,   ///< more memory mapped or taken behind the buffer: same address, nothing copied
  moved,      ///< new memory allocated and the contents copied there (the address changed)
};

inline namespace STREAMALLOC_ORDERING_MODE {  // see <streamalloc/ordering.hpp>
template <class T, class... Properties>
class basic_stream_buffer;
}  // namespace STREAMALLOC_ORDERING_MODE

namespace detail {

template <class>
inline constexpr bool is_stream_buffer_v = false;
template <class T, class... P>
inline constexpr bool is_stream_buffer_v<basic_stream_buffer<T, P...>> = true;

/// What `begin()` and `end()` of a device buffer return: just enough for a range-for to compile
/// on to the `static_assert` that explains (so that is the only error), yet no iterator (no
/// `difference_type`), so that std::ranges, std::span and the like do not take a device buffer
/// for a host range. Never defined: the `static_assert` stops every build that uses one.
template <class T>
struct device_elements_not_iterable {
  T& operator*() const;
  device_elements_not_iterable& operator++();
  bool operator!=(const device_elements_not_iterable&) const;
};

inline void check_runtime(cudaError_t e, const char* call) {
  if (e != cudaSuccess) [[unlikely]] {
    throw cuda_error::from_runtime(static_cast<int>(e), call, cudaGetErrorName(e), cudaGetErrorString(e));
  }
}
}  // namespace detail

inline namespace STREAMALLOC_ORDERING_MODE {

/**
 * @brief A buffer of `T` allocated from a pool in the order of a stream (its stream), freed
 * in that order when destroyed. `Properties` say where its memory is accessible from
 * (`device_accessible`, `host_accessible`); `stream_buffer<T>` is device memory,
 * `host_stream_buffer<T>` host memory kernels can also use.
 *
 * The ordering rules are part of the interface:
 * - work on the buffer's stream may use it at once (`data()` for kernels on `stream()`;
 *   `copy_from`, `copy_to`, `resize` enqueue on it);
 * - to use it on another stream, move it there with proof: `set_stream(b, proof)`, where the
 *   proof comes from `b.wait(e)`, `order_after(b, a)` or a host synchronization;
 * - to free it on another stream: `std::move(buf).free_on(b, proof)`;
 * - reading another buffer on this stream needs the same proof (`copy_from(other, proof)`).
 * Streams that read the buffer through `copy_from(other, proof)` are ordered before its free
 * by the buffer itself. The buffer's own stream must outlive it (free it on another stream
 * with `free_on` first), as a `cudaFreeAsync` needs a live stream; a reader's stream need not.
 * @code
 * streamalloc::stream a(0), b(0);
 * streamalloc::stream_buffer<float> x(1 << 20, a);      // from the current pool of a's device
 * fill<<<grid, block, 0, a.get()>>>(x.data(), x.size());
 * x.set_stream(b, streamalloc::order_after(b, a));     // b runs after the fill
 * x.resize(2 << 20);                                   // grows in place on b, no copy
 * @endcode
 */
template <class T, class... Properties>
class basic_stream_buffer {
  static_assert(std::is_trivially_copyable_v<T>,
                "streamalloc::stream_buffer<T>: T must be trivially copyable: the buffer moves its bytes with "
                "cudaMemcpyAsync and never runs constructors or destructors on the device");
  static_assert(!std::is_const_v<T> && !std::is_volatile_v<T> && !std::is_reference_v<T>,
                "streamalloc::stream_buffer<T>: T must be a plain object type");
  static_assert(sizeof...(Properties) > 0, "streamalloc::basic_stream_buffer: name device_accessible and/or host_accessible");

 public:
  /// The element type.
  using value_type = T;
  /// Sizes and indices, in elements.
  using size_type = std::size_t;
  /// The resource type that can back it (claiming the buffer's properties).
  using resource_type = pool_resource<Properties...>;
  /// May host code touch the elements (a host pool's memory)?
  static constexpr bool is_host_accessible = has_property_v<host_accessible, Properties...>;
  /// May kernels use the elements?
  static constexpr bool is_device_accessible = has_property_v<device_accessible, Properties...>;

  /// Rejected: a buffer is allocated in the order of a stream.
  template <class U = T>
  explicit basic_stream_buffer(size_type) {
    static_assert(detail::dependent_false_v<U>,
                  "streamalloc::stream_buffer: a buffer is allocated in the order of a stream: "
                  "stream_buffer<T>(count, stream) or stream_buffer<T>(count, stream, resource)");
  }

  /**
   * @brief `count` elements (uninitialized) on `s`, from the current pool of `s`'s device.
   * @throws out_of_memory
   */
  basic_stream_buffer(size_type count, stream_ref s) : stream_(s.resolved()) {
    static_assert(!is_host_accessible,
                  "streamalloc::stream_buffer: the current pool holds device memory; a host-accessible buffer "
                  "needs a host pool's resource: host_stream_buffer<T>(count, stream, host_device_resource(pool))");
    pool_ = detail::state_of(current_pool(s.device()));
    allocate_initial(count);
  }

  /**
   * @brief `count` elements (uninitialized) on `s`, from `r`'s pool. `r` must claim every
   * access the buffer has (checked at compile time).
   * @throws out_of_memory
   */
  template <class... Q>
  basic_stream_buffer(size_type count, stream_ref s, pool_resource<Q...> r)
      : pool_(detail::state_of(r.pool())), stream_(s.resolved()) {
    static_assert(claims<Q...>(), "see claims() for what the resource lacks");
    allocate_initial(count);
  }

  /**
   * @brief As above, from the pool under `r`, a `logging_resource` over a `pool_resource`: the
   * buffer's allocations, its growth in place and its frees are lines of `r`'s log
   * (`allocate_async`, `resize_async`, `free_async`), which stays open while the buffer lives.
   * The buffer allocates from the pool itself (it grows in place through it), not through `r`.
   * @throws std::invalid_argument when `r` was moved from, out_of_memory (logged, then thrown)
   */
  template <class... Q>
  basic_stream_buffer(size_type count, stream_ref s, const logging_resource<pool_resource<Q...>>& r)
      : pool_(detail::state_of(r.upstream_resource().pool())),
        log_(detail::logging_access::log_of(r)),
        stream_(s.resolved()) {
    static_assert(claims<Q...>(), "see claims() for what the resource lacks");
    if (log_ == nullptr) {
      throw std::invalid_argument("streamalloc::stream_buffer: the logging_resource was moved from (it has no log)");
    }
    allocate_initial(count);
  }

  /**
   * @brief `count` elements (uninitialized) on `s`, from pool `p`, which must provide the
   * buffer's accessibility (checked when called: a host-accessible buffer needs a host pool).
   * @throws std::invalid_argument for a pool that cannot, out_of_memory
   */
  basic_stream_buffer(size_type count, stream_ref s, pool_ref p)
      : basic_stream_buffer(count, s, resource_type(p)) {}

  /// Rejected: a raw `cudaStream_t` (or `0`): streamalloc takes a stream as a `stream_ref`, made
  /// explicitly, so that an integer never becomes a stream by accident.
  template <class U = T>
  basic_stream_buffer(size_type, cudaStream_t) {
    static_assert(detail::dependent_false_v<U>,
                  "streamalloc::stream_buffer: pass a cudaStream_t s as streamalloc::stream_ref{s}: "
                  "stream_buffer<T>(count, streamalloc::stream_ref{s}); for stream 0 say "
                  "streamalloc::stream_ref::legacy_default() (or per_thread_default())");
  }
  /// Rejected: as above, with a pool or resource.
  template <class R, class U = T>
  basic_stream_buffer(size_type, cudaStream_t, R&&) {
    static_assert(detail::dependent_false_v<U>,
                  "streamalloc::stream_buffer: pass a cudaStream_t s as streamalloc::stream_ref{s}: "
                  "stream_buffer<T>(count, streamalloc::stream_ref{s}, resource); for stream 0 say "
                  "streamalloc::stream_ref::legacy_default() (or per_thread_default())");
  }

  /// Rejected: anything but a streamalloc pool, pool resource, or logging resource over one
  /// (the buffer grows through its pool).
  template <class R>
    requires(!is_pool_resource_v<std::remove_cvref_t<R>> && !detail::is_logged_pool_resource_v<std::remove_cvref_t<R>> &&
             !std::is_convertible_v<R, pool_ref>)
  basic_stream_buffer(size_type, stream_ref, R&&) {
    static_assert(detail::dependent_false_v<R>,
                  "streamalloc::stream_buffer: allocate from a streamalloc pool_resource (device_resource, "
                  "host_device_resource) or a logging_resource over one: the buffer grows in place through its pool");
  }

  /// Moves the memory; `o` is left empty, on the same stream and pool, and usable (resize
  /// allocates again).
  basic_stream_buffer(basic_stream_buffer&& o) noexcept
      : pool_(o.pool_),
        log_(o.log_),
        stream_(o.stream_),
        data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        capacity_(std::exchange(o.capacity_, 0)),
        last_use_(o.last_use_),
        readers_(std::move(o.readers_)) {}
  /// Frees this buffer's memory (as the destructor does), then takes over `o`'s.
  basic_stream_buffer& operator=(basic_stream_buffer&& o) noexcept {
    if (this != &o) {
      release();
      pool_ = o.pool_;
      log_ = o.log_;
      stream_ = o.stream_;
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      capacity_ = std::exchange(o.capacity_, 0);
      last_use_ = o.last_use_;
      readers_ = std::move(o.readers_);
    }
    return *this;
  }
  basic_stream_buffer(const basic_stream_buffer&) = delete;
  basic_stream_buffer& operator=(const basic_stream_buffer&) = delete;

  /// Frees the memory in the order of `stream()` (after the streams that read it, too). Once
  /// the pool is closed it does nothing: closing released the memory already.
  ~basic_stream_buffer() { release(); }

  /// Elements in the buffer.
  [[nodiscard]] size_type size() const noexcept { return size_; }
  /// Elements it can hold before growing.
  [[nodiscard]] size_type capacity() const noexcept { return capacity_; }
  /// Bytes of its elements.
  [[nodiscard]] size_type size_bytes() const noexcept { return size_ * sizeof(T); }
  /// No elements?
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// The elements, for work enqueued on `stream()`.
  [[nodiscard]] T* data() noexcept { return data_; }
  /// The elements, for work enqueued on `stream()`.
  [[nodiscard]] const T* data() const noexcept { return data_; }
  /// The stream the buffer is ordered on.
  [[nodiscard]] stream_ref stream() const noexcept { return stream_; }
  /// The pool its memory comes from.
  [[nodiscard]] pool_ref pool() const noexcept { return pool_ref(*pool_); }

  // --- host access (host-accessible buffers only) ---------------------------------------------

  /**
   * @brief The elements for host code. Only for a host-accessible buffer, and only once the
   * host is ordered after the buffer's stream (synchronize it): with ordering checks on, an
   * access before that throws `ordering_error`.
   */
  [[nodiscard]] std::span<T> host_span() {
    static_assert(is_host_accessible,
                  "streamalloc::stream_buffer: host code cannot access device memory; copy_to(host range) on the "
                  "buffer's stream, or allocate a host_stream_buffer from a host pool");
    check_host_access();
    return {data_, size_};
  }
  /// Element `i`, for host code: as `host_span()` (host-accessible buffers only).
  [[nodiscard]] T& operator[](size_type i) {
    static_assert(is_host_accessible,
                  "streamalloc::stream_buffer: host code cannot access device memory; copy_to(host range) on the "
                  "buffer's stream, or allocate a host_stream_buffer from a host pool");
    check_host_access();
    return data_[i];
  }
  /// Host iteration, for host-accessible buffers: as `host_span()`.
  [[nodiscard]] T* begin()
    requires is_host_accessible
  {
    return host_span().data();
  }
  /// One past the last element, for host iteration (as `begin()`).
  [[nodiscard]] T* end()
    requires is_host_accessible
  {
    return begin() + size_;
  }
  // A device buffer is not a host range. These overloads exist only to say so when a range-for
  // picks them (const, so they catch const buffers too); what they return is no iterator, so
  // std::ranges::range and std::span still answer "no" for a device buffer.
  /// Rejected: host code cannot iterate device memory (a range-for over a device buffer).
  detail::device_elements_not_iterable<T> begin() const
    requires(!is_host_accessible)
  {
    static_assert(is_host_accessible,
                  "streamalloc::stream_buffer: a device buffer cannot be iterated by host code (a range-for "
                  "reads its elements on the host); copy_to(host range) on the buffer's stream (or to_host()) "
                  "and iterate that, or allocate a host_stream_buffer from a host pool");
    return {};
  }
  /// Rejected: as `begin()`.
  detail::device_elements_not_iterable<T> end() const
    requires(!is_host_accessible)
  {
    return begin();
  }

  // --- copies, enqueued on stream() ---------------------------------------------------------

  /**
   * @brief Copies the host range `src` to the first elements, on `stream()`. `src` must stay
   * alive until the stream has executed the copy.
   * @throws std::invalid_argument when `src` is longer than the buffer; cuda_error
   */
  template <class R>
    requires(!detail::is_stream_buffer_v<std::remove_cvref_t<R>> && std::ranges::contiguous_range<R>)
  void copy_from(const R& src) {
    static_assert(std::is_same_v<std::remove_cv_t<std::ranges::range_value_t<R>>, T>,
                  "streamalloc::stream_buffer::copy_from: the host range's element type differs from the buffer's");
    const size_type n = std::ranges::size(src);
    if (n > size_) throw std::invalid_argument("streamalloc::stream_buffer::copy_from: the source is longer than the buffer");
    copy_bytes(data_, std::ranges::data(src), n * sizeof(T));
  }

  /// Copies the first elements to the host range `dst`, on `stream()`; `dst` is complete once
  /// the stream is (synchronize before reading it). @throws std::invalid_argument, cuda_error
  template <class R>
    requires(!detail::is_stream_buffer_v<std::remove_cvref_t<R>> && std::ranges::contiguous_range<R>)
  void copy_to(R&& dst) const {
    using V = std::ranges::range_value_t<R>;
    static_assert(std::is_same_v<V, T> && !std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>,
                  "streamalloc::stream_buffer::copy_to: the destination must be a writable host range of the "
                  "buffer's element type");
    const size_type n = std::ranges::size(dst);
    if (n > size_) throw std::invalid_argument("streamalloc::stream_buffer::copy_to: the destination is longer than the buffer");
    copy_bytes(std::ranges::data(dst), data_, n * sizeof(T));
  }

  /// The contents as a host vector: copies on `stream()` and synchronizes it.
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> out(size_);
    copy_to(out);
    stream_.synchronize();
    return out;
  }

  /// Sets every byte to zero, on `stream()`.
  void fill_zero() {
    {
      // The stream's context current for a runtime call on it: the runtime refuses a copy to
      // or from pageable host memory on another device's stream (cudaErrorInvalidValue, on two
      // H200s), as in one process driving several GPUs.
      const detail::scoped_context in_stream_context(detail::context_of(stream_));
      detail::check_runtime(cudaMemsetAsync(data_, 0, size_bytes(), stream_.get()), "cudaMemsetAsync");
    }
    touch();
  }

  /**
   * @brief Copies `other`'s elements to the first of this buffer's, on `stream()`. Both must
   * be on the same stream (checked at run time with ordering checks on); otherwise use the
   * overload with a proof.
   */
  template <class... Q>
  void copy_from(const basic_stream_buffer<T, Q...>& other) {
    if constexpr (STREAMALLOC_CHECK_ORDERING != 0) {
      if (!(other.stream() == stream_)) {
        throw ordering_error(
            "streamalloc: stream_buffer::copy_from: the source buffer is on another stream; pass proof that this "
            "buffer's stream is ordered after it: copy_from(other, order_after(this_stream, other_stream))");
      }
    }
    copy_buffer(other);
  }

  /**
   * @brief Copies `other`'s elements here, on `stream()`, where `proof` shows that `stream()`
   * runs after `other`'s last use on its stream. `other` will be freed after this copy.
   * @throws ordering_error (checks on) when the proof does not cover it
   */
  template <class... Q, class P>
  void copy_from(const basic_stream_buffer<T, Q...>& other, const P& proof) {
    static_assert(ordering_proof<P>,
                  "streamalloc::stream_buffer::copy_from: the second argument must prove the ordering (a "
                  "stream_order from stream.wait(event) or order_after, or a host_order from a synchronization)");
    detail::check_proof(proof, other.stream().record(), other.last_use_, &stream_.record(), "stream_buffer::copy_from");
    copy_buffer(other);
    other.readers_.note(stream_);
  }

  /// Rejected: copying between buffers of different element types.
  template <class U, class... Q>
    requires(!std::is_same_v<U, T>)
  void copy_from(const basic_stream_buffer<U, Q...>&, ...) {
    static_assert(detail::dependent_false_v<U>,
                  "streamalloc::stream_buffer::copy_from: the buffers' element types differ");
  }

  // --- streams ---------------------------------------------------------------------------------

  /// Rejected: moving to another stream needs proof of ordering.
  template <class U = T>
  void set_stream(stream_ref) {
    static_assert(detail::dependent_false_v<U>,
                  "streamalloc::stream_buffer::set_stream: a buffer moves to another stream only with proof that "
                  "the new stream runs after its current one: set_stream(b, order_after(b, a)), "
                  "set_stream(b, b.wait(event)) or set_stream(b, a.synchronize())");
  }

  /**
   * @brief Moves the buffer to stream `s`: later work, copies, growth and the free happen in
   * `s`'s order. `proof` shows `s` runs after the buffer's last use on its current stream.
   * @throws ordering_error (checks on) when the proof is for other streams or too old
   * @throws std::invalid_argument when `s` belongs to a device that cannot use the memory
   *         (neither the pool's device nor one granted access by pool::set_access)
   */
  template <class P>
  void set_stream(stream_ref s, const P& proof) {
    static_assert(ordering_proof<P>,
                  "streamalloc::stream_buffer::set_stream: the second argument must prove the ordering; a stream or "
                  "an event proves nothing (use the stream_order returned by s.wait(event) or order_after(s, "
                  "current), or the host_order of a synchronization)");
    if (s == stream_) return;
    if (!pool_->serves(s.device())) [[unlikely]] throw_not_served("set_stream", s.device());
    detail::check_proof(proof, stream_.record(), last_use_, &s.record(), "stream_buffer::set_stream");
    stream_ = s.resolved();
    touch();
  }

  /// Rejected: freeing on another stream needs proof of ordering.
  template <class U = T>
  void free_on(stream_ref) && {
    static_assert(detail::dependent_false_v<U>,
                  "streamalloc::stream_buffer::free_on: freeing on another stream needs proof that every stream "
                  "that used the buffer runs before the free: std::move(buf).free_on(b, order_after(b, a))");
  }

  /**
   * @brief Frees the memory now in the order of `s`, where `proof` shows `s` runs after the
   * buffer's last use on its stream. The buffer is empty afterwards.
   * @throws ordering_error (checks on) when the proof does not cover it
   * @throws std::invalid_argument when `s` belongs to a device that cannot use the memory
   *         (neither the pool's device nor one granted access by pool::set_access)
   */
  template <class P>
  void free_on(stream_ref s, const P& proof) && {
    static_assert(ordering_proof<P>,
                  "streamalloc::stream_buffer::free_on: the second argument must prove the ordering (a "
                  "stream_order or a host_order)");
    if (!(s == stream_)) {
      if (!pool_->serves(s.device())) [[unlikely]] throw_not_served("free_on", s.device());
      detail::check_proof(proof, stream_.record(), last_use_, &s.record(), "stream_buffer::free_on");
      stream_ = s.resolved();
    }
    release();
  }

  // --- size --------------------------------------------------------------------------------------

  /**
   * @brief Makes room for `count` elements. In place when the pool can map or take memory
   * right behind the buffer (same address, nothing copied); otherwise allocates, copies the
   * elements on `stream()` and frees the old memory there.
   * @return what happened
   * @throws out_of_memory (the buffer is unchanged), std::length_error
   */
  growth reserve(size_type count) {
    if (count <= capacity_) return growth::unchanged;
    const size_type bytes = bytes_for(count);
    if (data_ != nullptr) {
      if (const std::size_t got = pool_->grow_in_place(data_, bytes, stream_)) {
        capacity_ = got / sizeof(T);
        log_line(detail::log_op::resize_async, data_, got);
        touch();
        return growth::in_place;
      }
    }
    T* fresh = allocate_bytes(bytes);
    if (data_ != nullptr) {
      try {
        copy_bytes(fresh, data_, size_ * sizeof(T));
      } catch (...) {
        log_line(detail::log_op::free_async, fresh, bytes);
        pool_->deallocate(fresh, stream_);
        throw;
      }
      free_now();
    }
    data_ = fresh;
    capacity_ = count;
    touch();
    return growth::moved;
  }

  /// Sets the size to `count`; new elements are uninitialized. Grows as `reserve`.
  growth resize(size_type count) {
    const growth g = reserve(count);
    size_ = count;
    return g;
  }

  /// Grows in place only: true if the capacity now holds `count`, false (unchanged) if the
  /// memory behind the buffer is taken.
  bool try_reserve_in_place(size_type count) {
    if (count <= capacity_) return true;
    if (data_ == nullptr) return false;
    const std::size_t got = pool_->grow_in_place(data_, bytes_for(count), stream_);
    if (got == 0) return false;
    capacity_ = got / sizeof(T);
    log_line(detail::log_op::resize_async, data_, got);
    touch();
    return true;
  }

  /**
   * @brief Gives the memory beyond `size()` back to the pool without moving the buffer: freed
   * in the order of `stream()`, reusable there at once. An empty buffer frees everything.
   */
  void shrink_to_fit() {
    if (data_ == nullptr || capacity_ == size_) return;
    if (size_ == 0) {
      free_now();
      capacity_ = 0;
      return;
    }
    readers_.order_before_free(stream_);  // the freed part may have been read on other streams
    const std::size_t kept = pool_->shrink_in_place(data_, size_bytes(), stream_);
    capacity_ = kept / sizeof(T);
    log_line(detail::log_op::resize_async, data_, kept);
    touch();
  }

  /// Exchanges the two buffers: memory, streams and pools.
  void swap(basic_stream_buffer& o) noexcept {
    std::swap(pool_, o.pool_);
    std::swap(log_, o.log_);
    std::swap(stream_, o.stream_);
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    std::swap(capacity_, o.capacity_);
    std::swap(last_use_, o.last_use_);
    std::swap(readers_, o.readers_);
  }

 private:
  template <class U, class... Q>
  friend class basic_stream_buffer;

  /// Does a resource claiming `Q...` give every access the buffer has? (Its own assertions
  /// name what is missing.)
  template <class... Q>
  static constexpr bool claims() {
    static_assert(!is_host_accessible || has_property_v<host_accessible, Q...>,
                  "streamalloc::stream_buffer: this buffer's elements are accessed from host code, but the resource "
                  "does not claim host_accessible (a device pool's memory cannot be read by the host)");
    static_assert(!is_device_accessible || has_property_v<device_accessible, Q...>,
                  "streamalloc::stream_buffer: this buffer is used by kernels, but the resource does not claim "
                  "device_accessible");
    return true;
  }

  /// A stream of a device the buffer's pool does not serve: says which, and how to grant it.
  [[noreturn]] STREAMALLOC_COLD void throw_not_served(const char* member, int stream_device) const {
    const std::string d = std::to_string(stream_device);
    throw std::invalid_argument(std::string("streamalloc::stream_buffer::") + member + ": the stream belongs to device " +
                                d + ", which cannot use the buffer's memory (its pool serves device " +
                                std::to_string(pool_->device()) + " and the devices granted access); grant device " +
                                d + " access first (pool.set_access(streamalloc::memory_location::device(" + d +
                                "), streamalloc::access_flags::read_write)), or use a stream of device " +
                                std::to_string(pool_->device()));
  }

  static size_type bytes_for(size_type count) {
    if (count > (std::size_t{1} << 62) / sizeof(T)) {
      throw std::length_error("streamalloc::stream_buffer: " + std::to_string(count) + " elements of " +
                              std::to_string(sizeof(T)) + " bytes is more than any pool can hold");
    }
    return count * sizeof(T);
  }

  void allocate_initial(size_type count) {
    // The checks read the stream's record once the memory is allocated: looked up first, a
    // stream that cannot be identified (a raw handle being captured) is refused before anything
    // is allocated, not after, with the allocation lost to the graph.
    if constexpr (STREAMALLOC_CHECK_ORDERING != 0) (void)stream_.record();
    data_ = allocate_bytes(bytes_for(count));
    size_ = capacity_ = count;
    touch();
  }

  /// `bytes` from the pool on the buffer's stream, placed with room to grow; logged when the
  /// buffer has a log (an empty request allocates nothing and is not).
  T* allocate_bytes(size_type bytes) {
    const auto allocate = [&] { return static_cast<T*>(pool_->allocate(bytes, stream_, placement::room_to_grow)); };
    if (log_ == nullptr || bytes == 0) [[likely]] return allocate();
    const cudaStream_t h = stream_.get();
    return detail::logged_allocation(log_.get(), detail::log_op::allocate_async, bytes, 256, &h, allocate);
  }

  /// A line of the buffer's log, when it has one (a free is written before the pool frees).
  void log_line(detail::log_op op, const void* p, std::size_t bytes) const noexcept {
    if (log_ == nullptr) [[likely]] return;
    const cudaStream_t h = stream_.get();
    log_->ok(op, p, bytes, 256, &h);
  }

  // The buffer's last use on its stream, for checking proofs made afterwards. `stream_` is
  // resolved once (constructor, set_stream), so this reads the record without a driver call.
  // Only the run-time checks read it: without them this costs nothing.
  void touch() const {
    if constexpr (STREAMALLOC_CHECK_ORDERING != 0) last_use_ = stream_.record().current_epoch();
  }

  void check_host_access() const {
    if constexpr (STREAMALLOC_CHECK_ORDERING != 0) {
      if (stream_.record().completed() < last_use_) [[unlikely]] {
        throw ordering_error(
            "streamalloc: stream_buffer: host access before the host is ordered after the buffer's stream (its "
            "allocation, a copy or a resize may still be running): synchronize the stream first");
      }
    }
  }

  void copy_bytes(void* dst, const void* src, std::size_t bytes) const {
    if (bytes == 0) return;
    {
      const detail::scoped_context in_stream_context(detail::context_of(stream_));  // as in fill_zero
      detail::check_runtime(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_.get()), "cudaMemcpyAsync");
    }
    touch();
  }

  template <class... Q>
  void copy_buffer(const basic_stream_buffer<T, Q...>& other) {
    const size_type n = other.size_;
    if (n > size_) throw std::invalid_argument("streamalloc::stream_buffer::copy_from: the source is longer than the buffer");
    copy_bytes(data_, other.data_, n * sizeof(T));
  }

  void free_now() {
    readers_.order_before_free(stream_);
    log_line(detail::log_op::free_async, data_, capacity_ * sizeof(T));
    pool_->deallocate(data_, stream_);
    data_ = nullptr;
  }

  void release() noexcept {
    if (data_ == nullptr) return;
    if (pool_->closed()) [[unlikely]] {
      // Closing the pool released its memory (and reported this allocation): nothing is left
      // to free, and no reader needs ordering before a free that will not happen.
      data_ = nullptr;
      readers_.clear();
      size_ = capacity_ = 0;
      return;
    }
    // A destructor may not throw: a bad free (the memory freed already through the pool) goes
    // to the bad-free handler. Ordering a reader may fail (a dead context): the free is then
    // not made, so nothing a reader may still use is reused, and the pool reports the
    // allocation when it is closed.
    detail::free_or_report(pool_ref(*pool_), data_, "streamalloc::stream_buffer (destroyed or reassigned)",
                           [&] { free_now(); });
    data_ = nullptr;
    readers_.clear();
    size_ = capacity_ = 0;
  }

  detail::pool_state* pool_ = nullptr;  // the pool's state: it stays when the pool is moved
  std::shared_ptr<detail::allocation_log> log_;  // made from a logging_resource: its log
  stream_ref stream_ = stream_ref::legacy_default();
  T* data_ = nullptr;
  size_type size_ = 0;
  size_type capacity_ = 0;
  mutable std::uint64_t last_use_ = 0;
  // Streams that read the buffer through copy_from(other, proof): ordered before its free.
  // Mutable: the buffer read is the const source of the copy.
  mutable detail::buffer_readers readers_;
};

/// Device memory, for kernels.
template <class T>
using stream_buffer = basic_stream_buffer<T, device_accessible>;
/// Host memory from a host pool, for host code and kernels.
template <class T>
using host_stream_buffer = basic_stream_buffer<T, host_accessible, device_accessible>;

}  // namespace STREAMALLOC_ORDERING_MODE

}  // namespace streamalloc
