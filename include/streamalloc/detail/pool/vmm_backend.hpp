#pragma once

// The pool core's backend on the real driver: physical memory through the VMM layer, device
// events through the driver, pooled per context (an event belongs to the context it was made
// in, and a stream's events must be made in the stream's context: a peer device's stream gets
// events of its own context).
//
// Access: every mapping the core makes (chunks from growth, chunks remapped by defragmentation,
// the tail grow_in_place maps, graphs' pieces and shared pages) goes through map(), which
// applies the pool's access list; set_access() changes that list and applies the change to
// everything mapped, so a grant covers the memory mapped before it and after it.
//
// Graphs' peers: a graph's own memory (its pieces, pool_graph_memory.hpp) may give devices
// read-write access beyond the pool's list, for the graph's life: the peers its hand-built
// allocations asked for, and those the pool had when an allocation was captured (spec: an
// allocation node keeps the pool's access of capture time, whatever the pool is set to
// later). grant_peers() records them for the range; map() and set_access() never give those
// devices less there while the record lasts.

#include <streamalloc/access.hpp>
#include <streamalloc/address_reservation.hpp>
#include <streamalloc/detail/driver/capture.hpp>
#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/error.hpp>
#include <streamalloc/detail/core/pool_core.hpp>
#include <streamalloc/mapping.hpp>
#include <streamalloc/physical_allocation.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace streamalloc::detail {

class vmm_backend {
 public:
  using handle = physical_allocation;
  struct event {
    CUevent ev = nullptr;
    CUcontext ctx = nullptr;
  };

  /// Around the core's slow paths: its event queries and mappings run in relaxed capture
  /// mode (see deferred_relaxed_capture_mode), so another thread's global-mode capture neither
  /// refuses them nor is invalidated by them. Deferred: the core calls the driver only through
  /// this backend, whose every call relaxes the thread first, so a slow path that makes none
  /// (most do not) costs no switch.
  struct capture_guard : deferred_relaxed_capture_mode {
    explicit capture_guard(vmm_backend&) noexcept {}
  };

  vmm_backend(memory_location where, allocation_options options, std::vector<access_descriptor> access)
      : where_(where), options_(options), access_(std::move(access)) {}
  vmm_backend(vmm_backend&&) noexcept = default;
  vmm_backend& operator=(vmm_backend&&) noexcept = default;

  ~vmm_backend() {
    maps_.clear();
    for (auto& [ctx, list] : spare_events_) {
      for (CUevent e : list) (void)cu::cuEventDestroy_nothrow(e);
    }
  }

  std::uint64_t granularity() { return allocation_granularity(where_, granularity_kind::minimum, options_); }

  std::uint64_t reserve(std::uint64_t bytes) {
    va_.emplace_back(bytes, granularity());
    return va_.back().address();
  }

  /// As reserve, but 0 when the process's addresses are exhausted, or, with `at` not 0, when
  /// the driver places the range elsewhere (it is given back at once).
  std::uint64_t try_reserve(std::uint64_t bytes, std::uint64_t at) {
    try {
      address_reservation r(bytes, granularity(), at);
      if (at != 0 && r.address() != at) return 0;  // freed by r's destructor
      va_.push_back(std::move(r));
      return va_.back().address();
    } catch (const cuda_error& e) {
      // The driver's words for "no such addresses left" (an absurd size says INVALID_VALUE).
      if (e.code() == CUDA_ERROR_OUT_OF_MEMORY || e.code() == CUDA_ERROR_INVALID_VALUE) return 0;
      throw;
    }
  }

  CUresult create(std::uint64_t bytes, handle& out) {
    try {
      out = physical_allocation(bytes, where_, options_);
      return CUDA_SUCCESS;
    } catch (const cuda_error& e) {
      if (e.code() == CUDA_ERROR_OUT_OF_MEMORY) return e.code();
      throw;  // not a shortage: a real error, reported as such
    }
  }

