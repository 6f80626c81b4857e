#pragma once

// What the pool core needs from below: physical memory, virtual addresses and device events.
// The core is free of CUDA; two backends model this concept, the VMM one (vmm_backend.hpp, on
// the driver) and the simulated device of the CPU tests (tests/support/sim_backend.hpp), and
// both are checked against it at compile time.

#include <streamalloc/detail/core/ordering.hpp>

#include <cuda.h>

#include <concepts>
#include <exception>
#include <type_traits>
#include <cstdint>

namespace streamalloc::detail {

/// A stream as the pool sees it: its ordering record and its CUDA handle.
struct stream_key {
  stream_record* record = nullptr;
  void* native = nullptr;  ///< cudaStream_t
};

/**
 * A backend of the pool core:
 * - `handle`: a piece of physical memory; `event`: a device event.
 * - `granularity()`: the size every reservation, creation and mapping is a multiple of.
 * - `reserve(bytes)`: the base of `bytes` of new virtual addresses (throws when there are none);
 *   `try_reserve(bytes, at)`: the same, or 0 when the address space is exhausted (with `at`
 *   non-zero: 0 unless the addresses could be placed exactly there).
 * - `create(bytes, out)`: physical memory; returns CUDA_ERROR_OUT_OF_MEMORY when there is none
 *   (the core then tries to free some and asks again), any other failure throws.
 * - `map(va, bytes, h)`: maps `h` at `va` and grants the pool's accesses; may throw.
 *   `refused(e)`: whether `e`, thrown by `map`, is the device refusing the mapping for lack of
 *   memory (cuMemMap and cuMemSetAccess need memory of their own): the core then does without
 *   that mapping (remapping stops, growth in place says no). Any other failure (a sticky error,
 *   a lost context, a bad argument) is not a refusal and propagates.
 * - `record(stream)`, `wait(stream, e)`: an event recorded on a stream, a stream made to wait
 *   on one; `done(e)`: has the device passed it; `idle(stream)`: has the stream run all its work.
 * - `capturing(stream)`: is the stream being captured into a graph (it then runs nothing now,
 *   and may be neither queried nor recorded on); never throws.
 * - `capture_guard`: made from the backend around the core's slow paths; while it lives, the
 *   calling thread's driver calls are not refused because another thread captures a stream
 *   into a graph (CUDA's global capture mode forbids "unsafe" calls to every thread).
 * - `unmap`, `release`, `synchronize` (the host waits for an event) and `destroy` (of an event)
 *   are what the core calls while giving memory back, from destructors and after failures: they
 *   may not throw. Every call is made under the pool's lock.
 */
template <class B>
concept pool_backend = requires(B& b, std::uint64_t n, typename B::handle& h, typename B::event& e, const stream_key& k,
                                 const std::exception& ex) {
  typename B::handle;
  typename B::event;
  requires std::is_nothrow_constructible_v<typename B::capture_guard, B&>;
  { b.granularity() } -> std::same_as<std::uint64_t>;
  { b.reserve(n) } -> std::same_as<std::uint64_t>;
  { b.try_reserve(n, n) } -> std::same_as<std::uint64_t>;
  { b.create(n, h) } -> std::same_as<CUresult>;
  b.map(n, n, h);
  { B::refused(ex) } noexcept -> std::same_as<bool>;
  { b.unmap(n, n) } noexcept;
  { b.release(h) } noexcept;
  { b.record(k) } -> std::same_as<typename B::event>;
  { b.done(e) } -> std::convertible_to<bool>;
  { b.idle(k) } -> std::convertible_to<bool>;
  { b.capturing(k) } noexcept -> std::convertible_to<bool>;
  { b.lost_to_capture(k, e) } noexcept -> std::convertible_to<bool>;
  b.wait(k, e);
  { b.synchronize(e) } noexcept;
  { b.destroy(e) } noexcept;
};

/**
 * A backend whose memory other devices may reach (the VMM one): `grant_peers(va, bytes, devices)`
 * gives the devices of the mask (bit d: device d) read-write access to a graph's piece, over
 * what is mapped there and what is mapped there later, beyond the pool's own access, until
 * `forget_peers(va)`. The pool core calls them for graphs' memory with peers; a backend without
 * them (the simulated device) has none to give.
 */
template <class B>
concept backend_with_peers = requires(B& b, std::uint64_t n) {
  b.grant_peers(n, n, n);
  { b.forget_peers(n) } noexcept;
};

}  // namespace streamalloc::detail
