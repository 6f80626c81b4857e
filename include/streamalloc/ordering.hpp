#pragma once

/// @file
/// @brief Ordering tokens: values that prove one stream's work runs after another's, and the
/// `ordering_proof` concept that stream-ordered APIs ask for.
///
/// The stream-ordering rules (memory allocated on stream A is used on stream B only after B is
/// ordered after the allocation; memory is freed on a stream only after every stream that used
/// it is ordered before the free) become types: functions that hand memory from one stream to
/// another take a proof, and a proof is only made by the calls that create the ordering:
///
/// | made by                                    | type          | proves                          |
/// | ------------------------------------------ | ------------- | ------------------------------- |
/// | `b.wait(e)` (e recorded on a, streamalloc) | `stream_order`| b runs after a, up to the record |
/// | `order_after(b, a)`                        | `stream_order`| b runs after all enqueued on a   |
/// | `a.synchronize()`, `e.synchronize()`       | `host_order`  | the host saw a's work finish     |
/// | `synchronize_device(d)`, `pool.synchronize()` | `host_order` | the host saw all d's work finish |
///
/// A `stream_ref` or an event is not a proof: passing one where a proof is required fails to
/// compile. What types cannot know (which stream a token is for, whether it was made after the
/// buffer's last use) is checked at run time when `STREAMALLOC_CHECK_ORDERING` is 1 (the
/// default unless `NDEBUG` is defined), throwing `ordering_error` with what went wrong.

#include <streamalloc/detail/core/ordering.hpp>
#include <streamalloc/error.hpp>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#ifndef STREAMALLOC_CHECK_ORDERING
/// 1: misuses of ordering proofs and host access the compiler cannot see are checked at run
/// time (`ordering_error`); 0: not. Defaults to 1 without `NDEBUG` (debug builds), 0 with it.
/// Define it before including streamalloc to choose.
#ifdef NDEBUG
#define STREAMALLOC_CHECK_ORDERING 0
#else
#define STREAMALLOC_CHECK_ORDERING 1
#endif
#endif

// What the checks change (the bodies of `detail::check_proof` and of `basic_stream_buffer`'s
// members) lives in an inline namespace named after the mode. Two translation units built in
// different modes and linked into one program, a debug library beside a release one, would
// otherwise define the same inline functions and templates with different bodies: the linker
// keeps one of them for both, silently, and one side loses or gains its checks (a violation of
// the one-definition rule). With the namespace each side keeps its own; a function that passes
// a stream buffer from one mode to the other no longer links, and says so.
#if STREAMALLOC_CHECK_ORDERING != 0
/// The inline namespace holding what the checks change (see above); set by
/// STREAMALLOC_CHECK_ORDERING, not by users.
#define STREAMALLOC_ORDERING_MODE ordering_checked
#else
#define STREAMALLOC_ORDERING_MODE ordering_unchecked
#endif

namespace streamalloc {

/**
 * @brief A stream-ordering rule was broken in a way the types could not catch: an ordering
 * token for another stream, or one made before the buffer's last use. Thrown by the run-time
 * checks of debug builds (see `STREAMALLOC_CHECK_ORDERING` above).
 */
class ordering_error : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

class stream_ref;
class event_ref;

/**
 * @brief Proof that work enqueued on one stream (the later) after the token was made runs
 * after a point of another stream (the earlier). Made by `stream_ref::wait(event_ref)` and
 * `order_after(later, earlier)`; cannot be made up.
 */
class stream_order {
 public:
  /// Process-unique id of the stream waited for (0 when the event was never recorded through
  /// streamalloc: then the token proves nothing streamalloc can check).
  [[nodiscard]] constexpr std::uint64_t earlier_stream() const noexcept { return earlier_; }
  /// Process-unique id of the stream that waits.
  [[nodiscard]] constexpr std::uint64_t later_stream() const noexcept { return later_; }
  /// The point of the earlier stream the later one runs after.
  [[nodiscard]] constexpr std::uint64_t point() const noexcept { return epoch_; }

 private:
  friend class stream_ref;
  constexpr stream_order(std::uint64_t earlier, std::uint64_t epoch, std::uint64_t later) noexcept
      : earlier_(earlier), later_(later), epoch_(epoch) {}
  std::uint64_t earlier_, later_, epoch_;
};

/**
 * @brief Proof that the host saw a stream's work (or all of a device's) finish up to a point:
 * made by `stream_ref::synchronize()`, `event_ref::synchronize()`, `synchronize_device()` and
 * `pool::synchronize()`. After it, any stream may use what that work produced or released.
 */
class host_order {
 public:
  /// The stream synchronized with; 0 when every stream of `device()` was.
  [[nodiscard]] constexpr std::uint64_t stream() const noexcept { return stream_; }
  /// The device synchronized with (-1: not known, for a stream-wide proof).
  [[nodiscard]] constexpr int device() const noexcept { return device_; }
  /// The point of that stream's order (or the device's) the host saw finish.
  [[nodiscard]] constexpr std::uint64_t point() const noexcept { return epoch_; }

