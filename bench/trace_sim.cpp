// The memory trace of bench_pool (section 5), replayed on the CPU through streamalloc's pool
// core on a simulated device that runs every stream at once (as the idle GPU does in the
// bench). Reports the reserved high-water mark against the peak live bytes for several chunk
// sizes, in seconds instead of device minutes: this is where the memory policy is tuned.
//
// With --trace, replays recorded traces instead (bench/traces/*.trace.gz, from real PyTorch
// workloads, bench/traces/README.md; a folder stands for the traces in it): one simulated
// stream per trace stream, every stream's work complete after each operation, as in
// bench_trace_replay on an idle GPU. PyTorch's own reserved / peak live for the same steps is
// printed beside them when pytorch_peaks.json is found next to the trace.
//
//   bench_trace_sim [--live-gib N] [--steps N]
//   bench_trace_sim --trace FILE|DIR [--trace FILE|DIR ...] [--snapshots DIR [--snapshot-at N]]
//                   [--device idle|steps|lag N] [--streams kept|pytorch] [--evict BYTES[KiB|MiB|GiB]]
//
// --snapshots writes, for each trace, the default pool's snapshot (pool::snapshot's JSON, with
// the history of every event up to then) taken when the trace's live bytes peak, to
// DIR/<trace>.snapshot.json: what scripts/plot_snapshot.py draws. --snapshot-at N takes it after
// the trace's Nth operation instead.

#include <streamalloc/detail/core/pool_core.hpp>
#include <streamalloc/detail/pool/snapshot_json.hpp>

#include "../tests/support/sim_backend.hpp"
#include "trace.hpp"
#include "trace_file.hpp"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <fstream>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {
using namespace streamalloc::detail;

struct config {
  std::size_t chunk;
  bool own;  // a request of a chunk or more gets a chunk of its own size (the default pool until 0.x)
};
// The default pool (64 MiB chunks, large requests built from them), the default before large
// requests were built from chunks ("own": one handle of their own size), PyTorch's expandable
// segments' page (20 MiB), an intermediate, and `compact` (2 MiB chunks).
constexpr config configs[] = {{64u << 20, false}, {64u << 20, true}, {20u << 20, false}, {16u << 20, false}, {2u << 20, false}};

std::string snapshot_dir;  // --snapshots
std::size_t snapshot_at = 0;  // --snapshot-at: after this operation (1-based) instead of at the peak
// --device steps: the device runs a trace's work only when the host synchronizes, at the start
// of each step (a training loop reading its loss), instead of finishing each operation's work
// before the next (an idle GPU, the default, as in bench_trace_replay). A real training run
// sits between the two: its host runs ahead of the GPU by up to a step.
bool device_idle = true;
// --device lag N: the device runs N operations behind the host: after operation i, the work
// the pool enqueued (its events) up to operation i - N is done, and a stream used in the last N
// operations is busy. A host running ahead of its GPU, as a training loop does between its
// synchronizations; the whole-run traces have no step marks for --device steps to use.
std::size_t device_lag = 0;
// --evict BYTES (or with KiB, MiB, GiB: 512KiB): the warm passes write over BYTES before each
// operation and time the operations alone: the pool's cost with the CPU's caches taken by
// other work, as the kernel launches between a PyTorch step's allocations take them
// (bench/timed_streamalloc.cpp measures the same in the real process).
std::size_t evict_bytes = 0;
// --streams pytorch: streams as PyTorch hands them to streamalloc (see simulate).
bool pytorch_streams = false;

/// A byte count: digits, optionally followed by KiB, MiB or GiB. False for anything else
/// ("1MiB" once read as 1 byte; a sign, which strtoull would take; a count that overflows).
bool parse_bytes(const char* text, std::size_t& out) {
  if (*text < '0' || *text > '9') return false;
  errno = 0;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(text, &end, 10);
  if (errno == ERANGE) return false;
  unsigned shift = 0;
  if (!std::strcmp(end, "KiB")) shift = 10;
  else if (!std::strcmp(end, "MiB")) shift = 20;
  else if (!std::strcmp(end, "GiB")) shift = 30;
  else if (*end != '\0') return false;
  if (n > (std::numeric_limits<std::size_t>::max() >> shift)) return false;
  out = static_cast<std::size_t>(n) << shift;
  return true;
}