  void map(std::uint64_t va, std::uint64_t bytes, handle& h) {
    std::lock_guard lock(*access_mutex_);
    mapping m(va, h, 0, bytes);  // unmapped again by its destructor if the access fails
    apply(va, bytes, access_);
    if (const std::uint64_t peers = peers_at(va); peers != 0) apply_peers(va, bytes, peers);
    maps_.emplace(va, std::move(m));
  }
  /// The driver refused a mapping for lack of memory (cuMemMap or cuMemSetAccess returned
  /// CUDA_ERROR_OUT_OF_MEMORY); any other failure is an error the caller must hear.
  static bool refused(const std::exception& e) noexcept {
    const auto* c = dynamic_cast<const cuda_error*>(&e);
    return c != nullptr && c->code() == CUDA_ERROR_OUT_OF_MEMORY;
  }
  void unmap(std::uint64_t va, std::uint64_t) noexcept {
    std::lock_guard lock(*access_mutex_);
    maps_.erase(va);
  }
  void release(handle& h) noexcept { h = physical_allocation(); }

  /**
   * Gives the devices of `peers` (bit d: device d) read-write access to [va, va + bytes), a
   * graph's piece, until forget_peers: over what is mapped there now and over whatever is
   * mapped there later. Throws cuda_error when the driver refuses; the devices granted are
   * recorded only once every mapping has them, and those given access before the failure keep
   * it (more access than asked, which the graph's memory may have: spec 003).
   */
  void grant_peers(std::uint64_t va, std::uint64_t bytes, std::uint64_t peers) {
    std::lock_guard lock(*access_mutex_);
    const auto [at, made] = peers_.try_emplace(va, va + bytes, 0);
    const std::uint64_t add = peers & ~at->second.second;
    try {
      for (auto it = maps_.lower_bound(va); it != maps_.end() && it->first < va + bytes; ++it) {
        apply_peers(it->first, it->second.size(), add);
      }
    } catch (...) {
      if (made) peers_.erase(at);
      throw;
    }
    at->second.second |= add;
  }
  /// The range of grant_peers leaves the graph: mappings made there later get the pool's list
  /// only, and set_access may lower those devices there. What is mapped now keeps its access
  /// until then (an allocation the graph left live may still be used by those devices).
  void forget_peers(std::uint64_t va) noexcept {
    std::lock_guard lock(*access_mutex_);
    peers_.erase(va);
  }

  /**
   * Sets the access of each location in `who` (`none` revokes it) over everything mapped now,
   * and over all mapped later. All or nothing: when the driver refuses one mapping, those
   * changed already get their previous access back and the list is as it was.
   *
   * Takes a lock of its own rather than the pool's: the core calls map and unmap under the
   * pool lock, and then this lock, so a grant never waits for the pool lock (a thread that
   * allocates meanwhile is not held up by it either, unless it maps), and a mapping made
   * while it runs gets either the old list, changed afterwards here, or the new one.
   */
  void set_access(std::span<const access_descriptor> who) {
    std::lock_guard lock(*access_mutex_);
    const std::vector<access_descriptor> before = access_;
    // Each changed location with its access before, and room for either list with a graph's
    // peers raised, made up front: the rollback cannot fail for want of memory.
    std::vector<access_descriptor> undo;
    undo.reserve(who.size());
    for (const access_descriptor& d : who) undo.push_back(access_descriptor{d.location, flags_in(before, d.location)});
    std::vector<access_descriptor> raised;
    raised.reserve(who.size());
    std::vector<CUmemAccessDesc> native;
    native.reserve(who.size());
    for (const access_descriptor& d : who) set_flags(access_, d);
    auto done = maps_.begin();
    try {
      for (; done != maps_.end(); ++done) {
        apply(done->first, done->second.size(), with_peers(who, peers_at(done->first), raised));
      }
    } catch (...) {
      for (auto it = maps_.begin(); it != done; ++it) {
        native.clear();
        for (const access_descriptor& d : with_peers(undo, peers_at(it->first), raised)) native.push_back(d.native());
        (void)cu::cuMemSetAccess_nothrow(it->first, it->second.size(), native.data(), native.size());
      }
      access_ = before;
      throw;
    }
    // Locations whose access is none need no descriptor on new mappings.
    std::erase_if(access_, [](const access_descriptor& d) { return d.flags == access_flags::none; });
  }

