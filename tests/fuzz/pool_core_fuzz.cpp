// The pool core (detail/core/pool_core.hpp) under arbitrary operation sequences, on the simulated
// device of tests/support/sim_backend.hpp. Each input decodes into a pool configuration and a
// sequence of operations: allocations of any size (0, huge), frees on the allocating stream or on
// another one ordered after it, frees of foreign, interior and freed pointers, grow and shrink in
// place, handing a block to another stream, event records and waits, host synchronizations of a
// stream, an event or the device, the device running streams partly or wholly, trim, release
// thresholds, reuse policies, and streams made and destroyed: streamalloc-owned ones (retired),
// raw ones, raw ones reusing a destroyed stream's handle value, per-thread default streams that
// share one value. After every step an independent model of stream order (the one of the
// randomized test in tests/cpu/detail/pool_core_randomized_test.cpp, made exact: waits carry what they wait
// for, the device runs a stream only past what it waits on) checks that
//   - no two live blocks overlap, each is mapped, and each call returns the sizes it promises;
//   - a block, or the bytes grow_in_place adds, goes to stream T only where each earlier free of
//     that memory on stream S is on T itself, ordered before T, or executed on the device;
//   - memory is unmapped (released or remapped) only when no live block and no unexecuted free
//     touches it;
//   - the pool uses a stream's handle only while it is valid: a stream whose record says the
//     handle is stable and that has not retired, or the stream of the call in progress;
//   - bad pointers throw std::invalid_argument and change nothing;
//   - the statistics equal the model's sums, and shutdown gives everything back.
// A violation prints what was wrong and traps.
//
// Built with clang's -fsanitize=fuzzer as `pool_core_fuzz` (STREAMALLOC_BUILD_FUZZ=ON, the `fuzz`
// preset), and with any compiler as the replay program `cpu_fuzz_replay`
// (STREAMALLOC_FUZZ_REPLAY), which runs each file of tests/fuzz/corpus/ through the same entry
// point. STREAMALLOC_FUZZ_TRACE=1 prints each operation, to follow an input that fails.

#include <streamalloc/detail/core/pool_core.hpp>

#include "sim_backend.hpp"

#include <algorithm>
#include <array>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iterator>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#if defined(STREAMALLOC_FUZZ_REPLAY)
#include <filesystem>
#include <fstream>
#include <string>
#endif

namespace {

using namespace streamalloc::detail;
using streamalloc::pool_statistics;
using streamalloc::reuse_policy;
using streamalloc_test::sim_backend;
using streamalloc_test::sim_device;

constexpr std::uint64_t KiB = 1ull << 10, MiB = 1ull << 20, GiB = 1ull << 30;
// The host pseudo-stream included. More than a clock keeps (2 * max_clock_entries): ordering
// knowledge is forgotten under the model's eyes.
constexpr std::size_t max_streams = 40;
constexpr std::size_t host = 0;            // its index
constexpr std::size_t none = ~std::size_t{0};
// pool.hpp refuses larger sizes before the core: allocate throws out_of_memory, grow_in_place
// returns 0. shrink_in_place passes any size on.
constexpr std::uint64_t pool_front_limit = 1ull << 62;
void* const per_thread_handle = reinterpret_cast<void*>(0x2);  // CU_STREAM_PER_THREAD

bool trace_on = false;
const char* input_name = nullptr;  // the replayed file, for messages
std::size_t step_now = 0;

[[noreturn]] __attribute__((format(printf, 1, 2))) void fail(const char* fmt, ...) {
  std::fprintf(stderr, "pool_core_fuzz: step %zu: ", step_now);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fprintf(stderr, "\n");
  if (input_name != nullptr) std::fprintf(stderr, "pool_core_fuzz: input %s\n", input_name);
  std::fprintf(stderr, "pool_core_fuzz: STREAMALLOC_FUZZ_TRACE=1 prints the operations up to here\n");
  std::fflush(stderr);
  __builtin_trap();
}

#define TRACE(...)                                     \
  do {                                                 \
    if (trace_on) {                                    \
      std::fprintf(stderr, "[%4zu] ", step_now);       \
      std::fprintf(stderr, __VA_ARGS__);               \
      std::fprintf(stderr, "\n");                      \
    }                                                  \
  } while (0)

using ull = unsigned long long;

std::uint64_t round_up(std::uint64_t v, std::uint64_t to) { return (v + to - 1) / to * to; }

/// The input, read front to back; zeros once it is used up.
class reader {
 public:
  reader(const std::uint8_t* p, std::size_t n) : p_(p), n_(n) {}
  [[nodiscard]] bool more() const { return i_ < n_; }
  std::uint8_t byte() { return i_ < n_ ? p_[i_++] : 0; }
  std::uint64_t bytes(int k) {
    std::uint64_t v = 0;
    for (int j = 0; j < k; ++j) v = v << 8 | byte();
    return v;
  }