/// The index of the operation after which the live bytes peak.
std::size_t peak_op(const std::vector<bench::recorded_op>& ops) {
  std::vector<std::uint64_t> size_of;
  std::uint64_t live = 0, best = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].id >= size_of.size()) size_of.resize(ops[i].id + 1);
    if (ops[i].alloc) {
      size_of[ops[i].id] = ops[i].size;
      live += ops[i].size;
    } else {
      live -= size_of[ops[i].id];
    }
    if (live > best) {
      best = live;
      at = i;
    }
  }
  return at;
}

template <class Pool>
void write_snapshot(Pool& pool, const std::string& path) {
  streamalloc::pool_properties props;
  props.location = streamalloc::memory_location::device(0);
  const std::string doc = snapshot_json(0, props, pool.statistics(), pool.snapshot(), device_memory_info{});
  std::ofstream(path) << doc << '\n';
  std::printf("  snapshot at the peak written to %s (%zu bytes)\n", path.c_str(), doc.size());
}

/// The default pool's later passes, as bench_trace_replay's "again": everything still live
/// freed on its stream, then the trace once more on the warm pool, an idle device; five times,
/// the median printed (single passes of these short traces differ by a third from run to run).
/// Prints the device calls a pass made per operation too: on a GPU each is a driver call of
/// some 170 to 330 ns (bench_vmm_costs) that the CPU model's time leaves out, so the two
/// together say where a GPU replay's time goes.
template <class Pool>
void warm_passes(Pool& pool, streamalloc_test::sim_device& dev, const std::vector<bench::recorded_op>& ops,
                 const std::vector<stream_key>& keys, std::vector<std::uint64_t>& ptr) {
  std::vector<std::uint32_t> stream_of(ptr.size(), 0);
  std::vector<bool> live(ptr.size(), false);
  for (const auto& op : ops) {
    if (op.alloc) stream_of[op.id] = op.stream;
    live[op.id] = op.alloc;
  }
  struct calls {
    std::uint64_t records, queries, idle, waits, creates;
  };
  auto count = [&] { return calls{dev.event_records, dev.event_queries, dev.idle_queries, dev.event_waits, dev.creates}; };
  const std::uint64_t remapped_before = pool.statistics().remapped_chunks;
  std::vector<double> ns;
  calls before{}, after{};
  std::vector<unsigned char> evicted(evict_bytes);
  using clock = std::chrono::steady_clock;
  // With --evict, what an interval between two back-to-back clock reads holds: taken off each
  // operation's time, so that the figure is the pool's alone.
  double clock_ns = 0;
  if (!evicted.empty()) {
    constexpr int reads = 100000;
    clock::duration held{};
    for (int i = 0; i < reads; ++i) {
      const auto a = clock::now();
      held += clock::now() - a;
    }
    clock_ns = std::chrono::duration<double, std::nano>(held).count() / reads;
  }
  for (int pass = 0; pass < 5; ++pass) {
    for (std::size_t id = 0; id < ptr.size(); ++id) {
      if (live[id]) pool.deallocate(ptr[id], keys[stream_of[id]]);
    }
    dev.run_all();
    before = count();
    clock::duration inside{};
    const auto t = clock::now();
    for (const auto& op : ops) {
      const stream_key& s = keys[op.stream];
      if (!evicted.empty()) {
        for (std::size_t i = 0; i < evicted.size(); i += 64) evicted[i] = static_cast<unsigned char>(evicted[i] + 1);
        std::atomic_signal_fence(std::memory_order_seq_cst);
      }
      const auto op_start = evicted.empty() ? clock::time_point{} : clock::now();
      if (op.alloc) ptr[op.id] = pool.allocate(op.size, s);
      else pool.deallocate(ptr[op.id], s);
      if (!evicted.empty()) inside += clock::now() - op_start;
      if (keys.size() == 1) dev.run(s.native);
      else dev.run_all();
    }
    const clock::duration whole = evicted.empty() ? clock::now() - t : inside;
    ns.push_back(std::chrono::duration<double>(whole).count() * 1e9 / double(ops.size()) - clock_ns);
    after = count();
  }
  std::sort(ns.begin(), ns.end());
  const double n = double(ops.size());
  if (!evicted.empty()) {
    std::printf("  (each operation timed alone, %zu bytes written over before it; the clock's own %.1f ns taken off)\n",
                evicted.size(), clock_ns);
  }
  std::printf("  default pool, again on the warm pool: %.0f ns/op (median of 5 passes); device calls per operation: "
              "event records %.3f, event queries %.3f, stream idle queries %.3f, event waits %.3f, creates %.3f\n",
              ns[ns.size() / 2], double(after.records - before.records) / n, double(after.queries - before.queries) / n,
              double(after.idle - before.idle) / n, double(after.waits - before.waits) / n,
              double(after.creates - before.creates) / n);
  std::printf("  chunks remapped in the 5 warm passes: %llu\n",
              static_cast<unsigned long long>(pool.statistics().remapped_chunks - remapped_before));
}

