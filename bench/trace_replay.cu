// Allocation traces of real PyTorch workloads (bench/traces/*.trace.gz, recorded by
// bench/traces/record.py) replayed allocator-only on the GPU, in one process: every allocation
// and free of the trace, in order, one CUDA stream per trace stream, no kernels. Each allocator
// starts fresh for each replay:
//   cudaMallocAsync   a new cudaMemPool_t keeping its memory (release threshold UINT64_MAX);
//                     reserved high = cudaMemPoolAttrReservedMemHigh
//   CUB               cub::CachingDeviceAllocator as bench_pool makes it (bins 512 B .. 128 MiB
//                     growing x8, 4 GiB cache); reserved high = the most it held at once
//                     (cached + live bytes by its own count, taken after each allocation)
//   streamalloc       the default pool and the `compact` one (bench_pool section 5), both
//                     keeping their memory; reserved high = statistics().reserved_high
// beside PyTorch's own peaks for the same steps (pytorch_peaks.json, measured by record.py on
// the GPU that recorded the trace): max_memory_reserved with its default settings and with
// expandable segments. Ratios are over the trace's peak live bytes (the sizes the program asked
// for); PyTorch's max_memory_allocated, which counts its blocks rounded up to 512 B, is printed
// beside it.
//
// Time per operation is host time over the whole trace: "first" from a fresh allocator (growth
// included), the median of --reps replays; "again" the same trace on the same allocator after
// everything was freed (what PyTorch's steps after the first see), --warm passes in each
// replay, the median of them all. A single warm pass of these traces takes 2 to 15 ms, and
// single passes differed by up to a half from run to run on the H200 (the driver's as much as
// streamalloc's), so one pass per replay made the ratios of one run unreliable. Memory is from
// the first replay's first pass.
//
// Then the ratio the targets ask for, streamalloc's default over the driver's pool on a warm
// pool, from --turns pairs of warm passes taken in turn (both allocators alive side by side,
// the pair's first alternating): the median of the pairs' ratios. The medians above come from
// passes timed at different moments, and the machine's speed moves by up to 2x between them.
//
//   bench_trace_replay [--json FILE] [--traces DIR] [--reps N] [--warm N] [--turns N] [trace files or folders...]
//
// Without trace arguments, every *.trace.gz of --traces (default: the source tree's
// bench/traces).

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include "bench_common.hpp"
#include "trace_file.hpp"

#include <cub/util_allocator.cuh>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#ifndef STREAMALLOC_TRACES_DIR
#define STREAMALLOC_TRACES_DIR "bench/traces"
#endif

namespace {
using bench::clk;
using bench::seconds_since;
constexpr std::size_t KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024;
bench::json_rows rows;

/// Why an operation failed; `out_of_memory` when the allocator ran out (a result, not an error).
struct failure {
  std::string why;
  bool out_of_memory = false;
};

// --- the allocators, each made fresh for a replay ---------------------------------------------

class async_replay {
 public:
  explicit async_replay(const std::vector<cudaStream_t>& s) : s_(s), pool_(bench::make_driver_pool()) {}
  async_replay(const async_replay&) = delete;
  async_replay& operator=(const async_replay&) = delete;
  ~async_replay() {
    cudaDeviceSynchronize();
    cudaMemPoolDestroy(pool_);
  }
  void* allocate(std::size_t n, std::uint32_t stream, failure& f) {
    void* p = nullptr;
    const cudaError_t e = cudaMallocFromPoolAsync(&p, n, pool_, s_[stream]);
    if (e == cudaSuccess) return p;
    cudaGetLastError();
    f = {std::string("cudaMallocFromPoolAsync: ") + cudaGetErrorString(e), e == cudaErrorMemoryAllocation};
    return nullptr;
  }
  bool deallocate(void* p, std::uint32_t stream, failure& f) {
    const cudaError_t e = cudaFreeAsync(p, s_[stream]);
    if (e == cudaSuccess) return true;
    cudaGetLastError();
    f = {std::string("cudaFreeAsync: ") + cudaGetErrorString(e)};
    return false;
  }
  std::uint64_t reserved_high() {
    std::uint64_t high = 0;
    BENCH_CHECK(cudaMemPoolGetAttribute(pool_, cudaMemPoolAttrReservedMemHigh, &high));
    return high;
  }

