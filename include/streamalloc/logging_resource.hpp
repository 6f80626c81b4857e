#pragma once

/// @file
/// @brief `logging_resource<Upstream>`: a memory resource that writes every allocate and free it
/// passes to another resource as one line of CSV or JSON, to a file or a `std::ostream`.

#include <streamalloc/detail/log_sink.hpp>  // where the lines go, and how each is written
#include <streamalloc/logging_options.hpp>
#include <streamalloc/resource.hpp>  // and detail/allocation_log.hpp, the log as a pool's other users see it
#include <streamalloc/stream.hpp>

#include <cuda/memory_resource>
#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include <concepts>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace streamalloc {

namespace detail {

/// A resource whose stream-ordered calls take streamalloc's stream_ref (pool_resource, and so
/// a logging_resource over one): given it as is, so that a resolved stream stays resolved.
template <class R>
concept takes_streamalloc_stream = requires(R& r, void* p, std::size_t n, stream_ref s) {
  { r.allocate_async(n, n, s) } -> std::same_as<void*>;
  r.deallocate_async(p, n, n, s);
};

}  // namespace detail

/**
 * @brief A memory resource that passes every allocate and free to `Upstream` and writes each
 * as one line, CSV or JSON lines, to a file it opens or a `std::ostream` its caller owns.
 *
 * It models what `Upstream` models of CCCL's `cuda::mr` concepts (`resource`, and
 * `async_resource` when the upstream has stream-ordered calls) and carries the upstream's
 * properties (`device_accessible`, `host_accessible`, stateful ones too), so a
 * `logging_resource<device_resource>` is a `device_memory_resource` and goes wherever a CCCL
 * resource or `cuda::mr::async_resource_ref<device_accessible>` does. It wraps any such resource:
 * a `pool_resource`, CCCL's resource refs, another `logging_resource`.
 *
 * Each line: the time in nanoseconds since the log was made (a steady clock), the thread (1, 2,
 * ... in order of each thread's first line in the process), the operation (`allocate`, `free`,
 * `allocate_async`, `free_async`), the pointer, the bytes and alignment asked for, the stream's
 * raw handle (empty, or null, for a synchronous call) and the outcome: `ok`, or `failed` with the
 * exception's type and message for an allocation that threw, which is then rethrown unchanged.
 * An allocation is written once the upstream returned; a free before it is handed to the
 * upstream, so that down the file an address is always freed before it is allocated again.
 * A free the upstream refuses (a foreign pointer, a double free) is reported by the upstream
 * (`pool_resource`: the bad-free handler) and is logged as `ok` like any other: a free line says
 * the free was asked for. `docs/observability.md` shows the lines and what they cost.
 *
 * Thread-safe without a lock on the way (a ticket per line): lines of concurrent calls never
 * mix; the order of the lines is the order of the calls; each thread's times never decrease.
 * Lines wait in memory (`logging_options::buffer_bytes`) and are written as they pile up, at
 * `flush()` and when the last resource writing to the log is destroyed; a failed write never
 * fails an allocation, `flush()` reports it. Move-only; a moved-from resource throws `std::logic_error` from its allocations and
 * passes frees to its upstream unlogged. Equal to another `logging_resource` writing to the same
 * log (made with the sharing constructor) over an equal upstream: memory of one may be freed
 * through the other and the log still holds both lines.
 * @code
 * streamalloc::pool pool;
 * streamalloc::logging_resource mr(streamalloc::device_resource(pool), "allocations.csv");
 * cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref(mr);
 * void* p = ref.allocate_async(1 << 20, 256, cuda::stream_ref(s.get()));  // one line
 * ref.deallocate_async(p, 1 << 20, 256, cuda::stream_ref(s.get()));       // another
 * @endcode
 * @tparam Upstream the resource it allocates from, held by value (a `pool_resource` is a
 *         small handle; a move-only resource is moved in)
 */
template <class Upstream>
  requires ::cuda::mr::resource<Upstream>
class logging_resource : public ::cuda::forward_property<logging_resource<Upstream>, Upstream> {
 public:
  /// The type of the resource it passes calls to.
  using upstream_type = Upstream;
  /// Does the upstream claim `host_accessible`?
  static constexpr bool is_host_accessible = (::cuda::has_property<Upstream, host_accessible>);
  /// Does the upstream claim `device_accessible`?
  static constexpr bool is_device_accessible = (::cuda::has_property<Upstream, device_accessible>);

