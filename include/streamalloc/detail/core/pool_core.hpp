#pragma once

// The pool's allocator, free of CUDA: it runs against a Backend that provides physical memory
// and device events, so the whole algorithm is exercised on the CPU by tests with a simulated
// backend (tests/cpu/detail/pool_core_*test.cpp), and on the GPU through the VMM backend (pool.hpp).
//
// Where free blocks live:
//   a stream's fast cache   blocks freed on that stream, reusable by it at once; whole blocks
//                           only, no coalescing, guarded by the stream's own lock: the
//                           allocation fast path takes no pool-wide lock and calls no driver
//   a stream's pending bins blocks freed on that stream and coalesced: reusable by that stream,
//                           by others once ordered after the free or once it completed
//   the clear bins          blocks every stream may reuse
// Structural changes (split, merge, growth, remapping, release) happen under the pool lock.
//
// The parts, each in a header of its own:
//   block_chain.hpp    blocks in address order, with an index by start address
//   free_bins.hpp      free blocks by size (the cache, pending and clear bins above)
//   live_table.hpp     live blocks by address: what a free looks up
//   stream_table.hpp   the per-stream states and the live accounting
//   completion.hpp     how frees are learned complete (and the rules for stream handles)
//   chunk_space.hpp    address reservations and the physical chunks mapped into them
//   graph_segments.hpp what graphs made by stream capture hold (policy in pool_graphs.hpp)
//   pool_backend.hpp   what the core needs from below: physical memory, addresses, events
//   pool_core_types.hpp what the core takes and gives (options, snapshot, out-of-memory)
// The policy is split by section, each defining members of this class:
//   pool_requests.hpp      allocate and deallocate: the fast path through a stream's cache,
//                          and the entry of the slow path
//   pool_free_blocks.hpp   cache, pending and clear bins: how a freed block gets back
//   pool_sources.hpp       where a request is served from
//   pool_completions.hpp   what the pool learns of completed work: retire, synchronize, trim
//   pool_growth.hpp        growth, growth in place, release
//   pool_remap.hpp         defragmentation: moving whole free chunks, aliases of a stream's
//                          own frees
//   pool_graphs.hpp        stream capture
//   pool_graph_memory.hpp  graphs' own memory, and pages shared by graphs of one stream
//   pool_exports.hpp       allocations other processes import
//   pool_snapshot.hpp, pool_queries.hpp  what the pool holds, and its words for refusals
// This file is the class: its state, and each section's members declared, with what they do.

#include <streamalloc/detail/core/address_index.hpp>
#include <streamalloc/detail/core/address_ranges.hpp>
#include <streamalloc/detail/core/block.hpp>
#include <streamalloc/detail/core/block_chain.hpp>
#include <streamalloc/detail/core/chunk_space.hpp>
#include <streamalloc/detail/core/completion.hpp>
#include <streamalloc/detail/core/free_bins.hpp>
#include <streamalloc/detail/core/graph_segments.hpp>
#include <streamalloc/detail/core/pool_history.hpp>
#include <streamalloc/detail/core/live_table.hpp>
#include <streamalloc/detail/core/ordering.hpp>
#include <streamalloc/detail/core/pool_backend.hpp>
#include <streamalloc/detail/core/pool_core_types.hpp>
#include <streamalloc/detail/core/stream_table.hpp>
#include <streamalloc/placement.hpp>
#include <streamalloc/pool_statistics.hpp>
#include <streamalloc/reuse_policy.hpp>

#include <cuda.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace streamalloc::detail {

template <pool_backend Backend>
class pool_core final : public completion_listener {
 public:
  using handle = typename Backend::handle;
  using event = typename Backend::event;

  pool_core(Backend backend, core_options o)
      : backend_(std::move(backend)),
        options_(normalized(o, backend_.granularity())),
        space_(backend_, options_.chunk_size, options_.address_space, options_.on_reserve) {
    ordering().add_listener(this);
  }

  pool_core(const pool_core&) = delete;
  pool_core& operator=(const pool_core&) = delete;

  ~pool_core() { ordering().remove_listener(this); }