 private:
  const std::uint8_t* p_;
  std::size_t n_;
  std::size_t i_ = 0;
};

// --- the model of stream order -----------------------------------------------------------------

using clock_vec = std::array<std::uint64_t, max_streams>;

/// A position on a stream (its first `op` operations), with what the stream was ordered after
/// there.
struct point {
  std::size_t stream = 0;
  std::uint64_t op = 0;
  clock_vec after{};
};

struct model_stream {
  record_ref record;       // held for the input's life: the model looks at destroyed streams too
  void* native = nullptr;  // the handle value callers pass
  bool stable = false;     // record marked handle-stable (a streamalloc-owned stream)
  bool alive = true;       // not destroyed (nor retired)
  bool retirable = true;   // false for the legacy default stream, which is never destroyed
  std::uint64_t ops = 0;   // operations enqueued
  std::uint64_t done = 0;  // of which the device has executed the first `done`
  clock_vec after{};       // after[u]: ordered after u's first after[u] operations
  std::vector<std::pair<std::uint64_t, point>> waits;  // (the wait's own op, what it waits for)
  std::size_t waits_passed = 0;                        // waits the device has run past
  std::optional<std::pair<clock_snapshot, point>> last;  // an event recorded before it was destroyed
};

struct live_block {
  std::uint64_t addr, size;
  std::size_t owner;  // the stream whose work uses it
};

/// A free not yet known, by the model, to have executed.
struct freed {
  std::uint64_t addr, size;
  std::size_t stream;
  std::uint64_t op;
};

struct user_event {
  clock_snapshot snap;  // what the registry holds for it
  point at;             // what the model holds for it
};

bool same(const pool_statistics& a, const pool_statistics& b) {
  return a.reserved_current == b.reserved_current && a.reserved_high == b.reserved_high &&
         a.used_current == b.used_current && a.used_high == b.used_high &&
         a.live_allocations == b.live_allocations && a.free_clear == b.free_clear &&
         a.free_pending == b.free_pending && a.largest_free_block == b.largest_free_block &&
         a.chunks == b.chunks && a.remapped_chunks == b.remapped_chunks && a.grows == b.grows;
}

class harness;

/// The backend the core runs on: physical memory from sim_backend, streams and events from the
/// harness's model, every stream handle checked against what the pool may use now.
struct fuzz_backend {
  using handle = sim_backend::handle;
  using event = sim_backend::event;
  struct capture_guard {
    explicit capture_guard(fuzz_backend&) noexcept {}
  };
  bool capturing(const stream_key&) noexcept { return false; }
  bool lost_to_capture(const stream_key&, event&) noexcept { return false; }
  sim_backend sim;
  harness* h;

  std::uint64_t granularity() const { return sim.granularity(); }
  std::uint64_t reserve(std::uint64_t bytes) { return sim.reserve(bytes); }
  std::uint64_t try_reserve(std::uint64_t bytes, std::uint64_t at) { return sim.try_reserve(bytes, at); }
  CUresult create(std::uint64_t bytes, handle& out);
  void map(std::uint64_t va, std::uint64_t bytes, handle& hd);
  static bool refused(const std::exception& e) noexcept { return sim_backend::refused(e); }
  void unmap(std::uint64_t va, std::uint64_t bytes) noexcept;
  void release(handle& hd) noexcept;
  event record(const stream_key& k);
  bool done(event& e);
  bool idle(const stream_key& k);
  void wait(const stream_key& k, event& e);
  void synchronize(event& e) noexcept;
  void destroy(event& e) noexcept;
};

using core = pool_core<fuzz_backend>;

/// Gives the process a fresh ordering registry. Records of streams never retired (raw ones, the
/// legacy default stream) stay for the process's life, so a fuzzer running millions of inputs
/// would grow without bound; and fresh ids per input keep a replayed input's behaviour the same
/// as when found.
/// Nothing refers to the old records here: the input's pool is gone, and the core's per-thread
/// cache of states is keyed by the pool's serial, never reused.
void reset_ordering() {
  ordering_registry& r = ordering();
  r.~ordering_registry();
  ::new (static_cast<void*>(&r)) ordering_registry;
}

class harness {
 public:
  explicit harness(reader& in) : in_(in) {}

  void run() {
    configure();
    while (in_.more()) {
      ++step_now;
      step();
      check_state();
    }
    ++step_now;
    finish();
  }

  // --- what the backend asks ----------------------------------------------------------------

  /// The stream behind a key the pool passes to the backend, after checking the pool may use
  /// that handle now.
  std::size_t check_handle(const stream_key& k, const char* what) {
    const std::size_t s = index_of(k.record);
    if (s == none) fail("backend %s on a stream record the test never made", what);
    if (s == host || k.native == nullptr) fail("backend %s on stream %zu with no handle", what, s);
    if (current_.record == k.record && current_.native == k.native) return s;
    const model_stream& m = streams_[s];
    if (m.stable && m.alive && !k.record->retired() && k.native == m.native) return s;
    fail("backend %s through the handle %p of stream %zu (%s, %s%s) outside a call given it%s", what, k.native, s,
         m.stable ? "stable" : "raw", m.alive ? "alive" : "destroyed", k.record->retired() ? ", retired" : "",
         k.native != m.native ? " (not even its own handle)" : "");
  }

