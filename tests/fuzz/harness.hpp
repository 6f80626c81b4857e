#pragma once

// The fuzzer's harness: the records of its model of stream order, the backend the pool core runs
// on, and the class that runs one input. The class is declared here, a table of its parts; its
// members are defined by theme in the headers beside this one:
//   stream_model.hpp       the model of stream order, and the streams it tracks;
//   fuzz_backend.hpp       the backend's members, and what the harness answers them;
//   operations.hpp         the pool's configuration and the operation each input byte selects;
//   block_operations.hpp   allocate, free, grow, shrink and hand over blocks, bad pointers;
//   model_checks.hpp       the checks after each step, of the pool's queries, and at close.

#include "fuzz_support.hpp"

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace pool_core_fuzz {

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

inline bool same(const pool_statistics& a, const pool_statistics& b) {
  return a.reserved_current == b.reserved_current && a.reserved_high == b.reserved_high &&
         a.used_current == b.used_current && a.used_high == b.used_high &&
         a.live_allocations == b.live_allocations && a.free_clear == b.free_clear &&
         a.free_pending == b.free_pending && a.largest_free_block == b.largest_free_block &&
         a.chunks == b.chunks && a.remapped_chunks == b.remapped_chunks && a.grows == b.grows;
}

class harness;

/// The backend the core runs on: physical memory from sim_backend, streams and events from the
/// harness's model, every stream handle checked against what the pool may use now. The members
/// that need the harness are in fuzz_backend.hpp.
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

/// Runs one input: the pool's configuration from its first bytes, then one operation per step
/// until the input is used up, the model checked after each; then the pool is closed.
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

  // --- what the backend asks (fuzz_backend.hpp) ----------------------------------------------

  std::size_t check_handle(const stream_key& k, const char* what);
  sim_backend::event record_event(const stream_key& k, sim_backend& sim);
  const point& event_point(sim_backend::event e, const char* what);
  bool event_done(sim_backend::event e);
  bool stream_idle(const stream_key& k);
  void stream_wait(const stream_key& k, sim_backend::event e);
  void event_synchronize(sim_backend::event e);
  void event_destroy(sim_backend::event e, sim_backend& sim);
  void on_map(std::uint64_t va, std::uint64_t bytes, sim_backend::handle hd, const sim_backend& sim);
  void check_unmap(std::uint64_t va, std::uint64_t bytes);

 private:
  static bool overlaps(std::uint64_t a, std::uint64_t an, std::uint64_t b, std::uint64_t bn) {
    return a < b + bn && b < a + an;
  }

  void* phys(std::size_t s) { return &phys_[s]; }  // what the sim device knows the stream as

  // --- the model of stream order (stream_model.hpp) ------------------------------------------

  point point_now(std::size_t s) const { return {s, streams_[s].ops, streams_[s].after}; }
  std::uint64_t enqueue(std::size_t s);
  void model_wait(std::size_t t, const point& p);
  void device_run(std::size_t s, std::uint64_t target);
  bool legal(std::size_t t, std::size_t s, std::uint64_t f) const;
  void order_after(std::size_t t, std::size_t s);
  void host_synchronize(std::size_t s);
  void device_synchronize();

  // --- streams (stream_model.hpp) ------------------------------------------------------------

  std::size_t index_of(const stream_record* r) const;
  stream_key key_of(std::size_t s) const { return {streams_[s].record.get(), streams_[s].native}; }
  void make_stream(std::uint8_t kind);
  void* fresh_handle();
  void destroy_stream(std::size_t s);
  std::size_t pick_stream(std::uint8_t b, std::size_t other_than = none) const;

  // --- the configuration, the operation table and sizes (operations.hpp) ---------------------

  void configure();
  void step();
  std::uint64_t size_from_input();

  // --- calls on blocks (block_operations.hpp) ------------------------------------------------

  void allocate(std::size_t s, std::uint64_t bytes, streamalloc::placement where, bool refuse_a_map = false,
                unsigned maps_first = 0, bool fail_instead = false);
  void free_live();
  void free_block(std::uint64_t addr, std::size_t fs, bool announce);
  void remember_freed(std::uint64_t a);
  void bad_pointer();
  live_block* pick_block_of_live_stream();
  void grow();
  void shrink();
  void move_block();

  // --- checks (model_checks.hpp) -------------------------------------------------------------

  void check_out_of_memory(std::uint64_t n, const core_out_of_memory& e);
  void check_handed(std::uint64_t p, std::uint64_t size, std::uint64_t from, std::size_t t, const char* what);
  void check_state();
  void check_nothing_in_flight();
  void query();
  void finish();

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

}  // namespace pool_core_fuzz