  /// Tears the pool down: waits for the frees still pending on the device, then releases all
  /// physical memory. Returns the live allocations that were never freed (count, bytes).
  std::pair<std::uint64_t, std::uint64_t> shutdown() noexcept {
    const capture_guard relaxed(backend_);
    std::lock_guard lock(mutex_);
    std::uint64_t count = 0, bytes = 0;
    live_.for_each([&](block* b) {
      ++count;
      bytes += b->size;
    });
    for (const block* b = unindexed_; b != nullptr; b = b->next_free) {
      ++count;
      bytes += b->size;
    }
    streams_.for_each([&](state& st) { completion_.drop_events(st, /*wait=*/true); });
    release_all_pages();
    space_.release_all();
    return {count, bytes};
  }

  [[nodiscard]] std::uint64_t granularity() const noexcept { return space_.granularity(); }
  [[nodiscard]] const core_options& options() const noexcept { return options_; }
  /// The first reservation's base.
  [[nodiscard]] std::uint64_t base() const noexcept { return space_.base(); }
  /// The most addresses the pool reserves.
  [[nodiscard]] std::uint64_t address_space() const noexcept { return space_.limit(); }
  /// Addresses reserved so far, and the reservations (base, size).
  [[nodiscard]] std::uint64_t addresses_reserved() {
    std::lock_guard lock(mutex_);
    return space_.reserved_addresses();
  }
  [[nodiscard]] std::vector<std::pair<std::uint64_t, std::uint64_t>> reservations() const {
    return space_.reservations();
  }
  /// The size of the last reservation the driver refused (the process's addresses ran out); 0:
  /// none was.
  [[nodiscard]] std::uint64_t refused_reservation() {
    std::lock_guard lock(mutex_);
    return space_.refused_reservation();
  }
  [[nodiscard]] bool owns(std::uint64_t p) const noexcept { return space_.owns(p); }
  /// Bytes of addresses left unused because the host had no memory to give them back.
  [[nodiscard]] std::uint64_t addresses_dropped() {
    std::lock_guard lock(mutex_);
    return space_.free_addresses().dropped();
  }
  /// For tests: bytes of free addresses, in all reservations.
  [[nodiscard]] std::uint64_t addresses_free() {
    std::lock_guard lock(mutex_);
    std::uint64_t bytes = 0;
    for (const auto& [at, size] : space_.free_addresses().ranges()) bytes += size;
    return bytes;
  }
  /// For tests: no free address overlaps another or a mapped chunk (chunk_space).
  [[nodiscard]] bool addresses_consistent() {
    std::lock_guard lock(mutex_);
    return space_.addresses_consistent();
  }
  Backend& backend() noexcept { return backend_; }

  /// What the pool holds now (pool_snapshot.hpp).
  core_snapshot snapshot();
  /// The pool's recent events, when kept (pool_history.hpp): the front notes allocations and
  /// frees, the core its growths, releases and remaps.
  pool_history& history() noexcept { return history_; }

  void set_release_threshold(std::uint64_t t) {
    std::lock_guard lock(mutex_);
    options_.release_threshold = t;
  }
  void set_reuse(reuse_policy r) {
    std::lock_guard lock(mutex_);
    options_.reuse = r;
  }

  // --- allocation --------------------------------------------------------------------------

  /// Rounds `bytes` to the pool's quantum (256) and returns a block's address, ordered on `s`.
  /// Throws core_out_of_memory when nothing can be found.
  /// `where`: the addresses of a request that gets a chunk of its own (see `placement`).
  std::uint64_t allocate(std::uint64_t bytes, stream_key s, placement where = placement::packed);

  /// Ends the lifetime of the block at `p` in the order of stream `s`.
  /// Throws std::invalid_argument, changing nothing, for a pointer that is not a live block.
  void deallocate(std::uint64_t p, stream_key s);

  /// Makes the live allocation at `p` at least `bytes` long without moving it, in the order
  /// of stream `s`: takes the free memory right after it that `s` may use, and maps new
  /// physical memory past the end of its mapped run when the addresses there are unused.
  /// Returns the new size, or 0 (changing nothing) when something is in the way.
  /// Throws std::invalid_argument for a pointer that is not a live block.
  std::uint64_t grow_in_place(std::uint64_t p, std::uint64_t bytes, stream_key s);  // pool_growth.hpp

