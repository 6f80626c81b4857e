#pragma once

// The operations on blocks: allocate, free (on the allocating stream, another one ordered after
// it, or the host), grow and shrink in place, hand a block to another stream, and pass pointers
// that are no live block's start. Each calls the pool as the stream's owner would, records the
// result in the model and checks what the call promises.

#include "harness.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <iterator>
#include <stdexcept>

namespace pool_core_fuzz {

inline void harness::allocate(std::size_t s, std::uint64_t bytes, streamalloc::placement where, bool refuse_a_map,
                              unsigned maps_first, bool fail_instead) {
  if (bytes > pool_front_limit) {
    TRACE("allocate(%llu) on stream %zu: refused by the pool before the core", ull(bytes), s);
    return;
  }
  const std::uint64_t n = round_up(bytes == 0 ? 1 : bytes, 256);
  TRACE("allocate(%llu%s) on stream %zu", ull(bytes), where == streamalloc::placement::room_to_grow ? ", room" : "",
        s);
  std::uint64_t p = 0;
  current_ = key_of(s);
  const bool failing = refuse_a_map && fail_instead;
  if (refuse_a_map) TRACE("  the driver %s a mapping after %u more", failing ? "fails" : "refuses", maps_first);
  dev_->refuse_maps = refuse_a_map ? 1 : 0;
  dev_->maps_before_refusal = refuse_a_map ? maps_first : 0;
  dev_->fail_maps = failing;
  // A failed mapping that is not a refusal was reached (refuse_maps back to 0): only an
  // exception may follow, the driver's.
  auto swallowed = [&](const char* how) {
    if (failing && dev_->refuse_maps == 0) fail("allocate(%llu) on stream %zu: a failed mapping was swallowed (%s)", ull(bytes), s, how);
  };
  try {
    p = pool_->allocate(bytes, key_of(s), where);
  } catch (const core_out_of_memory& e) {
    current_ = {};
    swallowed("out of memory instead");
    dev_->refuse_maps = 0;
    dev_->maps_before_refusal = 0;
    dev_->fail_maps = false;
    TRACE("  out of memory: %s", e.reason.c_str());
    // A refused mapping may cost the pool the chunk it was moving (it goes back to the
    // device), never the ability to grow: the usual check holds.
    check_out_of_memory(n, e);
    return;
  } catch (const std::runtime_error& e) {
    current_ = {};
    // Growth whose mapping is refused fails with the driver's error, as it would on its own.
    if (!refuse_a_map || dev_->refuse_maps != 0) fail("allocate(%llu) on stream %zu threw %s", ull(bytes), s, e.what());
    dev_->fail_maps = false;
    TRACE("  the %s reached the caller: %s", failing ? "failure" : "refusal", e.what());
    return;
  } catch (const std::exception& e) {
    fail("allocate(%llu) on stream %zu threw %s", ull(bytes), s, e.what());
  }
  current_ = {};
  swallowed("the request was served");
  dev_->refuse_maps = 0;
  dev_->maps_before_refusal = 0;
  dev_->fail_maps = false;
  const auto got = pool_->find_live(p);
  if (!got || got->first != p) fail("allocate(%llu) returned %#llx, not a live block's start", ull(bytes), ull(p));
  const std::uint64_t size = got->second;
  TRACE("  -> [%#llx, +%llu)", ull(p), ull(size));
  if (size < n || size > n + n / 4 + 512)
    fail("allocate(%llu) gave a block of %llu bytes for %llu", ull(bytes), ull(size), ull(n));
  check_handed(p, size, p, s, "allocate");
  live_[p] = {p, size, s};
  enqueue(s);  // work on s uses it
}

inline void harness::free_live() {
  if (live_.empty()) return;
  auto it = std::next(live_.begin(), static_cast<std::ptrdiff_t>(in_.byte() % live_.size()));
  const live_block l = it->second;
  const std::uint8_t b = in_.byte();
  std::size_t fs = l.owner;
  if (fs == host || !streams_[fs].alive || b % 4 == 0) fs = pick_stream(in_.byte(), b % 4 == 0 ? l.owner : none);
  if (fs == none) fs = host;
  free_block(l.addr, fs, b & 4);
}

/// Frees a live block on stream fs (the host: deallocate_sync), first keeping the contract:
/// fs ordered after the block's users; for the host, the users' work done (announced through
/// a host synchronization, or known some other way the pool does not see).
inline void harness::free_block(std::uint64_t addr, std::size_t fs, bool announce) {
  const live_block l = live_.at(addr);
  if (fs == host) {
    if (announce && streams_[l.owner].alive && l.owner != host) {
      host_synchronize(l.owner);
    } else {
      device_run(l.owner, streams_[l.owner].ops);
    }
  } else {
    order_after(fs, l.owner);
  }
  TRACE("deallocate(%#llx, %llu bytes of stream %zu) on stream %zu", ull(addr), ull(l.size), l.owner, fs);
  // The free takes its place in the stream's order as the call is made, as cudaFreeAsync's
  // does: an event the pool records on the stream during the call comes after it.
  const auto op = enqueue(fs);
  current_ = key_of(fs);
  try {
    pool_->deallocate(addr, key_of(fs));
  } catch (const std::exception& e) {
    fail("deallocate of the live block [%#llx, +%llu) on stream %zu threw %s", ull(addr), ull(l.size), fs, e.what());
  }
  current_ = {};
  live_.erase(addr);
  history_.push_back({l.addr, l.size, fs, op});
  remember_freed(l.addr);
}

inline void harness::remember_freed(std::uint64_t a) {
  if (freed_addrs_.size() < 64) {
    freed_addrs_.push_back(a);
  } else {
    freed_addrs_[freed_next_++ % 64] = a;
  }
}

/// A pointer that is no live block's start, given to deallocate, grow_in_place or
/// shrink_in_place: std::invalid_argument, and nothing changed.
inline void harness::bad_pointer() {
  const std::uint8_t kind = in_.byte(), call = in_.byte();
  std::uint64_t p = 0;
  switch (kind % 6) {
    case 0:
    case 1: {  // inside a live block, aligned or not
      if (live_.empty()) return;
      const live_block& l = std::next(live_.begin(), static_cast<std::ptrdiff_t>(in_.byte() % live_.size()))->second;
      if (l.size < 2) return;
      const std::uint64_t off = kind % 6 == 0 ? 1 + in_.bytes(4) % (l.size - 1) : 256 * (1 + in_.byte());
      if (off >= l.size) return;
      p = l.addr + off;
      break;
    }
    case 2:  // freed before (it may be live again: then it is not a bad pointer)
      if (freed_addrs_.empty()) return;
      p = freed_addrs_[in_.byte() % freed_addrs_.size()];
      break;
    case 3:  // anywhere in the pool's addresses
      p = pool_->base() + in_.bytes(5) % pool_->address_space();
      if (in_.byte() & 1) p &= ~std::uint64_t{255};
      break;
    case 4: {  // just outside
      const std::uint64_t edges[] = {0, pool_->base() - 256, pool_->base() + pool_->address_space(), ~0ull - 255};
      p = edges[in_.byte() % 4];
      break;
    }
    default:  // anything
      p = in_.bytes(8);
      break;
  }
  if (live_.count(p) != 0) return;
  std::size_t s = pick_stream(in_.byte());
  if (s == none) s = host;
  if (s == host && call % 3 != 0) return;  // only deallocate has a host form
  const std::uint64_t bytes = in_.bytes(3);
  const char* names[] = {"deallocate", "grow_in_place", "shrink_in_place"};
  TRACE("%s(%#llx) on stream %zu: not a live block", names[call % 3], ull(p), s);
  const pool_statistics before = pool_->statistics();
  current_ = key_of(s);
  try {
    switch (call % 3) {
      case 0: pool_->deallocate(p, key_of(s)); break;
      case 1: (void)pool_->grow_in_place(p, bytes, key_of(s)); break;
      default: (void)pool_->shrink_in_place(p, bytes, key_of(s)); break;
    }
    fail("%s(%#llx) accepted a pointer that is no live block's start", names[call % 3], ull(p));
  } catch (const std::invalid_argument& e) {
    TRACE("  invalid_argument: %s", e.what());
  } catch (const std::exception& e) {
    fail("%s(%#llx) threw %s, not std::invalid_argument", names[call % 3], ull(p), e.what());
  }
  current_ = {};
  if (!same(before, pool_->statistics())) fail("%s(%#llx) refused the pointer but changed the statistics", names[call % 3], ull(p));
}

/// A live block whose owner is a live stream (grow, shrink and move act in its order).
inline live_block* harness::pick_block_of_live_stream() {
  if (live_.empty()) return nullptr;
  live_block& l = std::next(live_.begin(), static_cast<std::ptrdiff_t>(in_.byte() % live_.size()))->second;
  if (l.owner == host || !streams_[l.owner].alive) return nullptr;
  return &l;
}

inline void harness::grow() {
  live_block* l = pick_block_of_live_stream();
  const std::uint8_t b = in_.byte();
  const std::uint64_t v = size_from_input();
  if (l == nullptr) return;
  const std::uint64_t old = l->size, p = l->addr;
  const std::size_t s = l->owner;
  const std::uint64_t bytes = (b & 1) && v <= pool_front_limit ? old + v : v;
  if (bytes > pool_front_limit) {  // the pool returns 0 before the core
    TRACE("grow_in_place(%#llx, %llu): refused by the pool before the core", ull(p), ull(bytes));
    return;
  }
  const std::uint64_t n = round_up(bytes == 0 ? 1 : bytes, 256);
  TRACE("grow_in_place(%#llx of %llu, %llu) on stream %zu", ull(p), ull(old), ull(bytes), s);
  std::uint64_t r = 0;
  current_ = key_of(s);
  try {
    r = pool_->grow_in_place(p, bytes, key_of(s));
  } catch (const std::exception& e) {
    fail("grow_in_place(%#llx, %llu) of a live block threw %s", ull(p), ull(bytes), e.what());
  }
  current_ = {};
  const auto got = pool_->find_live(p);
  if (!got || got->first != p) fail("grow_in_place(%#llx): the block is no longer live", ull(p));
  TRACE("  -> %llu", ull(r));
  if (r == 0) {
    if (got->second != old) fail("grow_in_place(%#llx) said no but the block is %llu bytes, was %llu", ull(p), ull(got->second), ull(old));
    return;
  }
  if (n <= old && r != old) fail("grow_in_place(%#llx, %llu) of a %llu-byte block returned %llu", ull(p), ull(bytes), ull(old), ull(r));
  if (r < n || got->second != r)
    fail("grow_in_place(%#llx, %llu) returned %llu; the block is %llu bytes", ull(p), ull(bytes), ull(r), ull(got->second));
  if (r > old) {
    check_handed(p, r, p + old, s, "grow_in_place");
    l->size = r;
    enqueue(s);  // work on s uses the new bytes
  }
}

inline void harness::shrink() {
  live_block* l = pick_block_of_live_stream();
  const std::uint64_t bytes = size_from_input();
  if (l == nullptr) return;
  const std::uint64_t old = l->size, p = l->addr;
  const std::size_t s = l->owner;
  // What the call promises, computed without overflow.
  const std::uint64_t want = bytes >= old ? old : std::max<std::uint64_t>(256, round_up(bytes, 256));
  TRACE("shrink_in_place(%#llx of %llu, %llu) on stream %zu", ull(p), ull(old), ull(bytes), s);
  std::uint64_t r = 0;
  current_ = key_of(s);
  try {
    r = pool_->shrink_in_place(p, bytes, key_of(s));
  } catch (const std::exception& e) {
    fail("shrink_in_place(%#llx, %llu) of a live block threw %s", ull(p), ull(bytes), e.what());
  }
  current_ = {};
  const auto got = pool_->find_live(p);
  if (!got || got->first != p) fail("shrink_in_place(%#llx): the block is no longer live", ull(p));
  TRACE("  -> %llu", ull(r));
  if (r != want || got->second != r)
    fail("shrink_in_place(%#llx, %llu) of a %llu-byte block returned %llu (the block is %llu bytes); expected %llu",
         ull(p), ull(bytes), ull(old), ull(r), ull(got->second), ull(want));
  if (r < old) {
    l->size = r;
    history_.push_back({p + r, old - r, s, enqueue(s)});  // the rest is freed on s
  }
}

/// Hands a block to another stream, ordered after its users (stream_buffer::set_stream).
inline void harness::move_block() {
  if (live_.empty()) return;
  live_block& l = std::next(live_.begin(), static_cast<std::ptrdiff_t>(in_.byte() % live_.size()))->second;
  const std::size_t t = pick_stream(in_.byte(), l.owner);
  if (t == none) return;
  TRACE("block %#llx moves from stream %zu to stream %zu", ull(l.addr), l.owner, t);
  order_after(t, l.owner);
  l.owner = t;
  enqueue(t);
}

}  // namespace pool_core_fuzz
