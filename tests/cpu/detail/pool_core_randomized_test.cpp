// The pool's allocator on a simulated device: randomized multi-stream sequences checked against
// an independent model of what each stream is ordered after: no overlap, only legal reuse, every
// byte accounted for.

#include "pool_core_support.hpp"

#include <algorithm>
#include <cstddef>
#include <random>
#include <vector>

namespace {
// An independent model of stream order: per stream a count of operations; per stream a vector
// clock of what it was made to wait for (by the test, or by the pool's inserted waits); and
// what the device has completed. A reuse is legal when the new owner's stream is the freeing
// stream, or ordered after the free, or the free is known to have executed.
struct order_model {
  std::vector<std::uint64_t> ops;                  // per stream: operations enqueued
  std::vector<std::vector<std::uint64_t>> clock;   // clock[t][s]: t is after s's ops up to this
  std::vector<std::uint64_t> done;                 // per stream: ops executed on the device
  explicit order_model(std::size_t n) : ops(n, 0), clock(n, std::vector<std::uint64_t>(n, 0)), done(n, 0) {}
  std::uint64_t enqueue(std::size_t s) { return ++ops[s]; }
  void wait(std::size_t t, std::size_t s) {  // t waits for everything enqueued on s so far
    clock[t][s] = std::max(clock[t][s], ops[s]);
    for (std::size_t u = 0; u < ops.size(); ++u) clock[t][u] = std::max(clock[t][u], clock[s][u]);
  }
  bool legal(std::size_t t, std::size_t s, std::uint64_t free_op) const {
    return t == s || clock[t][s] >= free_op || done[s] >= free_op;
  }
};
}  // namespace