 private:
  const std::vector<cudaStream_t>& s_;
  cudaMemPool_t pool_;
};

class cub_replay {
 public:
  explicit cub_replay(const std::vector<cudaStream_t>& s) : s_(s) {
    int device = 0;
    BENCH_CHECK(cudaGetDevice(&device));
    // The allocator keeps its byte counts in a std::map by device; its nodes do not move.
    held_ = &alloc_.cached_bytes[device];
  }
  cub_replay(const cub_replay&) = delete;
  cub_replay& operator=(const cub_replay&) = delete;
  ~cub_replay() { cudaDeviceSynchronize(); }  // the allocator's destructor frees its cache
  void* allocate(std::size_t n, std::uint32_t stream, failure& f) {
    void* p = nullptr;
    const cudaError_t e = alloc_.DeviceAllocate(&p, n, s_[stream]);
    if (e != cudaSuccess) {
      cudaGetLastError();
      f = {std::string("CachingDeviceAllocator::DeviceAllocate: ") + cudaGetErrorString(e), e == cudaErrorMemoryAllocation};
      return nullptr;
    }
    high_ = std::max(high_, held_->free + held_->live);
    return p;
  }
  bool deallocate(void* p, std::uint32_t, failure& f) {
    const cudaError_t e = alloc_.DeviceFree(p);
    if (e == cudaSuccess) return true;
    cudaGetLastError();
    f = {std::string("CachingDeviceAllocator::DeviceFree: ") + cudaGetErrorString(e)};
    return false;
  }
  std::uint64_t reserved_high() const { return high_; }

 private:
  const std::vector<cudaStream_t>& s_;
  cub::CachingDeviceAllocator alloc_{8, 3, 9, 4 * GiB};  // as in bench_pool
  cub::CachingDeviceAllocator::TotalBytes* held_ = nullptr;
  std::size_t high_ = 0;
};

class streamalloc_replay {
 public:
  streamalloc_replay(std::vector<streamalloc::stream>& s, bool compact) : s_(s), pool_(props(compact)) {}
  streamalloc_replay(const streamalloc_replay&) = delete;
  streamalloc_replay& operator=(const streamalloc_replay&) = delete;
  ~streamalloc_replay() {
    cudaDeviceSynchronize();
    pool_.close();
  }
  void* allocate(std::size_t n, std::uint32_t stream, failure& f) {
    try {
      return pool_.allocate(n, s_[stream]);
    } catch (const streamalloc::out_of_memory& e) {
      f = {e.what(), true};
    } catch (const std::exception& e) {
      f = {e.what()};
    }
    return nullptr;
  }
  bool deallocate(void* p, std::uint32_t stream, failure& f) {
    try {
      pool_.deallocate(p, s_[stream]);
      return true;
    } catch (const std::exception& e) {
      f = {e.what()};
    }
    return false;
  }
  std::uint64_t reserved_high() const { return pool_.statistics().reserved_high; }