  /**
   * @brief Logs to `file`, which it creates, or truncates if it exists, and closes at the end.
   * @param upstream the resource that allocates
   * @param file where the lines go
   * @param format CSV or JSON lines
   * @throws std::system_error when the file cannot be opened (naming it)
   */
  logging_resource(Upstream upstream, const std::filesystem::path& file, log_format format = log_format::csv)
      : logging_resource(std::move(upstream), file, logging_options{.format = format}) {}
  /// As above, with all the options. @throws std::system_error, std::invalid_argument (a bad option)
  logging_resource(Upstream upstream, const std::filesystem::path& file, const logging_options& options)
      : upstream_(std::move(upstream)), sink_(std::make_shared<detail::log_sink>(file, options)) {}
  /**
   * @brief Logs to `out`, which must outlive every resource writing to it and which nothing else
   * may write to while they live (they write to it from whichever thread fills the buffer).
   */
  logging_resource(Upstream upstream, std::ostream& out, log_format format = log_format::csv)
      : logging_resource(std::move(upstream), out, logging_options{.format = format}) {}
  /// As above, with all the options. @throws std::invalid_argument (a bad option)
  logging_resource(Upstream upstream, std::ostream& out, const logging_options& options)
      : upstream_(std::move(upstream)), sink_(std::make_shared<detail::log_sink>(out, options)) {}
  /**
   * @brief Logs to the same log as `same_log_as` (its file or stream, its format, its clock):
   * the lines of both are in one file, in order. The log is closed when the last resource
   * writing to it goes. Compares equal to `same_log_as` when their upstreams are equal.
   * @throws std::invalid_argument when `same_log_as` was moved from
   */
  template <class Other>
  logging_resource(Upstream upstream, const logging_resource<Other>& same_log_as)
      : upstream_(std::move(upstream)), sink_(same_log_as.sink_) {
    if (sink_ == nullptr) {
      throw std::invalid_argument("streamalloc::logging_resource: the resource to share a log with was moved from");
    }
  }

  logging_resource(const logging_resource&) = delete;
  logging_resource& operator=(const logging_resource&) = delete;
  /// Takes `other`'s upstream and log; `other` is left without a log.
  logging_resource(logging_resource&& other) noexcept(std::is_nothrow_move_constructible_v<Upstream>)
      : upstream_(std::move(other.upstream_)), sink_(std::exchange(other.sink_, nullptr)) {}
  /// Flushes its own log (another resource may still write to it), then takes `other`'s.
  logging_resource& operator=(logging_resource&& other) noexcept(std::is_nothrow_move_assignable_v<Upstream>) {
    if (this != &other) {
      if (sink_ != nullptr) sink_->flush_noexcept();
      upstream_ = std::move(other.upstream_);
      sink_ = std::exchange(other.sink_, nullptr);
    }
    return *this;
  }
  /// Writes what is waiting; the log is closed if no other resource writes to it.
  ~logging_resource() {
    if (sink_ != nullptr) sink_->flush_noexcept();
  }