TEST_CASE("randomized: no overlap, only legal reuse, every byte accounted for") {
  for (std::uint64_t seed = 1; seed <= 64; ++seed) {
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    core_options o;
    o.chunk_size = (seed % 2) ? 2 * MiB : 16 * MiB;
    o.max_size = (seed % 3 == 0) ? 256 * MiB : 0;
    o.reuse = {bool(rng() % 2), bool(rng() % 2), bool(rng() % 2)};
    o.own_chunk_for_large = seed % 4 != 1;  // some seeds build large requests from chunks
    fixture f(o);
    constexpr std::size_t streams = 4;
    std::vector<test_stream> st;
    for (std::size_t i = 0; i < streams; ++i) st.push_back(make_stream());
    order_model model(streams);
    std::size_t waits_seen = 0;

    struct live_alloc {
      std::uint64_t addr, size;
      std::size_t stream;
    };
    std::vector<live_alloc> live;
    // Freed ranges not yet known reusable by everyone: (addr, size, stream, op).
    struct freed {
      std::uint64_t addr, size;
      std::size_t stream;
      std::uint64_t op;
      std::uint64_t stamp;
    };
    std::vector<freed> history;

    // The pool's own inserted waits enter the model as they happen.
    auto learn_waits = [&] {
      while (waits_seen < f.dev->waits.size()) {
        auto [waiter, waited] = f.dev->waits[waits_seen++];
        std::size_t t = 0, s = 0;
        for (std::size_t i = 0; i < streams; ++i) {
          if (st[i].native == waiter) t = i;
          if (st[i].native == waited) s = i;
        }
        model.wait(t, s);
      }
    };
    for (int step = 0; step < 4000; ++step) {
      const auto r = rng() % 100;
      const std::size_t s = rng() % streams;
      if (r < 45 || live.empty()) {
        const std::uint64_t n = (rng() % 3 == 0) ? (rng() % (8 * MiB)) + 1 : (rng() % 65536) + 1;
        std::uint64_t p = 0;
        try {
          p = f.pool->allocate(n, st[s].key());
        } catch (const core_out_of_memory&) {
          REQUIRE(o.max_size != 0);  // only a limited pool may run out here
          learn_waits();
          continue;
        }
        learn_waits();
        const std::uint64_t size = (n + 255) / 256 * 256;
        REQUIRE(f.dev->is_mapped(p, size));
        for (const auto& l : live) REQUIRE((p + size <= l.addr || l.addr + l.size <= p));
        // Every earlier free this block overlaps must be legal for stream s to reuse.
        for (const auto& h : history) {
          if (p < h.addr + h.size && h.addr < p + size) {
            INFO("reuse of a block freed on stream " << h.stream << " by stream " << s);
            INFO("free op " << h.op << ", model done " << model.done[h.stream] << ", model clock "
                            << model.clock[s][h.stream] << ", ops " << model.ops[h.stream] << "; pool: completed "
                            << st[h.stream].record->completed() << " (stamp " << h.stamp << "), ordered_after "
                            << st[s].record->ordered_after(st[h.stream].record->id()) << ", step " << step);
            REQUIRE(model.legal(s, h.stream, h.op));
          }
        }
        live.push_back({p, size, s});
        model.enqueue(s);
        f.dev->busy.insert(st[s].native);  // work on s uses it
      } else if (r < 85) {
        const std::size_t i = rng() % live.size();
        const live_alloc a = live[i];
        live[i] = live.back();
        live.pop_back();
        // Frees happen on the allocating stream, or on another after waiting for it (the
        // stream-ordered contract for freeing elsewhere).
        std::size_t fs = a.stream;
        if (rng() % 4 == 0) {
          fs = s;
          model.wait(fs, a.stream);
          st[fs].record->wait_for(st[a.stream].record->capture());
          f.dev->busy.insert(st[fs].native);  // the wait is enqueued work
        }
        f.pool->deallocate(a.addr, st[fs].key());
        history.push_back({a.addr, a.size, fs, model.enqueue(fs), st[fs].record->stamp()});
        f.dev->busy.insert(st[fs].native);
      } else if (r < 92) {
        // An event on stream s, waited on by stream t, through streamalloc's handles.
        const std::size_t t = rng() % streams;
        if (t != s) {
          model.wait(t, s);
          st[t].record->wait_for(st[s].record->capture());
          f.dev->busy.insert(st[t].native);  // the wait is enqueued work
        }
      } else if (r < 96) {
        f.dev->run(st[s].native);  // the device catches up on s, unannounced
        model.done[s] = model.ops[s];
        // Having run past its waits, s proves the work it waited for ran too.
        for (std::size_t u = 0; u < streams; ++u) model.done[u] = std::max(model.done[u], model.clock[s][u]);
      } else {
        // A host synchronization of s.
        const auto epoch = st[s].record->begin_synchronize();
        f.dev->run(st[s].native);
        model.done[s] = model.ops[s];
        for (std::size_t u = 0; u < streams; ++u) model.done[u] = std::max(model.done[u], model.clock[s][u]);
        ordering().complete_stream(*st[s].record, epoch);
      }
    }
    // Accounting: live bytes as the test counts them; physical memory as the device counts it.
    std::uint64_t live_bytes = 0;
    for (const auto& l : live) live_bytes += l.size;
    auto stats = f.pool->statistics();
    CHECK(stats.live_allocations == live.size());
    CHECK(stats.used_current >= live_bytes);  // fast-cache reuse may hand out a slightly larger block
    CHECK(stats.used_current <= live_bytes + live_bytes / 8 + live.size() * 256);
    CHECK(stats.reserved_current == f.dev->physical_used);
    CHECK(stats.reserved_current == stats.used_current + stats.free_clear + stats.free_pending);
    if (o.max_size != 0) CHECK(stats.reserved_high <= o.max_size);
    // Free everything, let the device finish, release: nothing remains.
    for (const auto& l : live) f.pool->deallocate(l.addr, st[l.stream].key());
    for (auto& x : st) host_sync(*f.dev, x);
    f.pool->trim_to(0);
    stats = f.pool->statistics();
    CHECK(stats.used_current == 0);
    CHECK(stats.reserved_current == 0);
    CHECK(f.dev->physical_used == 0);
  }
}