  /// Makes the live allocation at `p` `bytes` long (rounded up to 256, at least 256) without
  /// moving it: the rest is freed in the order of stream `s` (reusable by `s` at once, by
  /// others once ordered after). Returns the new size.
  /// Throws std::invalid_argument for a pointer that is not a live block.
  std::uint64_t shrink_in_place(std::uint64_t p, std::uint64_t bytes, stream_key s);  // pool_growth.hpp

  // --- graphs (defined in pool_graphs.hpp; what they hold: graph_segments.hpp) ----------------

  /// Allocates `bytes` for the graph of capture `capture`, the call captured on the stream
  /// named `s` (a token the caller gives each captured stream: CUDA does not identify streams
  /// during their capture):
  /// a block freed earlier in that capture on `s`, or memory of the graph's own
  /// (pool_graph_memory.hpp), never memory whose frees are pending. `tie()` is called under the
  /// pool lock when the capture has no segment yet, to tie the new one's life to the graph; if
  /// it throws, nothing changes. `peers` (bit d: device d) get read-write access to the
  /// graph's memory for the graph's life, whatever the pool's own access is later (the
  /// backend's grant_peers; 0 for none).
  template <class Tie>
  std::uint64_t allocate_captured(std::uint64_t bytes, std::uint64_t capture, std::uint64_t s, std::uint64_t peers,
                                  Tie&& tie) {
    return allocate_for_graph(bytes, capture, peers, [s](std::uint64_t token) { return token == s; },
                              std::forward<Tie>(tie));
  }
  /// As allocate_captured, for the graph with id `capture` (a capture's, or one streamalloc
  /// gave a graph built by hand), reusing a block the graph freed where `after(token)` says
  /// the allocation is ordered after the free with that token.
  template <class After, class Tie>
  std::uint64_t allocate_for_graph(std::uint64_t bytes, std::uint64_t capture, std::uint64_t peers, After&& after,
                                   Tie&& tie);
  /// Frees `p` inside capture `capture`, the free captured on stream `s`: a block of that
  /// capture becomes reusable by it on `s`; a live block allocated outside becomes the graph's
  /// (freed by it: the pool takes it back when the graph is gone, in the order of the
  /// capturing stream `freer` when its record is known, else after a device-wide
  /// synchronization). Throws std::invalid_argument, changing nothing, for anything else.
  template <class Tie>
  void deallocate_captured(std::uint64_t p, std::uint64_t capture, std::uint64_t s, stream_key host,
                           const stream_key* freer, Tie&& tie);
  /// The graph of `capture` is gone and the device has finished its launches: its blocks
  /// come back. Those freed after a launch are freed in the order of that free's stream;
  /// those never freed become ordinary live allocations (as the driver's do). Does nothing
  /// for a capture without a segment.
  void release_graph(std::uint64_t capture, stream_key host) noexcept;
  /// Why an executable of the graph of `capture` may not be launched now (empty when it may):
  /// allocations of the last launch not freed since, when the executable does not free them
  /// itself (`auto_free`). Asked by `graph_exec` of every pool before any is told of the launch.
  std::string graph_launch_refusal(std::uint64_t capture, bool auto_free);
  /// An executable of the graph of `capture` is being launched: its allocations freed after
  /// the last launch are made again (those frees are void).
  void graph_launched(std::uint64_t capture) noexcept;
  /// Before a launch or upload into stream `stream` (any non-zero id, never reused for another
  /// stream) of the graph of `capture`, when one graph_exec is all that holds it: maps its own
  /// memory onto the pages shared by the graphs launched into that stream, if it frees all it
  /// allocates (pool_graph_memory.hpp). `wait_previous()` waits for the graph's last launch
  /// (false: it could not, and nothing moves); called without the lock, only when memory must
  /// move. Stream 0: the stream is not known, and nothing moves. Memory that cannot move stays
  /// where it is, which is correct. Returns false only when the graph's memory is lost (the
  /// device refused to map it either at the stream's pages or back where it was): then nothing
  /// is mapped under its allocations, and it must not run until a later bind succeeds.
  template <class Wait>
  bool bind_graph_memory(std::uint64_t capture, std::uint64_t stream, Wait&& wait_previous) noexcept;
  /// The size of the block at `p` the graph of `capture` allocated (by capture or by hand),
  /// whether it is live after launches or freed, in the graph or after a launch; 0 when `p` is
  /// not the start of one (memory the graph adopted is the host's allocation, not the graph's).
  [[nodiscard]] std::uint64_t graph_block_size(std::uint64_t capture, std::uint64_t p);
  /// The allocations the graph of `capture` leaves live after each launch, (address, size)
  /// by address: never freed in the graph, whether or not freed since its last launch.
  [[nodiscard]] std::vector<std::pair<std::uint64_t, std::uint64_t>> graph_unfreed(std::uint64_t capture);
  /// Segments alive (graphs holding memory of the pool).
  [[nodiscard]] std::size_t graphs_alive() {
    std::lock_guard lock(mutex_);
    return graphs_.segments();
  }