 private:
  static streamalloc::pool_properties props(bool compact) {
    auto p = bench::kept();
    p.compact = compact;
    return p;
  }
  std::vector<streamalloc::stream>& s_;
  streamalloc::pool pool_;
};

// --- replaying ---------------------------------------------------------------------------------

struct pass_result {
  double seconds = 0;
  std::optional<std::size_t> failed_at;  // the operation that failed
  failure f;
};

/// Every operation of `t` in order; `ptr` (by id) holds what is live.
template <class A>
pass_result replay_pass(A& a, const bench::recorded_trace& t, std::vector<void*>& ptr) {
  pass_result r;
  std::size_t i = 0;
  const auto start = clk::now();
  for (const auto& op : t.ops) {
    if (op.alloc) {
      void* p = a.allocate(op.size, op.stream, r.f);
      if (p == nullptr) break;
      ptr[op.id] = p;
    } else {
      if (!a.deallocate(ptr[op.id], op.stream, r.f)) break;
      ptr[op.id] = nullptr;
    }
    ++i;
  }
  r.seconds = seconds_since(start);
  if (i != t.ops.size()) r.failed_at = i;
  return r;
}

/// Frees what is still live (on the stream each was allocated on) and waits for the device.
template <class A>
bool release_live(A& a, const bench::recorded_trace& t, std::vector<void*>& ptr, failure& f) {
  bool ok = true;
  for (std::size_t id = 0; id < ptr.size(); ++id) {
    if (ptr[id] == nullptr) continue;
    if (!a.deallocate(ptr[id], t.stream_of[id], f)) ok = false;
    ptr[id] = nullptr;
  }
  BENCH_CHECK(cudaDeviceSynchronize());
  return ok;
}

struct allocator_result {
  std::string label;
  std::string key;  // for the JSON rows
  std::uint64_t reserved_high = 0;
  std::uint64_t reserved_high_again = 0;  // after the last warm pass
  std::vector<double> first_ns, again_ns;
  std::optional<failure> failed;
  std::string failed_where;
};

std::string describe_op(const bench::recorded_trace& t, std::size_t i) {
  const auto& op = t.ops[i];
  return "operation " + std::to_string(i) + " (" + (op.alloc ? "allocate " + std::to_string(op.size) + " bytes" : "free") +
         " of id " + std::to_string(op.id) + " on stream " + std::to_string(op.stream) + ")";
}

/// One replay: a fresh allocator from `make`, the trace on it fresh, then `warm` times again,
/// everything freed before each. Memory is taken on replay 0 only (reserved_high_again after
/// its last pass).
template <class Make>
void replay_once(allocator_result& res, int rep, int warm, const bench::recorded_trace& t, Make make) {
  if (res.failed) return;
  auto a = make();
  std::vector<void*> ptr(t.allocations(), nullptr);
  const double ops = static_cast<double>(t.ops.size());
  for (int pass = 0; pass <= warm; ++pass) {
    const pass_result r = replay_pass(*a, t, ptr);
    if (rep == 0) (pass == 0 ? res.reserved_high : res.reserved_high_again) = a->reserved_high();
    if (r.failed_at) {
      res.failed = r.f;
      res.failed_where = (pass == 0 ? std::string("first pass, ") : "warm pass " + std::to_string(pass) + ", ") +
                         describe_op(t, *r.failed_at);
      failure ignored;
      release_live(*a, t, ptr, ignored);
      return;
    }
    (pass == 0 ? res.first_ns : res.again_ns).push_back(r.seconds * 1e9 / ops);
    failure f;
    if (!release_live(*a, t, ptr, f)) {
      res.failed = f;
      res.failed_where = "freeing what was live at the end";
      return;
    }
  }
}

std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r' || c == '\t') c = ' ';
  }
  return s;
}

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f GiB", bytes / double(GiB));
  return buf;
}

/// The ratio the target asks for (streamalloc's default pool over the driver's pool, ns per
/// operation on a warm pool), from warm passes taken in turn: both allocators made and warmed
/// side by side, then `turns` pairs of passes, the first of each pair alternating between them,
/// each turn's ratio from two passes a few milliseconds apart. The machine's speed moves by up
/// to 2x between moments (docs/pool.md, "The ring's sizes timed in turn"); medians of passes
/// timed at different moments, as above, carry that into the ratio.
struct in_turn_result {
  std::vector<double> ratio, ours_ns, driver_ns;
  std::string failed;
};

in_turn_result replay_in_turn(const bench::recorded_trace& t, std::vector<streamalloc::stream>& streams,
                              const std::vector<cudaStream_t>& raw, int turns) {
  in_turn_result out;
  async_replay driver(raw);
  streamalloc_replay ours(streams, false);
  std::vector<void*> pd(t.allocations(), nullptr), po(t.allocations(), nullptr);
  const double ops = static_cast<double>(t.ops.size());
  // One pass of each, untimed, so that both are warm; then the turns.
  for (int k = -1; k < turns; ++k) {
    double ns[2] = {0, 0};  // driver, ours
    for (int i = 0; i < 2; ++i) {
      const bool driver_now = (k & 1) ? i == 1 : i == 0;
      const pass_result r = driver_now ? replay_pass(driver, t, pd) : replay_pass(ours, t, po);
      failure f = r.f;
      const bool freed = driver_now ? release_live(driver, t, pd, f) : release_live(ours, t, po, f);
      if (r.failed_at || !freed) {
        out.failed = std::string(driver_now ? "cudaMallocAsync" : "streamalloc") + ": " +
                     (r.failed_at ? describe_op(t, *r.failed_at) + ": " : std::string()) + one_line(f.why);
        return out;
      }
      ns[driver_now ? 0 : 1] = r.seconds * 1e9 / ops;
    }
    if (k < 0) continue;
    out.driver_ns.push_back(ns[0]);
    out.ours_ns.push_back(ns[1]);
    out.ratio.push_back(ns[1] / ns[0]);
  }
  return out;
}