  sim_backend::event record_event(const stream_key& k, sim_backend& sim) {
    const std::size_t s = check_handle(k, "record");
    const sim_backend::event e = sim.record({k.record, phys(s)});
    events_[e] = point_now(s);
    return e;
  }
  const point& event_point(sim_backend::event e, const char* what) {
    auto it = events_.find(e);
    if (it == events_.end()) fail("backend %s of an unknown or destroyed event %llu", what, ull(e));
    return it->second;
  }
  bool event_done(sim_backend::event e) {
    const point& p = event_point(e, "done");
    return streams_[p.stream].done >= p.op;
  }
  bool stream_idle(const stream_key& k) {
    const model_stream& m = streams_[check_handle(k, "idle")];
    return m.done == m.ops;
  }
  void stream_wait(const stream_key& k, sim_backend::event e) {
    const std::size_t t = check_handle(k, "wait");
    const point p = event_point(e, "wait");
    TRACE("  pool: stream %zu waits for stream %zu op %llu", t, p.stream, ull(p.op));
    model_wait(t, p);
  }
  void event_synchronize(sim_backend::event e) {
    const point p = event_point(e, "synchronize");
    TRACE("  pool: host waits for stream %zu op %llu", p.stream, ull(p.op));
    device_run(p.stream, p.op);
  }
  void event_destroy(sim_backend::event e, sim_backend& sim) {
    (void)event_point(e, "destroy");
    events_.erase(e);
    sim.destroy(e);
  }

  /// Memory is about to be mapped at `va`. Physical memory already mapped elsewhere (an alias:
  /// a stream's own frees moved to new addresses before they ran) brings its unexecuted frees
  /// along, so the checks of reuse at the new addresses see them.
  void on_map(std::uint64_t va, std::uint64_t bytes, sim_backend::handle hd, const sim_backend& sim) {
    for (const auto& [old, mapped] : sim.dev->mapped_handle) {
      if (mapped != hd) continue;
      TRACE("  pool: [%#llx, +%llu) mapped again at %#llx", ull(old), ull(bytes), ull(va));
      // Only free memory may be mapped again: a live block there would share its physical
      // memory with whatever the new addresses are given to.
      for (const auto& [a, l] : live_) {
        if (overlaps(old, bytes, l.addr, l.size))
          fail("mapping [%#llx, +%llu) again at %#llx under the live block [%#llx, +%llu) of stream %zu", ull(old),
               ull(bytes), ull(va), ull(l.addr), ull(l.size), l.owner);
      }
      std::vector<freed> moved;
      for (const freed& f : history_) {
        if (streams_[f.stream].done >= f.op || !overlaps(old, bytes, f.addr, f.size)) continue;
        const std::uint64_t from = std::max(f.addr, old), to = std::min(f.addr + f.size, old + bytes);
        moved.push_back({va + (from - old), to - from, f.stream, f.op});
      }
      history_.insert(history_.end(), moved.begin(), moved.end());
    }
  }

  /// Memory is about to be unmapped: nothing may still use it.
  void check_unmap(std::uint64_t va, std::uint64_t bytes) {
    if (!shutting_down_) {
      for (const auto& [a, l] : live_) {
        if (overlaps(va, bytes, l.addr, l.size))
          fail("unmapping [%#llx, +%llu) under the live block [%#llx, +%llu) of stream %zu", ull(va), ull(bytes),
               ull(l.addr), ull(l.size), l.owner);
      }
    }
    for (const freed& f : history_) {
      if (streams_[f.stream].done < f.op && overlaps(va, bytes, f.addr, f.size))
        fail("unmapping [%#llx, +%llu) while the free of [%#llx, +%llu) on stream %zu (op %llu, executed %llu) may "
             "still run",
             ull(va), ull(bytes), ull(f.addr), ull(f.size), f.stream, ull(f.op), ull(streams_[f.stream].done));
    }
  }

 private:
  static bool overlaps(std::uint64_t a, std::uint64_t an, std::uint64_t b, std::uint64_t bn) {
    return a < b + bn && b < a + an;
  }

  void* phys(std::size_t s) { return &phys_[s]; }  // what the sim device knows the stream as

  std::size_t index_of(const stream_record* r) const {
    for (std::size_t i = 0; i < streams_.size(); ++i) {
      if (streams_[i].record.get() == r) return i;
    }
    return none;
  }
  stream_key key_of(std::size_t s) const { return {streams_[s].record.get(), streams_[s].native}; }

  // --- the model ----------------------------------------------------------------------------

  point point_now(std::size_t s) const { return {s, streams_[s].ops, streams_[s].after}; }

  std::uint64_t enqueue(std::size_t s) {
    model_stream& m = streams_[s];
    ++m.ops;
    if (s == host) m.done = m.ops;  // the host's work is done when the call returns
    return m.ops;
  }

  /// Stream t waits for point p (its wait is an operation of its own).
  void model_wait(std::size_t t, const point& p) {
    if (t == p.stream) return;
    model_stream& m = streams_[t];
    ++m.ops;
    m.waits.emplace_back(m.ops, p);
    m.after[p.stream] = std::max(m.after[p.stream], p.op);
    for (std::size_t u = 0; u < max_streams; ++u) m.after[u] = std::max(m.after[u], p.after[u]);
  }

  /// The device executes stream s's first `target` operations, and before each wait among
  /// them, what it waits for.
  void device_run(std::size_t s, std::uint64_t target) {
    model_stream& m = streams_[s];
    target = std::min(target, m.ops);
    if (target <= m.done) return;
    while (m.waits_passed < m.waits.size() && m.waits[m.waits_passed].first <= target) {
      const point p = m.waits[m.waits_passed].second;
      device_run(p.stream, p.op);
      ++m.waits_passed;
    }
    m.done = std::max(m.done, target);
  }

  /// May memory freed on s at op f be used by work on t now?
  bool legal(std::size_t t, std::size_t s, std::uint64_t f) const {
    return t == s || streams_[t].after[s] >= f || streams_[s].done >= f;
  }