  // --- exports to other processes (defined in pool_exports.hpp) ------------------------------

  struct exported_block {
    std::uint64_t serial, size;
  };
  /// The live allocation at `p` made exportable: the serial its descriptors carry, and its
  /// size. Throws std::invalid_argument for a pointer that is not a live allocation's start.
  exported_block export_block(std::uint64_t p);
  /// Another process imports `bytes` of the block at `p` exported with `serial`: the block,
  /// held (neither reused, released nor remapped) until release_import. Throws
  /// std::invalid_argument saying why for a stale or forged descriptor.
  block* import_block(std::uint64_t p, std::uint64_t serial, std::uint64_t bytes);
  /// One import of `b` is over; if this process freed it meanwhile, it goes back now.
  void release_import(block* b) noexcept;
  /// Calls `f(chunk address, chunk, offset in it, length)` for each chunk under the first
  /// `bytes` of held block `b`, in address order.
  template <class F>
  void for_each_piece(const block* b, std::uint64_t bytes, F&& f);
  /// Bytes this process freed that importers still hold.
  [[nodiscard]] std::uint64_t imported_held() {
    std::lock_guard lock(mutex_);
    return imported_held_;
  }

  // --- queries -----------------------------------------------------------------------------

  /// What the pool holds, now and at its high-water marks (pool_queries.hpp).
  pool_statistics statistics();

  /// The graphs' high-water mark becomes what they hold now.
  void reset_graph_high() {
    std::lock_guard lock(mutex_);
    graphs_.reset_high();
  }

  void reset_high_water() {
    std::lock_guard lock(mutex_);
    space_.reset_high();
    streams_.reset_high_water();
    graphs_.reset_high();
  }

  /// What the pool holds per stream: states of streams in use (retired ones whose frees are
  /// still pending included), and states made in all (each in use or kept for reuse).
  struct stream_state_counts {
    std::size_t in_use = 0, made = 0;
  };
  stream_state_counts stream_states() {
    std::lock_guard lock(mutex_);
    return {streams_.in_use(), streams_.made()};
  }

  /// Bytes a raw or per-thread stream may free before the pool records an event on it now
  /// (stream_table::cover_limit).
  [[nodiscard]] std::uint64_t cover_limit() const noexcept { return streams_.cover_limit(); }

  /// The live block starting at or containing `p`, if any: (start, size).
  std::optional<std::pair<std::uint64_t, std::uint64_t>> find_live(std::uint64_t p) {
    if (block* b = live_.find(p)) return std::pair{b->addr, b->size};
    std::lock_guard lock(mutex_);
    block* b = chain_.at_or_before(p);
    if (b == nullptr) return std::nullopt;
    const block_state bs = state_of(b);
    if (p < b->addr + b->size && (bs == block_state::live || bs == block_state::graph)) return std::pair{b->addr, b->size};
    return std::nullopt;
  }

  // --- what the pool learns of completed work (defined in pool_completions.hpp) -------------

  /// True while a free may still be running on the device: a cached or pending block whose free
  /// is not known to have executed. Closing a pool waits for the device while this is true.
  bool frees_in_flight();
  /// Releases free physical memory until at most `keep` bytes of it remain (whole chunks only,
  /// and only memory whose frees are known to have completed).
  void trim_to(std::uint64_t keep);
  /// The stream is going away, or is found gone (`handle_valid` false): see the definition.
  void on_retire(std::uint64_t stream, bool handle_valid) noexcept override;
  /// Called by the ordering registry after a host synchronization (or device-wide one).
  void on_synchronize(std::uint64_t stream) noexcept override;