  event record(const stream_key& k) {
    auto s = static_cast<CUstream>(k.native);
    const stream_context on_stream_device(k);
    event e;
    // The context the stream's record keeps: CUDA refuses a capturing stream's, and a capture
    // may begin (on another thread) since the pool found the stream not capturing.
    e.ctx = k.record != nullptr ? static_cast<CUcontext>(k.record->context()) : nullptr;
    if (e.ctx == nullptr) check(cu::cuStreamGetCtx_nothrow(s, &e.ctx), "cuStreamGetCtx");
    auto& spare = spare_events_[e.ctx];
    if (!spare.empty()) {
      e.ev = spare.back();
      spare.pop_back();
    } else {
      CUresult r = CUDA_SUCCESS;
      {
        // The event must belong to the stream's context, whatever the calling thread has current.
        scoped_context in_stream_context(e.ctx);
        r = cu::cuEventCreate_nothrow(&e.ev, CU_EVENT_DISABLE_TIMING);
      }
      check(r, "cuEventCreate");
    }
    const CUresult r = cu::cuEventRecord_nothrow(e.ev, s);
    if (r != CUDA_SUCCESS) {
      try {
        spare.push_back(e.ev);
      } catch (...) {  // out of host memory too: the event goes, and the driver's error is told
        (void)cu::cuEventDestroy_nothrow(e.ev);
      }
      throw_driver_failure(r, "cuEventRecord", "recording a pool event");
    }
    return e;
  }
  bool done(event& e) { return cu::cuEventQuery_nothrow(e.ev) == CUDA_SUCCESS; }
  bool capturing(const stream_key& k) noexcept {
    const stream_context on_stream_device(k);
    return may_be_capturing(static_cast<CUstream>(k.native));  // unknown: leave it alone
  }
  /// After `record(k)`: is `k` capturing now, so that the record may have gone into the
  /// capture (a dependency of the capture's later work, no point of the stream's)? Then the
  /// event is destroyed, not kept for reuse: a captured record makes no node of the graph, so
  /// nothing refers to the event, but the spare list is for events whose records ran.
  bool lost_to_capture(const stream_key& k, event& e) noexcept {
    if (!capturing(k)) [[likely]] return false;
    (void)cu::cuEventDestroy_nothrow(e.ev);
    e.ev = nullptr;
    return true;
  }
  bool idle(const stream_key& k) {
    const stream_context on_stream_device(k);
    return cu::cuStreamQuery_nothrow(static_cast<CUstream>(k.native)) == CUDA_SUCCESS;
  }
  void wait(const stream_key& k, event& e) {
    const stream_context on_stream_device(k);
    check(cu::cuStreamWaitEvent_nothrow(static_cast<CUstream>(k.native), e.ev, 0), "cuStreamWaitEvent");
  }
  void synchronize(event& e) noexcept { (void)cu::cuEventSynchronize_nothrow(e.ev); }
  void destroy(event& e) noexcept {
    try {
      spare_events_[e.ctx].push_back(e.ev);
    } catch (...) {
      (void)cu::cuEventDestroy_nothrow(e.ev);
    }
  }

 private:
  /**
   * The legacy default stream's handle names a different stream in each context: the legacy
   * stream of whichever context is current on the calling thread. A pool reaches a stream
   * whose handle stays valid (the legacy one included) from whatever thread settles its frees,
   * and that thread may have another device current (any thread may use a pool of any device;
   * with peer access, streams of several devices use one pool): querying or recording on the
   * handle there would reach the wrong device's legacy stream, and take its idleness for this
   * one's, so memory would be reused under work still running. While this guard lives, the
   * primary context of the stream's device is current when the handle is the legacy one and
   * the record was made there, or the current context is another device's. Any other handle
   * names one stream everywhere.
   * Never throws: without the context it leaves things as they are.
   */
  class stream_context {
   public:
    explicit stream_context(const stream_key& k) noexcept {
      const auto s = static_cast<CUstream>(k.native);
      if ((s != nullptr && s != CU_STREAM_LEGACY) || k.record == nullptr) return;
      const int device = k.record->device();
      if (device < 0) return;
      CUcontext current = nullptr;
      if (cu::cuCtxGetCurrent_nothrow(&current) != CUDA_SUCCESS) return;
      CUcontext own = nullptr;
      try {
        own = primary_context(device);
      } catch (...) {
        return;
      }
      if (current == own) return;
      // A record made in its device's primary context is that context's legacy stream's, even
      // while the caller has a context of its own of that device current. (A context the
      // program made is not pushed: the pools may settle a record's frees after the program
      // destroyed it.)
      if (k.record->context() == own) {
        pushed_ = cu::cuCtxPushCurrent_nothrow(own) == CUDA_SUCCESS;
        return;
      }
      CUdevice d{};
      // A context of the stream's device that the caller made current: its legacy stream is
      // the one the record was made for (the handle was resolved there).
      if (current != nullptr && cu::cuCtxGetDevice_nothrow(&d) == CUDA_SUCCESS && static_cast<int>(d) == device) return;
      pushed_ = cu::cuCtxPushCurrent_nothrow(own) == CUDA_SUCCESS;
    }
    ~stream_context() {
      CUcontext popped = nullptr;
      if (pushed_) (void)cu::cuCtxPopCurrent_nothrow(&popped);
    }
    stream_context(const stream_context&) = delete;
    stream_context& operator=(const stream_context&) = delete;