  /// Orders stream t after everything enqueued so far on s (an event recorded on s through
  /// streamalloc and waited for by t); after the event recorded before it died for a dead s.
  void order_after(std::size_t t, std::size_t s) {
    if (t == s || s == host) return;  // the host's work is done already
    model_stream& m = streams_[s];
    if (m.alive) {
      const point p = point_now(s);
      streams_[t].record->wait_for(m.record->capture());
      model_wait(t, p);
    } else {
      streams_[t].record->wait_for(m.last->first);
      model_wait(t, m.last->second);
    }
  }

  /// A host synchronization of stream s, as stream::synchronize does it.
  void host_synchronize(std::size_t s) {
    model_stream& m = streams_[s];
    const std::uint64_t epoch = m.record->begin_synchronize();
    device_run(s, m.ops);
    ordering().complete_stream(*m.record, epoch);  // the pool hears of it
  }

  /// A device-wide synchronization, as synchronize_device does it.
  void device_synchronize() {
    auto points = ordering().begin_synchronize_all();
    for (std::size_t s = 1; s < streams_.size(); ++s) device_run(s, streams_[s].ops);
    ordering().complete_all(points);
  }

  // --- configuration --------------------------------------------------------------------------

  void configure() {
    const std::uint8_t b0 = in_.byte(), b1 = in_.byte(), b2 = in_.byte(), b3 = in_.byte(), b4 = in_.byte(),
                       b5 = in_.byte(), b6 = in_.byte();
    dev_ = std::make_shared<sim_device>();
    dev_->granularity = (b0 & 16) ? 64 * KiB : 2 * MiB;
    const std::uint64_t g = dev_->granularity;
    core_options o;
    o.reuse = {bool(b0 & 1), bool(b0 & 2), bool(b0 & 4)};
    o.own_chunk_for_large = !(b0 & 8);
    const std::uint64_t chunks[] = {0, g, 2 * g, 8 * MiB, 16 * MiB, 3 * g};
    o.chunk_size = chunks[b1 % 6];
    const std::uint64_t maxes[] = {0, 0, 0, 8 * MiB, 32 * MiB, 128 * MiB, 1 * GiB, 3 * g};
    o.max_size = maxes[b2 % 8];
    const std::uint64_t chunk = o.chunk_size == 0 ? 64 * MiB : round_up(o.chunk_size, g);
    const std::uint64_t thresholds[] = {0, 0, chunk, 64 * MiB, ~0ull};
    o.release_threshold = thresholds[b3 % 5];
    const std::uint64_t spaces[] = {64 * GiB, 64 * GiB, 256 * MiB, 1 * GiB, 8 * GiB, 1024 * GiB};
    o.address_space = spaces[b4 % 6];
    const std::uint64_t capacities[] = {1ull << 40, 64 * MiB, 256 * MiB, 2 * GiB, 16 * GiB};
    dev_->capacity = capacities[b5 % 5];
    // A pool that builds large requests from chunks maps one handle per chunk: bound their
    // number, so each input runs in milliseconds.
    if (!o.own_chunk_for_large) dev_->capacity = std::min(dev_->capacity, chunk * 2048);
    TRACE("pool: granularity %llu, chunk %llu, max %llu, threshold %llu, addresses %llu, device %llu, reuse "
          "%d%d%d, own chunk for large %d",
          ull(g), ull(chunk), ull(o.max_size), ull(o.release_threshold), ull(o.address_space), ull(dev_->capacity),
          o.reuse.follow_event_dependencies, o.reuse.opportunistic, o.reuse.internal_dependencies,
          o.own_chunk_for_large);
    pool_ = std::make_unique<core>(fuzz_backend{sim_backend{dev_}, this}, o);

    // The host pseudo-stream, as pool.hpp's host_key() makes it.
    stream_record& h = ordering().record(~std::uint64_t{0});
    h.mark_completed(~std::uint64_t{0} >> 1);
    streams_.push_back({});
    streams_[host].record = record_ref(h);
    streams_[host].retirable = false;
    const int first = 1 + (b6 & 3);
    for (int i = 0; i < first; ++i) make_stream(((b6 >> (2 + i)) & 1) ? 0 : 2);
  }

  // --- streams -----------------------------------------------------------------------------