 private:
  static constexpr std::size_t max_cached_blocks = 4096;
  /// A room_to_grow allocation is placed in the middle of free addresses this many times its
  /// size, reserved for it if need be: half of them are its room to grow in place.
  static constexpr std::uint64_t room_spread = 16;
  /// How long a request that would grow polls the events its look recorded on other streams
  /// that it could not ask whether they were idle (poll_fresh_covers): no longer than the one
  /// handle's growth it may spare costs (some 50 us: create, map, access). An idle stream's
  /// event completes well within it (bench_vmm_costs); a busy stream's costs it once per
  /// batch of frees, since a look records no new event on a stream whose frees one covers.
  static constexpr std::chrono::microseconds fresh_cover_poll{50};

  using state = typename stream_table<event>::state;
  /// While alive, this thread's driver calls are not refused for another thread's capture.
  using capture_guard = typename Backend::capture_guard;
  using chunk = typename chunk_space<Backend>::chunk;

  static std::uint64_t round_up(std::uint64_t v, std::uint64_t to) { return (v + to - 1) / to * to; }
  /// The options with sizes filled in and rounded to the backend's granularity.
  static core_options normalized(core_options o, std::uint64_t granularity) {
    if (o.chunk_size == 0) o.chunk_size = 64ull << 20;
    o.chunk_size = round_up(o.chunk_size, granularity);
    if (o.max_size != 0) o.max_size = round_up(o.max_size, granularity);
    return o;
  }
  static block_state state_of(block* b) noexcept {
    return std::atomic_ref<block_state>(b->state).load(std::memory_order_acquire);
  }
  static void set_state(block* b, block_state s) noexcept {
    std::atomic_ref<block_state>(b->state).store(s, std::memory_order_release);
  }
  /// The history's event for `b`'s allocation, and its time on the block (0 with the history
  /// off now). Before the block is live, so that no free of it can come first.
  [[gnu::cold, gnu::noinline]] void note_allocation(block* b, state& st) noexcept {
    const std::uint64_t t = history_.on() ? history_.note(history_op::allocate, st.record->id(), b->addr, b->size) : 0;
    set_since(b, t);
  }
  // A live block's allocation time, read by snapshots under the pool lock while the fast path,
  // which does not take it, allocates the block again.
  static void set_since(block* b, std::uint64_t t) noexcept {
    std::atomic_ref<std::uint64_t>(b->since).store(t, std::memory_order_relaxed);
  }
  static std::uint64_t since_of(block* b) noexcept {
    return std::atomic_ref<std::uint64_t>(b->since).load(std::memory_order_relaxed);
  }

  std::uint64_t cache_limit() const noexcept {
    return std::max<std::uint64_t>(256ull << 20, space_.held_seen() / 4);
  }

  /// Settles retired streams' states and hands those with nothing left back to the table.
  void recycle_retired();

  // --- the slow path -------------------------------------------------------------------------

  /// A request the stream's cache could not serve, under the pool lock (pool_requests.hpp).
  std::uint64_t allocate_slow(std::uint64_t n, state& st, stream_key s, placement where);

  // --- where a request is served from (defined in pool_sources.hpp) --------------------------

  /// A free block of at least `n` bytes that `st` may use, still in its bins, from the first
  /// source that has one. Throws core_out_of_memory when none has.
  /// `may_wait`: waiting on another stream's frees (internal dependencies) is a source.
  block* find_memory(std::uint64_t n, state& st, stream_key s, placement where, bool may_wait);
  /// Best fit among the blocks `st` may use: clear ones, its own, and others' it is ordered after.
  block* find_usable(std::uint64_t n, state& st);
  /// The smallest run of adjacent free blocks in different bins that `st` may use and that
  /// holds `n` bytes, merged into `st`'s pending bins; null when there is none.
  block* join_adjacent(std::uint64_t n, state& st);
  /// Polls, briefly, the events the current look recorded on other streams instead of asking
  /// whether they were idle, settling those that complete, until `enough()` (pool_sources.hpp).
  template <class Enough>
  void poll_fresh_covers(const state* skip, Enough&& enough);

  /// Takes `n` bytes from the front of free block `b` (split if larger), removing it from its
  /// bins. The remainder stays where `b` was, with its tag.
  void take(block* b, std::uint64_t n);

  /// Cuts `b` after its first `n` bytes; returns the rest as a block of its own, in no bins.
  block* split(block* b, std::uint64_t n) { return chain_.split(b, n); }