  /**
   * @brief Synchronous allocation through the upstream, logged as `allocate`.
   * @throws whatever the upstream throws, unchanged, after logging it; std::logic_error when
   *         moved from
   */
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = 256) {
    return logged(detail::log_op::allocate, bytes, alignment, nullptr,
                  [&] { return upstream_.allocate(bytes, alignment); });
  }
  /// Synchronous free through the upstream, logged as `free` (before it is handed on).
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = 256) noexcept(
      noexcept(std::declval<Upstream&>().deallocate(p, bytes, alignment))) {
    log_free(detail::log_op::free, p, bytes, alignment, nullptr);
    upstream_.deallocate(p, bytes, alignment);
  }

  /**
   * @brief Allocation in the order of `s`, logged as `allocate_async`.
   * @throws whatever the upstream throws, unchanged, after logging it; std::logic_error when
   *         moved from
   */
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment, ::cuda::stream_ref s)
    requires ::cuda::mr::async_resource<Upstream>
  {
    const cudaStream_t h = s.get();
    return logged(detail::log_op::allocate_async, bytes, alignment, &h,
                  [&] { return upstream_.allocate_async(bytes, alignment, s); });
  }
  /// As above, with streamalloc's stream reference (passed on as is where the upstream takes it).
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment, stream_ref s)
    requires ::cuda::mr::async_resource<Upstream>
  {
    const cudaStream_t h = s.get();
    return logged(detail::log_op::allocate_async, bytes, alignment, &h, [&] {
      if constexpr (detail::takes_streamalloc_stream<Upstream>) {
        return upstream_.allocate_async(bytes, alignment, s);
      } else {
        return upstream_.allocate_async(bytes, alignment, ::cuda::stream_ref(h));
      }
    });
  }
  /// Allocation in the order of `s`, aligned to 256 bytes.
  [[nodiscard]] void* allocate_async(std::size_t bytes, stream_ref s)
    requires ::cuda::mr::async_resource<Upstream>
  {
    return allocate_async(bytes, 256, s);
  }
  /// Free in the order of `s`, logged as `free_async` (before it is handed on).
  void deallocate_async(void* p, std::size_t bytes, std::size_t alignment, ::cuda::stream_ref s) noexcept(
      noexcept(std::declval<Upstream&>().deallocate_async(p, bytes, alignment, s)))
    requires ::cuda::mr::async_resource<Upstream>
  {
    const cudaStream_t h = s.get();
    log_free(detail::log_op::free_async, p, bytes, alignment, &h);
    upstream_.deallocate_async(p, bytes, alignment, s);
  }
  /// As above, with streamalloc's stream reference.
  void deallocate_async(void* p, std::size_t bytes, std::size_t alignment, stream_ref s) noexcept(
      noexcept(std::declval<Upstream&>().deallocate_async(p, bytes, alignment, ::cuda::stream_ref(s.get()))))
    requires ::cuda::mr::async_resource<Upstream>
  {
    const cudaStream_t h = s.get();
    log_free(detail::log_op::free_async, p, bytes, alignment, &h);
    if constexpr (detail::takes_streamalloc_stream<Upstream>) {
      upstream_.deallocate_async(p, bytes, alignment, s);
    } else {
      upstream_.deallocate_async(p, bytes, alignment, ::cuda::stream_ref(h));
    }
  }
  /// Free of what `allocate_async(bytes, s)` returned, in the order of `s`.
  void deallocate_async(void* p, std::size_t bytes, stream_ref s) noexcept(
      noexcept(std::declval<logging_resource&>().deallocate_async(p, bytes, std::size_t{256}, s)))
    requires ::cuda::mr::async_resource<Upstream>
  {
    deallocate_async(p, bytes, 256, s);
  }

  /**
   * @brief Writes the lines waiting in memory to the log (and flushes a `std::ostream`).
   * @throws std::runtime_error if a write to the log has failed since it was made (saying why
   *         and how many bytes were lost); the allocations themselves never fail for it
   */
  void flush() {
    if (sink_ != nullptr) sink_->flush();
  }
  /// False once a write to the log has failed (`flush()` says why); false when moved from.
  [[nodiscard]] bool good() const noexcept { return sink_ != nullptr && sink_->good(); }
  /// The format of its lines. @throws std::logic_error when moved from
  [[nodiscard]] log_format format() const {
    if (sink_ == nullptr) throw_moved_from("format");
    return sink_->format();
  }
  /// The resource it passes calls to.
  [[nodiscard]] const Upstream& upstream_resource() const noexcept { return upstream_; }

  /// Equal when they write to the same log and their upstreams are equal (see the class).
  friend bool operator==(const logging_resource& a, const logging_resource& b) noexcept(
      noexcept(std::declval<const Upstream&>() == std::declval<const Upstream&>())) {
    return a.sink_ == b.sink_ && a.upstream_ == b.upstream_;
  }
  /// Not equal (see `operator==`).
  friend bool operator!=(const logging_resource& a, const logging_resource& b) noexcept(noexcept(a == b)) {
    return !(a == b);
  }

 private:
  template <class U>
    requires ::cuda::mr::resource<U>
  friend class logging_resource;
  friend struct detail::logging_access;

  template <class Allocate>
  void* logged(detail::log_op op, std::size_t bytes, std::size_t alignment, const cudaStream_t* s, Allocate&& allocate) {
    if (sink_ == nullptr) [[unlikely]] throw_moved_from(detail::log_op_name(op));
    void* p = nullptr;
    try {
      p = allocate();
    } catch (...) {
      log_failure(op, bytes, alignment, s);
      throw;
    }
    log_ok(op, p, bytes, alignment, s);
    return p;
  }

  void log_free(detail::log_op op, void* p, std::size_t bytes, std::size_t alignment, const cudaStream_t* s) noexcept {
    if (sink_ == nullptr) [[unlikely]] return;  // moved from: the free still goes to the upstream
    log_ok(op, p, bytes, alignment, s);
  }

  void log_ok(detail::log_op op, const void* p, std::size_t bytes, std::size_t alignment,
              const cudaStream_t* s) noexcept {
    sink_->ok(op, p, bytes, alignment, s);
  }
  // In the handler of what the upstream threw (which is rethrown after it).
  STREAMALLOC_COLD void log_failure(detail::log_op op, std::size_t bytes, std::size_t alignment,
                                    const cudaStream_t* s) noexcept {
    sink_->failed(op, bytes, alignment, s);
  }

  [[noreturn]] STREAMALLOC_COLD static void throw_moved_from(std::string_view what) {
    throw std::logic_error("streamalloc::logging_resource::" + std::string(what) + ": the resource was moved from");
  }

  Upstream upstream_;
  std::shared_ptr<detail::log_sink> sink_;
};

static_assert(::cuda::mr::async_resource_with<logging_resource<device_resource>, device_accessible>);
static_assert(!::cuda::mr::resource_with<logging_resource<device_resource>, host_accessible>);
static_assert(::cuda::mr::async_resource_with<logging_resource<host_device_resource>, host_accessible, device_accessible>);
static_assert(::cuda::mr::async_resource_with<logging_resource<host_resource>, host_accessible>);
static_assert(!::cuda::mr::resource_with<logging_resource<host_resource>, device_accessible>);
static_assert(device_memory_resource<logging_resource<device_resource>>);
static_assert(host_memory_resource<logging_resource<host_resource>>);

}  // namespace streamalloc