   private:
    bool pushed_ = false;
  };

  static access_flags flags_in(const std::vector<access_descriptor>& list, memory_location where) noexcept {
    for (const access_descriptor& d : list) {
      if (d.location == where) return d.flags;
    }
    return access_flags::none;
  }
  static void set_flags(std::vector<access_descriptor>& list, access_descriptor d) {
    for (access_descriptor& a : list) {
      if (a.location == d.location) {
        a.flags = d.flags;
        return;
      }
    }
    list.push_back(d);
  }
  /// The graph peers recorded for the range holding `va` (0 when none).
  std::uint64_t peers_at(std::uint64_t va) const noexcept {
    auto it = peers_.upper_bound(va);
    if (it == peers_.begin()) return 0;
    --it;
    return va < it->second.first ? it->second.second : 0;
  }
  /// `list`, or, when `peers` lowers none of its devices, `list` itself; otherwise `list` with
  /// the devices of `peers` at read-write, in `room` (reserved for it: nothing allocates).
  static std::span<const access_descriptor> with_peers(std::span<const access_descriptor> list, std::uint64_t peers,
                                                       std::vector<access_descriptor>& room) noexcept {
    auto peer = [&](const access_descriptor& d) {
      return d.location.is_device() && d.location.id() < max_devices && (peers >> d.location.id() & 1) != 0;
    };
    if (std::none_of(list.begin(), list.end(), [&](const access_descriptor& d) {
          return peer(d) && d.flags != access_flags::read_write;
        })) {
      return list;
    }
    room.clear();
    for (const access_descriptor& d : list) room.push_back({d.location, peer(d) ? access_flags::read_write : d.flags});
    return room;
  }
  /// Read-write for the devices of `peers` over one mapped range (throws as apply).
  static void apply_peers(std::uint64_t va, std::uint64_t bytes, std::uint64_t peers) {
    std::array<CUmemAccessDesc, max_devices> list{};
    std::size_t n = 0;
    for (int d = 0; d < max_devices; ++d) {
      if ((peers >> d & 1) != 0) list[n++] = access_descriptor{memory_location::device(d), access_flags::read_write}.native();
    }
    if (n == 0) return;
    check(cu::cuMemSetAccess_nothrow(va, bytes, list.data(), n), "cuMemSetAccess", [&] {
      return "giving a graph's peer devices read-write access to " + std::to_string(bytes) + " bytes at " + hex(va);
    });
  }
  /// Sets `who`'s access over one mapped range; throws cuda_error naming the range and the locations.
  static void apply(std::uint64_t va, std::uint64_t bytes, std::span<const access_descriptor> who) {
    if (who.empty()) return;
    ::streamalloc::set_access(va, bytes, who);
  }

  memory_location where_;
  allocation_options options_;
  // Behind a pointer: a mutex cannot move, and the backend moves into the core.
  std::unique_ptr<std::mutex> access_mutex_ = std::make_unique<std::mutex>();
  std::vector<access_descriptor> access_;
  std::vector<address_reservation> va_;  // freed after maps_ (declared before it)
  std::map<std::uint64_t, mapping> maps_;
  /// Graphs' pieces whose peers have access beyond access_: start -> (end, devices).
  std::map<std::uint64_t, std::pair<std::uint64_t, std::uint64_t>> peers_;
  std::unordered_map<CUcontext, std::vector<CUevent>> spare_events_;
};

}  // namespace streamalloc::detail