  /// The live block starting at `p`; throws std::invalid_argument saying what `p` is instead.
  block* live_block(std::uint64_t p, const char* what) {
    block* b = live_.find(p);
    if (b == nullptr) [[unlikely]] {
      throw std::invalid_argument(explain_bad_free(p, what));
    }
    return b;
  }

  /// Whether a free moving into its stream's pending bins may absorb clear neighbours: only in
  /// a call of that stream (its free, its request), never on another's behalf (see free_pending).
  enum class clear_neighbours { absorb, leave };

  /// Moves a stream's fast cache into its pending bins, coalescing.
  void flush_cache(state& st, clear_neighbours clear);

  /// Puts a freed block into its stream's pending bins, merging it with free neighbours that
  /// are pending on the same stream or clear (a clear neighbour is absorbed, unless `clear`
  /// says leave: usable by this stream at once, by others once this free is known complete;
  /// not where nothing may prove that, and not a pending one an event already covers: see the
  /// definition). `for_use`: the run is about to be allocated by the stream.
  /// Returns the merged block.
  block* free_pending(block* b, state& st, bool for_use = false, clear_neighbours clear = clear_neighbours::absorb);

  /// Merges `b` (in no bins) with its free address neighbours that sit in `bins` or `also`,
  /// except those in `bins` stamped at or before `kept_apart` (0: none kept apart).
  /// The survivor takes `b`'s stream and the newest stamp. Returns it, not yet inserted.
  block* merge_neighbours(block* b, free_bins* bins, free_bins* also = nullptr, std::uint64_t kept_apart = 0);

  /// Removes `x` from the address chain (it has been absorbed by its predecessor).
  void unlink(block* x) { chain_.unlink(x); }

  /// Moves a stream's pending blocks whose frees are known complete to the clear bins (see
  /// completion_tracker::settle for how they are found).
  void settle(state& st, bool query_events, const stream_key& caller);

  void make_clear(block* b);

  void settle_all(bool query_events, const stream_key& caller);
  /// Every stream's cached frees into its pending bins (`clear`: whether they absorb clear
  /// neighbours), then every stream settled, in a new look (completion_tracker::begin_look):
  /// what a request that found nothing, a failed growth in place and a trim learn before they
  /// poll the look's fresh events (poll_fresh_covers).
  void settle_everything(bool query_events, const stream_key& caller, clear_neighbours clear);

  /// The segment of `capture`, made and tied to its graph by `tie()` if it has none yet (if
  /// `tie` throws, no segment is left). Under the pool lock.
  template <class Tie>
  graph_segment& segment_for(std::uint64_t capture, Tie& tie);
  /// A host-time free of graph block `p`: true when `p` is one (see pool_graphs.hpp).
  bool free_graph_block(std::uint64_t p, state& st);
  /// Block `b`, held by a graph or an importer, freed on `st`'s stream now: stamped, and
  /// counted in `st.held_frees` until the holder lets go.
  void hold_free(block* b, state& st) noexcept;
  /// That free is void or over: uncounted. Returns the freeing stream's state (null when the
  /// stream was not identified).
  state* drop_held_free(block* b) noexcept;
  /// Frees the blocks of awaiting_device_idle_ that a device-wide synchronization has cleared.
  void clear_after_device_idle() noexcept;
  /// `b` (in no bins) becomes free once a device-wide synchronization begun from now on ends:
  /// in awaiting_device_idle_, or, when the host has no memory for its entry, in the list
  /// linked through the blocks themselves.
  void await_device_idle(block* b) noexcept;
  /// A live block of a gone graph that the live table had no room for (see unindexed_), taken
  /// out of that list; null if `p` starts none.
  block* take_unindexed(std::uint64_t p) noexcept;
  /// Puts the blocks of unindexed_ into the live table as far as host memory allows, so that
  /// everything that looks live blocks up finds them again. Under the pool lock.
  void reindex_unindexed() noexcept;
  /// Takes out of a list linked through next_free (unindexed_, awaiting_unlisted_) every block
  /// for which `take` (which may act on it) says so.
  template <class Take>
  static void unlink_where(block*& head, Take&& take) noexcept {
    for (block** at = &head; *at != nullptr;) {
      block* b = *at;
      if (!take(b)) {
        at = &b->next_free;
        continue;
      }
      *at = b->next_free;
      b->next_free = nullptr;
    }
  }
  /// deallocate, once the pool has exported a block: under the pool lock (pool_exports.hpp).
  void deallocate_exported(std::uint64_t p, state& st);