/// Replays one trace against every allocator and prints its table. False when an allocator
/// failed other than by running out of memory.
bool replay_trace(const bench::recorded_trace& t, int reps, int warm, int turns, const std::string& traces_dir) {
  std::printf("\ntrace %s (%s)\n  %zu operations, %zu allocations (%zu live at the end), %u stream%s, peak live %s\n",
              t.name.c_str(), t.path.c_str(), t.ops.size(), t.allocations(), t.live_at_end, t.streams,
              t.streams == 1 ? "" : "s", gib(double(t.peak_live)).c_str());
  if (const std::string w = t.note("workload:"); !w.empty()) std::printf("  %s\n", w.c_str());

  std::optional<bench::pytorch_peaks> torch_peaks;
  std::string why_not;
  const std::string peaks_path = bench::peaks_file_for(t.path, traces_dir);
  try {
    if (!peaks_path.empty()) torch_peaks = bench::load_pytorch_peaks(peaks_path, t.name, why_not);
    else why_not = "no pytorch_peaks.json beside the trace or in " + traces_dir;
  } catch (const bench::trace_error& e) {
    why_not = e.what();
  }
  if (torch_peaks) {
    std::printf("  PyTorch's max_memory_allocated for the same steps: %s (default), %s (expandable segments);"
                " it counts blocks rounded up to 512 B\n",
                torch_peaks->standard ? gib(torch_peaks->standard->max_allocated).c_str() : "-",
                torch_peaks->expandable ? gib(torch_peaks->expandable->max_allocated).c_str() : "-");
  } else {
    std::printf("  (PyTorch's peaks not shown: %s)\n", why_not.c_str());
  }

  std::size_t free_bytes = 0, total_bytes = 0;
  BENCH_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (t.peak_live > free_bytes) {
    std::printf("  skipped: the trace needs %s live, the GPU has %s free\n", gib(double(t.peak_live)).c_str(),
                gib(double(free_bytes)).c_str());
    rows.add("trace_" + t.name, "\"skipped\": true, \"peak_live\": " + std::to_string(t.peak_live));
    return true;
  }

  std::vector<streamalloc::stream> streams;
  std::vector<cudaStream_t> raw;
  for (std::uint32_t i = 0; i < t.streams; ++i) {
    streams.emplace_back(0);
    raw.push_back(streams.back().get());
  }
  std::vector<allocator_result> results(4);
  results[0].label = "cudaMallocAsync";
  results[0].key = "cudaMallocAsync";
  results[1].label = "CUB (x8 bins to 128 MiB, 4 GiB cache)";
  results[1].key = "cub";
  results[2].label = "streamalloc (default, 64 MiB chunks)";
  results[2].key = "streamalloc_default";
  results[3].label = "streamalloc (compact, 2 MiB chunks)";
  results[3].key = "streamalloc_compact";
  for (int rep = 0; rep < reps; ++rep) {  // interleaved, so that all see the same moments
    replay_once(results[0], rep, warm, t, [&] { return std::make_unique<async_replay>(raw); });
    replay_once(results[1], rep, warm, t, [&] { return std::make_unique<cub_replay>(raw); });
    replay_once(results[2], rep, warm, t, [&] { return std::make_unique<streamalloc_replay>(streams, false); });
    replay_once(results[3], rep, warm, t, [&] { return std::make_unique<streamalloc_replay>(streams, true); });
  }

  const in_turn_result turn = replay_in_turn(t, streams, raw, turns);

  const double peak = double(t.peak_live);
  std::printf("%-40s %15s %12s %13s %13s %17s\n", "allocator", "reserved high", "/ peak live", "ns/op first", "ns/op again",
              "again min..max");
  bool ok = true;
  for (const auto& r : results) {
    if (r.failed && r.first_ns.empty()) {
      std::printf("%-40s %s at %s: %s\n", r.label.c_str(), r.failed->out_of_memory ? "out of memory" : "FAILED",
                  r.failed_where.c_str(), r.failed->why.c_str());
    } else {
      const double first = bench::median(r.first_ns), again = bench::median(r.again_ns);
      const auto [lo, hi] = std::minmax_element(r.again_ns.begin(), r.again_ns.end());
      std::printf("%-40s %15s %12.3f %13.1f %13.1f %8.0f..%-8.0f\n", r.label.c_str(), gib(double(r.reserved_high)).c_str(),
                  double(r.reserved_high) / peak, first, again, r.again_ns.empty() ? 0.0 : *lo,
                  r.again_ns.empty() ? 0.0 : *hi);
      if (r.failed) {
        std::printf("%-40s   then %s at %s: %s\n", "", r.failed->out_of_memory ? "out of memory" : "FAILED",
                    r.failed_where.c_str(), r.failed->why.c_str());
      }
    }
    if (r.failed && !r.failed->out_of_memory) ok = false;
    std::string fields = "\"reserved_high\": " + std::to_string(r.reserved_high) +
                         ", \"reserved_high_after_warm_passes\": " + std::to_string(r.reserved_high_again) +
                         ", \"peak_live\": " + std::to_string(t.peak_live) +
                         ", \"ratio\": " + std::to_string(double(r.reserved_high) / peak) +
                         ", \"ns_per_op_first\": " + std::to_string(bench::median(r.first_ns)) +
                         ", \"ns_per_op_again\": " + std::to_string(bench::median(r.again_ns)) +
                         ", \"warm_passes_timed\": " + std::to_string(r.again_ns.size()) +
                         ", \"ok\": " + (r.failed ? "false" : "true");
    if (r.failed) {
      fields += ", \"out_of_memory\": " + std::string(r.failed->out_of_memory ? "true" : "false") + ", \"failure\": \"" +
                bench::json_escape(one_line(r.failed_where + ": " + r.failed->why)) + "\"";
    }
    rows.add("trace_" + t.name + "_" + r.key, fields);
  }
  auto torch_row = [&](const char* label, const std::optional<bench::pytorch_peak>& p) {
    if (!p) {
      std::printf("%-40s %15s\n", label, "-");
      return;
    }
    std::printf("%-40s %15s %12.3f   (max_memory_reserved; step %.1f ms, process peak %s)\n", label,
                gib(p->max_reserved).c_str(), p->max_reserved / peak, p->step_time_s * 1e3,
                gib(p->device_used_peak).c_str());
  };
  std::string trace_fields = "\"ops\": " + std::to_string(t.ops.size()) + ", \"allocations\": " +
                             std::to_string(t.allocations()) + ", \"streams\": " + std::to_string(t.streams) +
                             ", \"peak_live\": " + std::to_string(t.peak_live);
  if (torch_peaks) {
    torch_row("PyTorch caching allocator (default)", torch_peaks->standard);
    torch_row("PyTorch, expandable_segments:True", torch_peaks->expandable);
    auto add = [&](const char* key, const std::optional<bench::pytorch_peak>& p) {
      if (!p) return;
      trace_fields += std::string(", \"pytorch_") + key + "_max_reserved\": " + std::to_string(p->max_reserved) +
                      ", \"pytorch_" + key + "_max_allocated\": " + std::to_string(p->max_allocated) + ", \"pytorch_" +
                      key + "_device_used_peak\": " + std::to_string(p->device_used_peak) + ", \"pytorch_" + key +
                      "_step_time_s\": " + std::to_string(p->step_time_s);
    };
    add("default", torch_peaks->standard);
    add("expandable", torch_peaks->expandable);
  }
  if (!turn.failed.empty()) {
    std::printf("  warm passes in turn: FAILED, %s\n", turn.failed.c_str());
    ok = false;
  } else {
    const auto [lo, hi] = std::minmax_element(turn.ratio.begin(), turn.ratio.end());
    std::printf("  warm passes in turn (%d pairs), streamalloc (default) over cudaMallocAsync: %.3f, the median of the\n"
                "  pairs' ratios (%.3f..%.3f); ns/op %.1f against %.1f (medians)\n",
                turns, bench::median(turn.ratio), *lo, *hi, bench::median(turn.ours_ns), bench::median(turn.driver_ns));
    rows.add("trace_" + t.name + "_in_turn",
             "\"pairs\": " + std::to_string(turns) + ", \"ratio_median\": " + std::to_string(bench::median(turn.ratio)) +
                 ", \"ratio_min\": " + std::to_string(*lo) + ", \"ratio_max\": " + std::to_string(*hi) +
                 ", \"streamalloc_ns_per_op\": " + std::to_string(bench::median(turn.ours_ns)) +
                 ", \"cudaMallocAsync_ns_per_op\": " + std::to_string(bench::median(turn.driver_ns)));
  }
  rows.add("trace_" + t.name, trace_fields);
  for (auto& s : streams) s.synchronize();
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  std::string traces_dir = STREAMALLOC_TRACES_DIR;
  int reps = 3;
  int warm = 5;
  int turns = 9;
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (!std::strcmp(argv[i], "--traces") && i + 1 < argc) traces_dir = argv[++i];
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--warm") && i + 1 < argc) warm = std::max(1, std::atoi(argv[++i]));
    else if (!std::strcmp(argv[i], "--turns") && i + 1 < argc) turns = std::max(1, std::atoi(argv[++i]));
    else if (argv[i][0] == '-') {
      std::fprintf(stderr, "usage: bench_trace_replay [--json FILE] [--traces DIR] [--reps N] [--warm N] [--turns N] [trace files or folders...]\n");
      return 2;
    } else {
      args.emplace_back(argv[i]);
    }
  }
  const std::vector<std::string> files = args.empty() ? bench::trace_files_in(traces_dir) : bench::expand_trace_paths(args);
  if (files.empty()) {
    std::fprintf(stderr, "bench_trace_replay: no traces in %s (record them on a GPU machine with "
                         "python3 bench/traces/record.py)\n",
                 args.empty() ? traces_dir.c_str() : "the folders given");
    return 1;
  }
  // Read and check every trace before touching the GPU, so that a bad file is said at once.
  std::vector<bench::recorded_trace> traces;
  int load_failures = 0;
  for (const auto& f : files) {
    try {
      traces.push_back(bench::load_trace(f));
    } catch (const bench::trace_error& e) {
      std::fprintf(stderr, "bench_trace_replay: error: %s\n", e.what());
      ++load_failures;
    }
  }
  if (traces.empty()) return 1;
  bench::require_gpu("bench_trace_replay");
  BENCH_CHECK(cudaSetDevice(0));
  BENCH_CHECK(cudaFree(nullptr));
  const bench::gpu_info gpu = bench::describe_gpu();
  std::printf("%zu trace%s; reserved high over the trace's peak live bytes; host ns per operation: first, the median of %d replays; again, the median of their %d warm passes each\n",
              traces.size(), traces.size() == 1 ? "" : "s", reps, warm);
  int failures = 0;
  for (const auto& t : traces) {
    if (!replay_trace(t, reps, warm, turns, traces_dir)) ++failures;
  }
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"bench\": \"trace_replay\",\n  \"gpu\": \"" << bench::json_escape(gpu.name) << "\",\n  \"driver\": " << gpu.driver
        << ",\n  \"runtime\": " << gpu.runtime << ",\n  \"reps\": " << reps << ",\n  \"warm_passes\": " << warm << ",\n  \"rows\": [\n"
        << rows.str() << "\n  ]\n}\n";
    std::printf("\nwrote %s\n", json.c_str());
  }
  if (load_failures) std::fprintf(stderr, "bench_trace_replay: %d trace%s could not be read (above)\n", load_failures, load_failures == 1 ? "" : "s");
  if (failures) std::fprintf(stderr, "bench_trace_replay: an allocator failed on %d trace%s (above)\n", failures, failures == 1 ? "" : "s");
  return load_failures || failures ? 1 : 0;
}
