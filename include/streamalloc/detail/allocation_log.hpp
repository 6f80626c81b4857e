#pragma once

// The log a `logging_resource` writes to, as its pool's other users see it: `stream_buffer`,
// `device_arena` and `pmr_resource` made from a `logging_resource` over a `pool_resource`
// allocate from the pool directly (a buffer grows in place through it) and write their lines
// to the same log. Abstract, so that they need not include the logging machinery
// (<streamalloc/logging_resource.hpp> has the one implementation, `log_sink`); a user that
// was not made from a logging resource holds a null pointer and pays one branch. Included
// through <streamalloc/resource.hpp>, which enables CCCL's experimental resources first.

#include <cuda/memory_resource>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string_view>

namespace streamalloc {

template <class... Properties>
class pool_resource;
template <class Upstream>
  requires ::cuda::mr::resource<Upstream>
class logging_resource;

namespace detail {

/// A `logging_resource` over a `pool_resource`: what `stream_buffer`, `device_arena` and
/// `pmr_resource` accept besides the pool resource itself.
template <class R>
inline constexpr bool is_logged_pool_resource_v = false;
template <class... P>
inline constexpr bool is_logged_pool_resource_v<logging_resource<pool_resource<P...>>> = true;

/// What a log line records. `resize_async`: the allocation at the pointer now spans the bytes
/// given, grown or shrunk in place in the order of the stream (a `stream_buffer`'s growth).
enum class log_op : unsigned char { allocate, free, allocate_async, free_async, resize_async };

inline std::string_view log_op_name(log_op op) noexcept {
  constexpr std::string_view names[] = {"allocate", "free", "allocate_async", "free_async", "resize_async"};
  return names[static_cast<unsigned>(op)];
}

class allocation_log {
 public:
  /// One line for an operation that succeeded. `stream`: null for a synchronous one.
  virtual void ok(log_op op, const void* p, std::size_t bytes, std::size_t alignment,
                  const cudaStream_t* stream) noexcept = 0;
  /// One line for an allocation that threw: call it in the handler, with the exception being
  /// handled (its type and message are logged).
  virtual void failed(log_op op, std::size_t bytes, std::size_t alignment, const cudaStream_t* stream) noexcept = 0;

 protected:
  ~allocation_log() = default;
};

/// The log of a `logging_resource` (null when it was moved from), for the pool's other users.
struct logging_access {
  template <class Upstream>
  static std::shared_ptr<allocation_log> log_of(const logging_resource<Upstream>& r) noexcept {
    return r.sink_;
  }
};

/// Logs `allocate()`'s outcome as `op` of `bytes` on `stream` (null: synchronous), when there
/// is a log; returns what it returned, rethrows what it threw.
template <class Allocate>
auto logged_allocation(allocation_log* log, log_op op, std::size_t bytes, std::size_t alignment,
                       const cudaStream_t* stream, Allocate&& allocate) {
  if (log == nullptr) return allocate();
  try {
    auto p = allocate();
    log->ok(op, p, bytes, alignment, stream);
    return p;
  } catch (...) {
    log->failed(op, bytes, alignment, stream);
    throw;
  }
}

}  // namespace detail
}  // namespace streamalloc