  // --- graph memory (defined in pool_graph_memory.hpp) ---------------------------------------

  /// A block of `n` bytes of `seg`'s own memory: a spare block of its pieces, or a new piece's.
  block* graph_memory_for(graph_segment& seg, std::uint64_t n);
  /// A new piece for `seg` holding at least `n` bytes, as a spare block; throws core_out_of_memory.
  void add_graph_piece(graph_segment& seg, std::uint64_t n);
  /// Gives `peers` read-write access to every piece of `seg`, now and while it holds them.
  void grant_graph_peers(graph_segment& seg, std::uint64_t peers);
  /// `seg`'s pieces leave it: the backend forgets their peers (the graph is gone).
  void forget_graph_peers(const graph_segment& seg) noexcept;
  /// The pages shared by the graphs launched into one stream, and how many graphs map them.
  struct shared_pages {
    std::uint64_t stream = 0;
    std::vector<handle> pages;  ///< one granule each
    std::size_t bound = 0;
  };
  shared_pages* pages_of(std::uint64_t stream) noexcept;
  /// Calls `f(address, index)` for each granule of `seg`'s pieces, in order.
  template <class F>
  void for_each_granule(const graph_segment& seg, F&& f);
  /// Maps `seg`'s pieces onto `stream`'s pages (made as needed); throws when it cannot, with
  /// the pieces' memory put back where it was (put_back), or, when the device refuses that too,
  /// with `seg` lost.
  void rebind(graph_segment& seg, std::uint64_t stream);
  /// After a failed rebind: maps `seg`'s memory where it was (`own`, its own chunks, unmapped
  /// from its pieces; else the pages of `from`). When that fails too, unmaps what it mapped,
  /// gives `own` back to the device and marks `seg` lost.
  void put_back(graph_segment& seg, shared_pages* from, std::vector<chunk>& own) noexcept;
  /// Releases the pages of `stream` no graph maps; forgets them when no graph is bound.
  void fit_pages(std::uint64_t stream) noexcept;
  /// A gone graph's pieces, mapped on shared pages (or lost): unmapped, out of the chain,
  /// addresses given back.
  void drop_shared_pieces(graph_segment& seg) noexcept;
  /// Unmaps every graph's shared pages and releases them (the pool is closing).
  void release_all_pages() noexcept;

  // --- growth, defragmentation, release (defined in pool_growth.hpp) -------------------------

  /// The free block `st` may use that ends a mapped run with room to grow after it.
  block* extendable_tail(state& st, std::uint64_t n, std::uint64_t unit);
  /// Puts [va, va + size), the chunk just mapped there, in the address chain as a free block
  /// of `bins`. Out of host memory the chunk is unmapped and released, its addresses given
  /// back, before the error propagates: no mapped memory is left outside the chain.
  block* place_mapped(std::uint64_t va, std::uint64_t size, free_bins* bins, state* st);
  /// New physical memory for a request of `n` bytes on `st`; null when the limit or device says no.
  block* grow(std::uint64_t n, state& st, placement where, bool again = false);
  /// Live block `b` made `n` bytes long in place; false, changing nothing, when it cannot be.
  bool extend(block* b, std::uint64_t n, state& st);

  // --- defragmentation (defined in pool_remap.hpp) -------------------------------------------