  void make_stream(std::uint8_t kind) {
    if (streams_.size() == max_streams) return;
    model_stream m;
    m.record = record_ref(ordering().record(next_id_++));
    switch (kind % 7) {
      case 0:
      case 1:  // a streamalloc stream
        m.stable = true;
        m.native = fresh_handle();
        break;
      case 2:  // a raw stream
        m.native = fresh_handle();
        break;
      case 3:  // a raw stream given the handle value of one destroyed before it
      case 4:  // a streamalloc stream, likewise
        m.stable = kind % 7 == 4;
        if (!dead_handles_.empty()) {
          const std::size_t i = in_.byte() % dead_handles_.size();
          m.native = dead_handles_[i];
          dead_handles_.erase(dead_handles_.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          m.native = fresh_handle();
        }
        break;
      case 5:  // another thread's per-thread default stream: one value names a stream per thread
        m.native = per_thread_handle;
        break;
      case 6:  // the legacy default stream: stable, never destroyed
        for (const auto& x : streams_) {
          if (x.native == reinterpret_cast<void*>(0x1)) return;
        }
        m.stable = true;
        m.retirable = false;
        m.native = reinterpret_cast<void*>(0x1);
        break;
    }
    if (m.stable) m.record->mark_handle_stable();
    streams_.push_back(std::move(m));
    TRACE("stream %zu: %s, handle %p, id %llu", streams_.size() - 1, streams_.back().stable ? "stable" : "raw",
          streams_.back().native, ull(streams_.back().record->id()));
  }

  void* fresh_handle() {
    next_handle_ += 0x100;
    return reinterpret_cast<void*>(next_handle_);
  }

  void destroy_stream(std::size_t s) {
    model_stream& m = streams_[s];
    // The last event recorded on it, through which its blocks go on to other streams.
    m.last.emplace(m.record->capture(), point_now(s));
    if (m.stable) {
      TRACE("stream %zu: destroyed (retired)", s);
      current_ = key_of(s);  // the handle is valid until retire returns
      ordering().retire(m.record->id());
      current_ = {};
    } else {
      TRACE("stream %zu: destroyed (raw)", s);
    }
    m.alive = false;
    // A destroyed stream's handle value goes to the next stream made; the per-thread default
    // stream's (its thread ended) names the other threads' streams still.
    if (m.native != per_thread_handle) dead_handles_.push_back(m.native);
  }

  /// A live stream other than the host, chosen by the input; `none` if there is none.
  std::size_t pick_stream(std::uint8_t b, std::size_t other_than = none) const {
    std::array<std::size_t, max_streams> c{};
    std::size_t n = 0;
    for (std::size_t i = 1; i < streams_.size(); ++i) {
      if (streams_[i].alive && i != other_than) c[n++] = i;
    }
    return n == 0 ? none : c[b % n];
  }

  // --- sizes ---------------------------------------------------------------------------------

  std::uint64_t size_from_input() {
    const std::uint64_t g = pool_->granularity(), chunk = pool_->options().chunk_size;
    const std::uint8_t kind = in_.byte();
    switch (kind % 8) {
      case 0: return in_.byte();
      case 1: return in_.bytes(2);
      case 2: return in_.bytes(3);
      case 3: {  // whole granules, give or take a little
        const std::uint64_t k = in_.byte() % 9;
        const std::uint64_t d = in_.byte();
        return std::max<std::int64_t>(0, static_cast<std::int64_t>(k * g + d * 256) - 16 * 256);
      }
      case 4: {  // whole chunks, give or take a little
        const std::uint64_t k = 1 + in_.byte() % 4;
        const std::uint64_t d = in_.byte();
        return k * chunk + d * 256 - 128 * 256;
      }
      case 5: {
        const std::uint64_t edge[] = {0,
                                      1,
                                      255,
                                      256,
                                      257,
                                      4096,
                                      g - 1,
                                      g,
                                      g + 1,
                                      chunk - 1,
                                      chunk,
                                      chunk + 1,
                                      1ull << 40,
                                      1ull << 50,
                                      pool_front_limit,
                                      pool_front_limit + 1,
                                      1ull << 63,
                                      ~0ull - 255,
                                      ~0ull - 254,
                                      ~0ull};
        return edge[in_.byte() % std::size(edge)];
      }
      case 6: return in_.bytes(4);
      default: return in_.bytes(8);
    }
  }

  /// Is an out-of-memory answer to a request of n bytes acceptable? Not when the pool has no
  /// limit, the device has room, and the addresses have a free range much larger than needed.
  void check_out_of_memory(std::uint64_t n, const core_out_of_memory& e) {
    const auto& o = pool_->options();
    if (o.max_size != 0) return;
    const std::uint64_t chunk = o.chunk_size;
    const std::uint64_t need = round_up(n, chunk) + chunk;
    if (dev_->capacity - dev_->physical_used < need + chunk) return;
    // The largest unmapped range inside one reservation, or the addresses the pool may still
    // reserve (in one piece, as the driver here always can).
    std::uint64_t largest = 0, reserved = 0;
    for (const auto& [base, size] : pool_->reservations()) {
      reserved += size;
      std::uint64_t at = base;
      const std::uint64_t end = base + size;
      for (auto it = dev_->mapped.lower_bound(base); it != dev_->mapped.end() && it->first < end; ++it) {
        largest = std::max(largest, it->first - at);
        at = it->first + it->second;
      }
      largest = std::max(largest, end - at);
    }
    if (pool_->reservations().size() < reservation_list::max_count) {
      largest = std::max(largest, pool_->address_space() - std::min(reserved, pool_->address_space()));
    }
    if (largest < 2 * need + chunk) return;
    fail("out of memory for %llu bytes with no limit, %llu bytes free on the device and %llu free addresses in one "
         "range: %s",
         ull(n), ull(dev_->capacity - dev_->physical_used), ull(largest), e.reason.c_str());
  }

  // --- checks ----------------------------------------------------------------------------------

  /// [from, p + size) was just handed to stream t as (part of) the block at p.
  void check_handed(std::uint64_t p, std::uint64_t size, std::uint64_t from, std::size_t t, const char* what) {
    if (p % 256 != 0) fail("%s: %#llx is not 256-aligned", what, ull(p));
    if (!pool_->owns(p) || !pool_->owns(p + size - 1))
      fail("%s: [%#llx, +%llu) is outside the pool's addresses", what, ull(p), ull(size));
    if (!dev_->is_mapped(p, size)) fail("%s: [%#llx, +%llu) is not mapped", what, ull(p), ull(size));
    for (const auto& [a, l] : live_) {
      if (a != p && overlaps(p, size, l.addr, l.size))
        fail("%s: [%#llx, +%llu) overlaps the live block [%#llx, +%llu) of stream %zu", what, ull(p), ull(size),
             ull(l.addr), ull(l.size), l.owner);
    }
    for (const freed& f : history_) {
      if (overlaps(from, p + size - from, f.addr, f.size) && !legal(t, f.stream, f.op)) {
        const model_stream& s = streams_[f.stream];
        fail("%s: [%#llx, +%llu) handed to stream %zu while the free of [%#llx, +%llu) on stream %zu (op %llu) is "
             "neither executed (%llu of %llu ops ran) nor ordered before it (it is after op %llu); pool: completed "
             "%llu, ordered_after %llu",
             what, ull(from), ull(p + size - from), t, ull(f.addr), ull(f.size), f.stream, ull(f.op), ull(s.done),
             ull(s.ops), ull(streams_[t].after[f.stream]), ull(s.record->completed()),
             ull(streams_[t].record->ordered_after(s.record->id())));
      }
    }
  }

  void check_state() {
    const pool_statistics st = pool_->statistics();
    std::uint64_t bytes = 0;
    for (const auto& [a, l] : live_) {
      bytes += l.size;
      if (!dev_->is_mapped(l.addr, l.size))
        fail("the live block [%#llx, +%llu) of stream %zu is no longer mapped", ull(l.addr), ull(l.size), l.owner);
    }
    if (st.used_current != bytes || st.live_allocations != live_.size())
      fail("statistics say %llu bytes in %llu live allocations; the model has %llu in %zu", ull(st.used_current),
           ull(st.live_allocations), ull(bytes), live_.size());
    if (st.reserved_current != dev_->physical_used)
      fail("statistics say %llu bytes reserved; the device holds %llu", ull(st.reserved_current),
           ull(dev_->physical_used));
    if (st.reserved_current != st.used_current + st.free_clear + st.free_pending)
      fail("reserved %llu != used %llu + free %llu + pending %llu", ull(st.reserved_current), ull(st.used_current),
           ull(st.free_clear), ull(st.free_pending));
    if (!pool_->addresses_consistent()) fail("a free address range overlaps another, or a mapped chunk");
    if (pool_->options().max_size != 0 && st.reserved_high > pool_->options().max_size)
      fail("reserved reached %llu, above the limit %llu", ull(st.reserved_high), ull(pool_->options().max_size));
    // Frees known executed can never make a reuse illegal again.
    std::erase_if(history_, [&](const freed& f) { return streams_[f.stream].done >= f.op; });
  }

  /// frees_in_flight() said false: every unexecuted free must lie under live blocks (reused).
  void check_nothing_in_flight() {
    for (const freed& f : history_) {
      if (streams_[f.stream].done >= f.op) continue;
      std::uint64_t covered = 0;
      for (const auto& [a, l] : live_) {
        if (overlaps(f.addr, f.size, l.addr, l.size))
          covered += std::min(f.addr + f.size, l.addr + l.size) - std::max(f.addr, l.addr);
      }
      if (covered < f.size)
        fail("frees_in_flight() is false while the free of [%#llx, +%llu) on stream %zu (op %llu, %llu ran) may "
             "still run on free memory",
             ull(f.addr), ull(f.size), f.stream, ull(f.op), ull(streams_[f.stream].done));
    }
  }

  // --- operations ----------------------------------------------------------------------------

  void step() {
    const std::uint8_t op = in_.byte();
    switch (op % 32) {
      case 0: case 1: case 2: case 3: case 4: case 5: case 6: case 7: {
        const std::size_t s = pick_stream(in_.byte());
        const std::uint64_t bytes = size_from_input();
        const std::uint8_t w = in_.byte();
        const auto where = (w & 1) ? streamalloc::placement::room_to_grow : streamalloc::placement::packed;
        // One request in 16: the driver refuses a mapping it asks for (short of memory), after
        // letting 0 to 7 through; with bit 5 of the operation set, the mapping fails for
        // another reason instead (a sticky error's stand-in), which must reach the caller.
        if (s != none) allocate(s, bytes, where, (w & 0xf0) == 0xf0, (w >> 1) & 7, (op & 0x20) != 0);
        break;
      }
      case 8: case 9: case 10: case 11: case 12: case 13: free_live(); break;
      case 14: bad_pointer(); break;
      case 15: case 16: {
        const std::size_t s = pick_stream(in_.byte());
        const std::size_t t = pick_stream(in_.byte(), s);
        if (s == none || t == none) break;
        if (op & 0x80) {
          // Through raw CUDA calls: t is ordered after s, but streamalloc does not know it.
          TRACE("raw event on stream %zu waited for by stream %zu", s, t);
          model_wait(t, point_now(s));
        } else {
          TRACE("event on stream %zu waited for by stream %zu", s, t);
          order_after(t, s);
        }
        break;
      }
      case 17: {
        const std::uint8_t b = in_.byte();
        auto& slot = user_events_[b % user_events_.size()];
        if (b & 0x80) {
          const std::size_t s = pick_stream(in_.byte());
          if (s == none) break;
          TRACE("event %d recorded on stream %zu", b % 4, s);
          const point p = point_now(s);
          slot = user_event{streams_[s].record->capture(), p};
        } else if (slot) {
          const std::size_t t = pick_stream(in_.byte());
          if (t == none || t == slot->at.stream) break;
          TRACE("stream %zu waits for event %d (stream %zu op %llu)", t, b % 4, slot->at.stream, ull(slot->at.op));
          streams_[t].record->wait_for(slot->snap);
          model_wait(t, slot->at);
        }
        break;
      }
      case 18: {
        auto& slot = user_events_[in_.byte() % user_events_.size()];
        if (!slot) break;
        TRACE("host synchronizes an event (stream %zu op %llu)", slot->at.stream, ull(slot->at.op));
        device_run(slot->at.stream, slot->at.op);
        ordering().complete(slot->snap);
        break;
      }
      case 19: {
        const std::size_t s = pick_stream(in_.byte());
        if (s == none) break;
        TRACE("host synchronizes stream %zu", s);
        host_synchronize(s);
        break;
      }
      case 20: case 21: {
        // The device runs some of a stream's work (a destroyed stream's too), unannounced.
        const std::uint8_t b = in_.byte();
        const std::size_t s = 1 + b % (streams_.size() - 1);
        model_stream& m = streams_[s];
        const std::uint8_t k = in_.byte();
        const std::uint64_t target = (k & 1) || m.ops == m.done ? m.ops : m.done + 1 + k % (m.ops - m.done);
        TRACE("device runs stream %zu to op %llu of %llu", s, ull(target), ull(m.ops));
        device_run(s, target);
        break;
      }
      case 22:
        TRACE("host synchronizes the device");
        device_synchronize();
        break;
      case 23: case 24: grow(); break;
      case 25: shrink(); break;
      case 26: move_block(); break;
      case 27: {
        const std::uint8_t b = in_.byte();
        const std::uint64_t chunk = pool_->options().chunk_size;
        const std::uint64_t amounts[] = {0, chunk, 2 * chunk, 64 * MiB, ~0ull, in_.bytes(4) * 256};
        const std::uint64_t v = amounts[(b >> 2) % 6];
        if (b % 3 == 0) {
          TRACE("trim_to(%llu)", ull(v));
          pool_->trim_to(v);
        } else if (b % 3 == 1) {
          TRACE("set_release_threshold(%llu)", ull(v));
          pool_->set_release_threshold(v);
        } else {
          const reuse_policy r{bool(b & 8), bool(b & 16), bool(b & 32)};
          TRACE("set_reuse(%d%d%d)", r.follow_event_dependencies, r.opportunistic, r.internal_dependencies);
          pool_->set_reuse(r);
        }
        break;
      }
      case 28: make_stream(in_.byte()); break;
      case 29: {
        const std::size_t s = pick_stream(in_.byte());
        if (s != none && streams_[s].retirable) destroy_stream(s);
        break;
      }
      case 30: query(); break;
      default: {
        // The host pseudo-stream: allocate_sync, or deallocate_sync of a live block.
        const std::uint8_t b = in_.byte();
        if ((b & 1) || live_.empty()) {
          const std::uint64_t bytes = size_from_input();
          allocate(host, bytes, streamalloc::placement::packed);
        } else {
          auto it = std::next(live_.begin(), static_cast<std::ptrdiff_t>(in_.byte() % live_.size()));
          free_block(it->first, host, b & 2);
        }
        break;
      }
    }
  }

  void allocate(std::size_t s, std::uint64_t bytes, streamalloc::placement where, bool refuse_a_map = false,
                unsigned maps_first = 0, bool fail_instead = false) {
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

  void free_live() {
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
  void free_block(std::uint64_t addr, std::size_t fs, bool announce) {
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

  void remember_freed(std::uint64_t a) {
    if (freed_addrs_.size() < 64) {
      freed_addrs_.push_back(a);
    } else {
      freed_addrs_[freed_next_++ % 64] = a;
    }
  }

  /// A pointer that is no live block's start, given to deallocate, grow_in_place or
  /// shrink_in_place: std::invalid_argument, and nothing changed.
  void bad_pointer() {
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
  live_block* pick_block_of_live_stream() {
    if (live_.empty()) return nullptr;
    live_block& l = std::next(live_.begin(), static_cast<std::ptrdiff_t>(in_.byte() % live_.size()))->second;
    if (l.owner == host || !streams_[l.owner].alive) return nullptr;
    return &l;
  }

  void grow() {
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

  void shrink() {
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
  void move_block() {
    if (live_.empty()) return;
    live_block& l = std::next(live_.begin(), static_cast<std::ptrdiff_t>(in_.byte() % live_.size()))->second;
    const std::size_t t = pick_stream(in_.byte(), l.owner);
    if (t == none) return;
    TRACE("block %#llx moves from stream %zu to stream %zu", ull(l.addr), l.owner, t);
    order_after(t, l.owner);
    l.owner = t;
    enqueue(t);
  }

  void query() {
    const std::uint8_t b = in_.byte();
    if (b % 3 == 0) {
      const bool r = pool_->frees_in_flight();
      TRACE("frees_in_flight() -> %d", r);
      if (!r) check_nothing_in_flight();
    } else if (b % 3 == 1) {
      std::uint64_t p = pool_->base() + in_.bytes(5) % pool_->address_space();
      if (!live_.empty() && (b & 4)) {
        const live_block& l = std::next(live_.begin(), static_cast<std::ptrdiff_t>(in_.byte() % live_.size()))->second;
        p = l.addr + in_.bytes(4) % l.size;
      }
      std::optional<std::pair<std::uint64_t, std::uint64_t>> want;
      auto it = live_.upper_bound(p);
      if (it != live_.begin() && p < std::prev(it)->second.addr + std::prev(it)->second.size)
        want = std::pair{std::prev(it)->second.addr, std::prev(it)->second.size};
      TRACE("find_live(%#llx)", ull(p));
      if (pool_->find_live(p) != want) fail("find_live(%#llx) disagrees with the live blocks", ull(p));
    } else {
      TRACE("reset_high_water()");
      pool_->reset_high_water();
      const pool_statistics st = pool_->statistics();
      if (st.used_high != st.used_current || st.reserved_high != st.reserved_current)
        fail("after reset_high_water, high-water marks %llu / %llu, current %llu / %llu", ull(st.used_high),
             ull(st.reserved_high), ull(st.used_current), ull(st.reserved_current));
    }
  }

  /// As pool::close: waits for the device when frees may be in flight or blocks are live,
  /// then shuts the core down; everything must go back.
  void finish() {
    const bool in_flight = pool_->frees_in_flight();
    TRACE("close: frees_in_flight() -> %d, %zu live", in_flight, live_.size());
    if (!in_flight) check_nothing_in_flight();
    if (in_flight || !live_.empty()) device_synchronize();
    std::uint64_t bytes = 0;
    for (const auto& [a, l] : live_) bytes += l.size;
    shutting_down_ = true;
    const auto [count, leaked] = pool_->shutdown();
    if (count != live_.size() || leaked != bytes)
      fail("shutdown reports %llu live allocations of %llu bytes; the model has %zu of %llu", ull(count), ull(leaked),
           live_.size(), ull(bytes));
    if (dev_->physical_used != 0 || !dev_->mapped.empty() || dev_->live_events != 0 || !events_.empty())
      fail("after shutdown the device holds %llu bytes, %zu mappings, %llu events", ull(dev_->physical_used),
           dev_->mapped.size(), ull(dev_->live_events));
    pool_.reset();
  }

  reader& in_;
  std::shared_ptr<sim_device> dev_;
  std::unique_ptr<core> pool_;
  std::vector<model_stream> streams_;
  std::map<std::uint64_t, live_block> live_;  // by address
  std::vector<freed> history_;
  std::map<sim_backend::event, point> events_;  // the pool's events, where they were recorded
  std::array<std::optional<user_event>, 4> user_events_;
  std::vector<void*> dead_handles_;
  std::vector<std::uint64_t> freed_addrs_;
  std::size_t freed_next_ = 0;
  stream_key current_{};  // the stream of the pool call in progress: its handle is valid now
  bool shutting_down_ = false;
  std::uint64_t next_id_ = 1;
  std::uint64_t next_handle_ = 0x7f0000000000;
  std::array<char, max_streams> phys_{};
};

// --- the backend's members, which need the harness -------------------------------------------

template <class F>
auto sim_call(const char* what, F&& f) {
  try {
    return f();
  } catch (const std::logic_error& e) {
    fail("the simulated device refused %s: %s", what, e.what());
  }
}

CUresult fuzz_backend::create(std::uint64_t bytes, handle& out) {
  return sim_call("create", [&] { return sim.create(bytes, out); });
}
void fuzz_backend::map(std::uint64_t va, std::uint64_t bytes, handle& hd) {
  // A refused mapping maps nothing: it throws here, before the model hears of a mapping.
  if (sim.dev->refuse_maps != 0 && sim.dev->maps_before_refusal == 0) {
    sim_call("map", [&] { sim.map(va, bytes, hd); });
  }
  h->on_map(va, bytes, hd, sim);
  sim_call("map", [&] { sim.map(va, bytes, hd); });
}
// The simulated device aborts on a misuse in these: they may not throw (pool_backend).
void fuzz_backend::unmap(std::uint64_t va, std::uint64_t bytes) noexcept {
  h->check_unmap(va, bytes);
  sim.unmap(va, bytes);
}
void fuzz_backend::release(handle& hd) noexcept { sim.release(hd); }
fuzz_backend::event fuzz_backend::record(const stream_key& k) { return h->record_event(k, sim); }
bool fuzz_backend::done(event& e) { return h->event_done(e); }
bool fuzz_backend::idle(const stream_key& k) { return h->stream_idle(k); }
void fuzz_backend::wait(const stream_key& k, event& e) { h->stream_wait(k, e); }
void fuzz_backend::synchronize(event& e) noexcept { h->event_synchronize(e); }
void fuzz_backend::destroy(event& e) noexcept { h->event_destroy(e, sim); }

static_assert(pool_backend<fuzz_backend>);

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const bool init = [] {
    const char* t = std::getenv("STREAMALLOC_FUZZ_TRACE");
    trace_on = t != nullptr && *t != '\0' && *t != '0';
    return true;
  }();
  (void)init;
  reset_ordering();
  step_now = 0;
  reader in(data, size);
  harness h(in);
  h.run();
  return 0;
}

#if defined(STREAMALLOC_FUZZ_REPLAY)
// Runs each file named, or each file in each directory named, through the entry point.
int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    const fs::path arg(argv[i]);
    if (fs::is_directory(arg)) {
      for (const auto& e : fs::directory_iterator(arg)) {
        if (e.is_regular_file() && e.path().filename().string()[0] != '.') files.push_back(e.path());
      }
    } else {
      files.push_back(arg);
    }
  }
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string name = f.string();
    input_name = name.c_str();
    LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
  }
  input_name = nullptr;
  std::printf("pool_core_fuzz: replayed %zu inputs\n", files.size());
  // An empty corpus (a wrong path, a lost directory) would pass without checking anything.
  return files.empty() ? 1 : 0;
}
#endif