 private:
  friend class stream_ref;
  friend class event_ref;
  friend host_order synchronize_device(int);
  constexpr host_order(std::uint64_t stream, int device, std::uint64_t epoch) noexcept
      : stream_(stream), device_(device), epoch_(epoch) {}
  std::uint64_t stream_;
  int device_;
  std::uint64_t epoch_;
};

/// True for the types that prove an ordering.
template <class T>
inline constexpr bool is_ordering_proof_v = false;
template <>
/// A `stream_order` proves an ordering.
inline constexpr bool is_ordering_proof_v<stream_order> = true;
template <>
/// A `host_order` proves an ordering.
inline constexpr bool is_ordering_proof_v<host_order> = true;

/**
 * @brief A value that proves one stream's work runs after another's: `stream_order` or
 * `host_order`. A stream, an event or a pointer is not one.
 */
template <class P>
concept ordering_proof = is_ordering_proof_v<std::remove_cvref_t<P>>;

namespace detail {

inline std::string stream_name(std::uint64_t id) { return "stream #" + std::to_string(id); }

/// Why `proof` does not show that work on stream `to` (`nullptr`: the host) may use memory
/// whose last use was on `from` at stamp `last_use`; empty when it does.
inline std::string unproven(const stream_order& proof, stream_record& from, std::uint64_t last_use,
                            const stream_record* to) {
  if (to == nullptr) return "a stream_order orders streams, not the host: synchronize instead";
  if (proof.later_stream() != to->id()) {
    return "the token orders " + stream_name(proof.later_stream()) + ", but the memory is used on " +
           stream_name(to->id());
  }
  // The token itself, when it waited on the memory's stream after the last use; else the
  // vector clocks, which also see orderings through other streams (a before b before c).
  if (proof.earlier_stream() == from.id() && proof.point() >= last_use) return {};
  if (to->ordered_after(from.id()) >= last_use || from.completed() >= last_use) return {};
  // Stream 0: the event waited for has no record made through streamalloc (a raw cudaEvent_t,
  // recorded by a raw CUDA call if at all, or a streamalloc event not recorded yet), or the
  // record or the wait was captured into a graph (it orders the graph's work, not the streams').
  if (proof.earlier_stream() == 0) {
    return "the token waited on an event never recorded through streamalloc (a raw cudaEvent_t, recorded by a raw "
           "CUDA call if at all, or a streamalloc event not recorded yet), or the record or the wait was made during "
           "a stream capture, where it orders only the graph's work: streamalloc cannot check what it orders; wait "
           "on a streamalloc event recorded after the memory's last use, outside any capture, or use order_after";
  }
  if (proof.earlier_stream() != from.id()) {
    return "the token orders after " + stream_name(proof.earlier_stream()) + ", but the memory was last used on " +
           stream_name(from.id());
  }
  return "the token was made before the memory's last use on " + stream_name(from.id()) +
         " (record the event, or call order_after, after it)";
}

inline std::string unproven(const host_order& proof, stream_record& from, std::uint64_t last_use,
                            const stream_record*) {
  if (proof.stream() != 0 && proof.stream() != from.id()) {
    return "the host synchronized with " + stream_name(proof.stream()) + ", but the memory was last used on " +
           stream_name(from.id());
  }
  if (proof.stream() == 0 && proof.device() != from.device()) {
    return "the host synchronized with device " + std::to_string(proof.device()) + ", but the memory was last used on " +
           stream_name(from.id()) + " of device " + std::to_string(from.device());
  }
  if (from.completed() >= last_use) return {};
  return "the host synchronization happened before the memory's last use on " + stream_name(from.id());
}

inline namespace STREAMALLOC_ORDERING_MODE {
/// Throws ordering_error (when checks are on) if `proof` does not cover the use.
template <ordering_proof P>
void check_proof(const P& proof, stream_record& from, std::uint64_t last_use, const stream_record* to,
                 const char* what) {
  if constexpr (STREAMALLOC_CHECK_ORDERING != 0) {
    const std::string why = unproven(proof, from, last_use, to);
    if (!why.empty()) [[unlikely]] {
      throw ordering_error(std::string("streamalloc: ") + what + ": the ordering proof does not cover this use: " + why);
    }
  } else {
    (void)proof, (void)from, (void)last_use, (void)to, (void)what;
  }
}
}  // namespace STREAMALLOC_ORDERING_MODE

}  // namespace detail
}  // namespace streamalloc