  struct free_chunk {
    std::uint64_t va, size;
    std::uint64_t block_size;  ///< of the free block holding it
    std::uint64_t stamp;       ///< 0: clear; else it moves as an alias, ordered after this
  };
  /// The chunks lying wholly inside clear free blocks, those that may be unmapped; with `own`,
  /// also those of clear memory and `own`'s pending frees, which may move as aliases.
  std::vector<free_chunk> free_chunks(const state* own = nullptr);
  /// Cuts [va, va + size) out of the free blocks covering it and out of the address chain.
  void cut_out(std::uint64_t va, std::uint64_t size);
  /// Moves whole free chunks next to each other from `dst`, which moves past each one mapped;
  /// false when the driver refused a mapping (the move stops there).
  bool remap_to(std::uint64_t& dst, const std::vector<free_chunk>& chunks, state& st);
  /// Gives back [from, to), addresses taken for chunks that were not mapped there (out of host
  /// memory, they stay unused: it runs on failure paths, where the first error must be heard).
  void give_back_unmapped(std::uint64_t from, std::uint64_t to) noexcept;
  /// Unmaps the old mappings of `st`'s aliased chunks whose frees are known complete.
  void unmap_aliases(state& st) noexcept;
  /// The block serving `n` bytes on `st` after chunks moved: found, or joined.
  block* usable_after_remap(std::uint64_t n, state& st);
  /// Remaps whole free chunks next to each other when together they would hold `n` bytes.
  block* defragment(std::uint64_t n, state& st);
  /// When whole free chunks hold part of `n` bytes: remaps them next to each other and maps a
  /// new handle for the rest right after them, so the pool grows by what it lacks, not by `n`.
  block* defragment_and_grow(std::uint64_t n, state& st);
  /// Releases whole free chunks until at most `keep` free bytes remain; returns the bytes released.
  std::uint64_t release_free_chunks(std::uint64_t keep);

  /// Internal dependencies: make `s` wait for another stream's frees, so their blocks become
  /// usable. Tries streams in turn; each costs an event record and a stream wait.
  block* wait_for_pending(std::uint64_t n, state& st, stream_key s);  // pool_sources.hpp

  /// The pool's state in words, for out_of_memory (pool_queries.hpp).
  std::string describe_state();
  /// Why a free of `p` was refused, in words (pool_queries.hpp).
  std::string explain_bad_free(std::uint64_t p, const char* what = "deallocate");


  Backend backend_;
  core_options options_;
  chunk_space<Backend> space_;               // addresses and physical memory
  completion_tracker<Backend> completion_{backend_};  // which frees are known complete

  std::mutex mutex_;  // the pool lock
  free_bins clear_;
  block_chain chain_;             // every block, live or free, by address
  stream_table<event> streams_;   // what the pool keeps per stream, and the live accounting
  live_table live_;
  graph_segments graphs_;  // what graphs made by stream capture hold
  // Blocks of gone graphs that only a device-wide synchronization begun after the device count
  // given makes free (pool_graphs.hpp).
  std::vector<std::pair<block*, std::uint64_t>> awaiting_device_idle_;
  // The same, for blocks the host had no memory to list: linked through next_free (in no bins),
  // the device count in stamp.
  block* awaiting_unlisted_ = nullptr;
  // Live blocks of gone graphs that the live table had no room for (the host out of memory):
  // linked through next_free, found by deallocate when the table does not know them.
  block* unindexed_ = nullptr;
  std::vector<shared_pages> shared_pages_;  // per stream graphs are launched into
  // Exports (pool_exports.hpp): set once a block has been exported, never cleared; the last
  // serial given; bytes freed here that importers still hold.
  std::atomic<bool> exported_{false};
  std::uint64_t export_serials_ = 0;
  std::uint64_t imported_held_ = 0;
  pool_history history_;  // off unless asked for (pool::keep_history)
};

}  // namespace streamalloc::detail

#include <streamalloc/detail/core/pool_requests.hpp>  // allocate and deallocate: the fast path
#include <streamalloc/detail/core/pool_free_blocks.hpp>  // how freed blocks reach the bins
#include <streamalloc/detail/core/pool_sources.hpp>  // the definitions of the sources section
#include <streamalloc/detail/core/pool_completions.hpp>  // completed work: retire, synchronize, trim
#include <streamalloc/detail/core/pool_growth.hpp>  // the definitions of the growth section
#include <streamalloc/detail/core/pool_remap.hpp>  // defragmentation: chunks moved, or aliased
#include <streamalloc/detail/core/pool_graphs.hpp>  // the definitions of the graphs section
#include <streamalloc/detail/core/pool_graph_memory.hpp>  // graphs' own memory, shared pages
#include <streamalloc/detail/core/pool_exports.hpp>  // allocations other processes import
#include <streamalloc/detail/core/pool_snapshot.hpp>  // what the pool holds, for snapshots
#include <streamalloc/detail/core/pool_queries.hpp>  // statistics, and the pool's words for refusals