/// Replays `ops` (ids dense from 0) through a fresh pool core per chunk size and prints a row
/// each. `streams` simulated streams; `peak` the trace's peak live bytes; `address_space` the
/// pools' limit on addresses.
void simulate(const std::vector<bench::recorded_op>& ops, std::size_t allocations, std::uint32_t streams,
              std::size_t peak, std::uint64_t address_space, const std::string& name = {},
              const std::vector<std::size_t>& step_starts = {}) {
  std::printf("%17s %14s %12s %10s %10s %8s %10s\n", "chunk", "reserved high", "/ peak live", "remapped", "chunks",
              "seconds", "ns/op");
  static char handles[bench::trace_detail::max_streams];
  for (const config& c : configs) {
    const std::size_t chunk = c.chunk;
    auto dev = std::make_shared<streamalloc_test::sim_device>();
    // Each reservation right after the last, as the driver placed them on the H100 (pools
    // whose reservations touch merge free memory across them).
    dev->gap_between_reservations = false;
    // The pool covers another stream's frees with an event instead of asking whether the stream
    // is idle, and a request that would grow polls it briefly; on an idle GPU it completes
    // within the poll.
    dev->idle_records_complete = true;
    core_options o;
    o.chunk_size = chunk;
    o.own_chunk_for_large = c.own;
    o.release_threshold = ~0ull;
    o.address_space = address_space;
    pool_core<streamalloc_test::sim_backend> pool(streamalloc_test::sim_backend{dev}, o);
    // Stream 0 is the record bench_trace_sim always used; further streams get records of their
    // own.
    std::vector<stream_key> keys;
    for (std::uint32_t i = 0; i < std::max<std::uint32_t>(streams, 1); ++i) {
      keys.push_back(stream_key{&ordering().record((1ull << 60) + i), &handles[i]});
      // Streams whose handles the pool may keep, as bench_pool's and bench_trace_replay's
      // `stream`s are: a free on such a stream absorbs clear neighbours, which decides where
      // later blocks go (unmarked, the random trace gives 1.341 here, against 1.256 on the
      // GPU; marked, 1.256). With --streams pytorch, only stream 0 is (PyTorch's default
      // stream, the legacy one); the others are raw handles, as PyTorch's side streams are.
      if (i == 0 || !pytorch_streams) keys.back().record->mark_handle_stable();
      // PyTorch's default stream is the legacy one, whose handle the pool uses only during
      // calls given it.
      if (i == 0 && pytorch_streams) keys.back().record->mark_legacy();
    }
    std::vector<std::uint64_t> ptr(allocations);
    // The default pool's snapshot at the peak, when asked (it slows that replay's timing).
    const bool snap = !snapshot_dir.empty() && !name.empty() && &c == &configs[0];
    const std::size_t snap_at = !snap ? ops.size() : snapshot_at != 0 ? std::min(snapshot_at, ops.size()) - 1 : peak_op(ops);
    if (snap) pool.history().keep(snap_at + 1024);
    const auto t = std::chrono::steady_clock::now();
    std::size_t step = 0, next_step = 0;
    // --device lag: each stream's enqueued count after each of the last `device_lag` operations,
    // and the operation that last used each stream.
    std::vector<std::vector<std::uint64_t>> enqueued_at(device_lag, std::vector<std::uint64_t>(keys.size()));
    std::vector<std::size_t> last_used(keys.size(), 0);
    try {
      for (const auto& op : ops) {
        if (!device_idle && next_step < step_starts.size() && step == step_starts[next_step]) {
          dev->run_all();  // the host synchronizes at the end of each step
          ++next_step;
        }
        const stream_key& s = keys[op.stream];
        if (op.alloc) ptr[op.id] = pool.allocate(op.size, s);
        else pool.deallocate(ptr[op.id], s);
        // An idle device: every event completes at once; with several streams the pool may
        // record events on other streams than the op's, and all of them complete.
        if (device_lag != 0) {
          last_used[op.stream] = step;
          auto& row = enqueued_at[step % device_lag];
          if (step >= device_lag) {  // the row holds what was enqueued by operation step - lag
            for (std::size_t k = 0; k < keys.size(); ++k) {
              auto& st = dev->streams[keys[k].native];
              st.completed = std::max(st.completed, row[k]);
              if (last_used[k] + device_lag <= step && st.completed == st.enqueued) dev->busy.erase(keys[k].native);
            }
          }
          for (std::size_t k = 0; k < keys.size(); ++k) row[k] = dev->streams[keys[k].native].enqueued;
          dev->busy.insert(s.native);
        } else if (device_idle) {
          if (keys.size() == 1) dev->run(s.native);
          else dev->run_all();
        }
        if (step == snap_at) write_snapshot(pool, snapshot_dir + "/" + name + ".snapshot.json");
        ++step;
      }
    } catch (const core_out_of_memory& e) {
      std::printf("%9zu MiB: out of memory at operation %zu (%llu bytes): %s\n", chunk >> 20, step,
                  static_cast<unsigned long long>(e.requested), e.reason.c_str());
      pool.shutdown();
      continue;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    const auto st = pool.statistics();
    std::printf("%9zu MiB%s %11.3f GiB %12.3f %10llu %10llu %8.2f %10.0f\n", chunk >> 20, c.own ? ", own" : "     ",
                double(st.reserved_high) / (1 << 30), double(st.reserved_high) / double(peak),
                static_cast<unsigned long long>(st.remapped_chunks), static_cast<unsigned long long>(st.chunks), secs,
                secs * 1e9 / double(ops.size()));
    if (&c == &configs[0] && device_idle) warm_passes(pool, *dev, ops, keys, ptr);
    pool.shutdown();
  }
}

int replay_recorded(const std::vector<std::string>& args) {
  const std::vector<std::string> files = bench::expand_trace_paths(args);
  if (files.empty()) {
    std::fprintf(stderr, "bench_trace_sim: no traces in %s\n", args.empty() ? "" : args.front().c_str());
    return 1;
  }
  int failures = 0;
  for (const auto& path : files) {
    bench::recorded_trace t;
    try {
      t = bench::load_trace(path);
    } catch (const bench::trace_error& e) {
      std::fprintf(stderr, "bench_trace_sim: %s\n", e.what());
      ++failures;
      continue;
    }
    std::printf("\ntrace %s (%s): %zu operations, %zu allocations (%zu live at the end), %u stream%s, peak live %.3f GiB\n",
                t.name.c_str(), path.c_str(), t.ops.size(), t.allocations(), t.live_at_end, t.streams,
                t.streams == 1 ? "" : "s", double(t.peak_live) / (1 << 30));
    if (const std::string w = t.note("workload:"); !w.empty()) std::printf("  %s\n", w.c_str());
    std::string why;
    try {
      if (const std::string peaks = bench::peaks_file_for(path, ""); !peaks.empty()) {
        if (auto p = bench::load_pytorch_peaks(peaks, t.name, why)) {
          auto ratio = [&](const std::optional<bench::pytorch_peak>& x) {
            char buf[32] = "-";
            if (x) std::snprintf(buf, sizeof buf, "%.3f", x->max_reserved / double(t.peak_live));
            return std::string(buf);
          };
          std::printf("  PyTorch on the GPU (max_memory_reserved / peak live): default %s, expandable segments %s\n",
                      ratio(p->standard).c_str(), ratio(p->expandable).c_str());
        }
      }
    } catch (const bench::trace_error& e) {
      std::printf("  (PyTorch's peaks not read: %s)\n", e.what());
    }
    const std::uint64_t gib = 1ull << 30;
    if (device_lag != 0) std::printf("  the device runs %zu operations behind the host\n", device_lag);
    else if (!device_idle) std::printf("  the device runs only at the %zu step marks\n", t.step_starts.size());
    simulate(t.ops, t.allocations(), t.streams, t.peak_live, 4 * ((t.peak_live + gib - 1) / gib * gib) + 64 * gib,
             t.name, t.step_starts);
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t live_gib = 8;
  int steps = 20000;
  std::vector<std::string> traces;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--live-gib") && i + 1 < argc) live_gib = std::strtoull(argv[++i], nullptr, 10);
    else if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--trace") && i + 1 < argc) traces.emplace_back(argv[++i]);
    else if (!std::strcmp(argv[i], "--snapshots") && i + 1 < argc) snapshot_dir = argv[++i];
    else if (!std::strcmp(argv[i], "--snapshot-at") && i + 1 < argc) snapshot_at = std::strtoull(argv[++i], nullptr, 10);
    else if (!std::strcmp(argv[i], "--device") && i + 1 < argc && !std::strcmp(argv[i + 1], "steps")) {
      device_idle = false;
      ++i;
    } else if (!std::strcmp(argv[i], "--device") && i + 1 < argc && !std::strcmp(argv[i + 1], "idle")) {
      ++i;
    } else if (!std::strcmp(argv[i], "--device") && i + 2 < argc && !std::strcmp(argv[i + 1], "lag") &&
               std::strtoull(argv[i + 2], nullptr, 10) > 0) {
      device_lag = std::strtoull(argv[i + 2], nullptr, 10);
      device_idle = false;
      i += 2;
    } else if (!std::strcmp(argv[i], "--streams") && i + 1 < argc && !std::strcmp(argv[i + 1], "pytorch")) {
      pytorch_streams = true;
      ++i;
    } else if (!std::strcmp(argv[i], "--streams") && i + 1 < argc && !std::strcmp(argv[i + 1], "kept")) {
      ++i;
    } else if (!std::strcmp(argv[i], "--evict") && i + 1 < argc && parse_bytes(argv[i + 1], evict_bytes)) {
      ++i;
    } else {
      std::fprintf(stderr, "usage: bench_trace_sim [--live-gib N] [--steps N] | --trace FILE|DIR [--trace ...] [--snapshots DIR [--snapshot-at N]]\n"
                   "                       [--device idle|steps|lag N] [--streams kept|pytorch] [--evict BYTES[KiB|MiB|GiB]]\n");
      return 2;
    }
  }
  if (!traces.empty()) return replay_recorded(traces);
  std::size_t peak = 0;
  const auto random_ops = bench::make_trace(live_gib << 30, steps, peak);
  std::vector<bench::recorded_op> ops;
  ops.reserve(random_ops.size());
  std::size_t allocations = 0;
  for (const auto& op : random_ops) {
    ops.push_back({op.alloc, op.id, op.size, 0});
    if (op.alloc) ++allocations;
  }
  std::printf("trace: %zu operations, peak live %.3f GiB\n", ops.size(), double(peak) / (1 << 30));
  simulate(ops, allocations, 1, peak, 4 * (live_gib << 30) + (64ull << 30));
  return 0;
}
