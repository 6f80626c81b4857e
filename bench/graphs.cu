// streamalloc's allocations inside CUDA graphs beside the driver's graph memory nodes
// (cudaMallocAsync / cudaFreeAsync captured into a graph), in one process, as ratios. streamalloc
// is used through its ordinary API: `pool.allocate` / `pool.deallocate` on a stream being
// captured return and free graph-owned memory at addresses fixed for the graph's life, and its
// graphs are instantiated and launched through `streamalloc::graph_exec` (section 1 also times a
// raw cudaGraphInstantiate of the same graph, which keeps the user object holding the memory).
//   1. freed     N blocks (1 MiB .. 256 B) allocated, each written by a kernel, all freed, in one
//                captured graph: capture, instantiate, first launch (fresh exec, and after
//                cudaGraphUpload), steady launch (host enqueue, device time between events)
//   2. unfreed   the same graphs without their frees, launched again and again (the driver's
//                instantiated with cudaGraphInstantiateFlagAutoFreeOnLaunch)
//   3. reserved  the memory held for K graphs of 64 MiB each, launched in turn into one stream
//   4. pairs     allocate + free 4 KiB outside any capture (what detecting a capture costs;
//                bench_pool's section 1 measures the same pair the same way)
//
//   bench_graphs [--quick] [--json FILE] [--only freed,unfreed,reserved,pairs]
//                [--capture-mode global|thread|relaxed]      (default global, CUDA's default)

#include <streamalloc/captured_graph.hpp>
#include <streamalloc/graph_exec.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include "bench_common.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace {

using bench::clk;
using bench::seconds_since;
constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;
bool quick = false;
cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;
bench::json_rows rows;

void json_row(const std::string& name, const std::string& fields) { rows.add(name, fields); }
std::string field(const std::string& key, double v) { return "\"" + key + "\": " + std::to_string(v); }

// --- the graphs' kernels and their check ------------------------------------------------------

// Each graph launch first bumps this counter and the fills write a pattern that depends on it:
// a check after a relaunch then sees words written by that launch, not words an earlier launch
// left at the same fixed address.
__device__ unsigned launch_generation = 0;

__global__ void next_generation() { ++launch_generation; }

__host__ __device__ inline std::uint32_t pattern(std::uint32_t tag, std::uint32_t gen, std::size_t j) {
  return (tag * 0x9E3779B1u + gen * 0x85EBCA6Bu) ^ static_cast<std::uint32_t>(j);
}

__global__ void fill(std::uint32_t* p, std::size_t words, std::uint32_t tag) {
  const std::uint32_t gen = launch_generation;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < words; i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = pattern(tag, gen, i);
  }
}

// counts[0]: words that differ from the pattern; counts[1]: words checked (so a check that did
// not run, or ran over too little, fails too).
__global__ void check(const std::uint32_t* p, std::size_t words, std::uint32_t tag, unsigned long long* counts) {
  const std::uint32_t gen = launch_generation;
  unsigned long long bad = 0, seen = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < words; i += std::size_t{gridDim.x} * blockDim.x) {
    bad += p[i] != pattern(tag, gen, i);
    ++seen;
  }
  if (seen != 0) {
    atomicAdd(&counts[0], bad);
    atomicAdd(&counts[1], seen);
  }
}

unsigned grid_for(std::size_t words) { return static_cast<unsigned>(std::min<std::size_t>((words + 255) / 256, 1024)); }

/// Checks blocks written by `fill` (block i with tag i + 1): every word of every block on the
/// device, and block 0 once more on the host, read back through a copy into pinned memory (so
/// the copy may be captured into a graph).
class checker {
 public:
  static constexpr std::size_t host_bytes = 8 * MiB;
  checker() {
    BENCH_CHECK(cudaMalloc(&counts_, 2 * sizeof(unsigned long long)));
    BENCH_CHECK(cudaMallocHost(&host_, host_bytes));
  }
  ~checker() {
    cudaFree(counts_);
    cudaFreeHost(host_);
  }
  checker(const checker&) = delete;
  checker& operator=(const checker&) = delete;

  /// Clears the counts and the host copy; outside any capture.
  void reset(cudaStream_t s) const {
    BENCH_CHECK(cudaStreamSynchronize(s));  // no copy into host_ may still be pending
    std::memset(host_, 0, host_bytes);
    BENCH_CHECK(cudaMemsetAsync(counts_, 0, 2 * sizeof(unsigned long long), s));
  }

  /// Enqueues the checks on `s`, captured or not: after all the fills, so blocks that overlap
  /// (one fill overwriting another's block) fail too.
  void enqueue(cudaStream_t s, const std::vector<void*>& blocks, const std::vector<std::size_t>& sizes) const {
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      check<<<grid_for(sizes[i] / 4), 256, 0, s>>>(static_cast<const std::uint32_t*>(blocks[i]), sizes[i] / 4,
                                                   static_cast<std::uint32_t>(i + 1), counts_);
      BENCH_CHECK(cudaGetLastError());
    }
    BENCH_CHECK(cudaMemcpyAsync(host_, blocks[0], std::min(sizes[0], host_bytes), cudaMemcpyDeviceToHost, s));
  }

  /// Exits, saying what was wrong, unless `words` words were checked and all matched, and the
  /// host copy of block 0 holds the latest launch's pattern.
  void verify(cudaStream_t s, const std::string& what, std::size_t words, std::size_t block0_bytes) const {
    BENCH_CHECK(cudaStreamSynchronize(s));
    unsigned long long got[2] = {0, 0};
    BENCH_CHECK(cudaMemcpy(got, counts_, sizeof got, cudaMemcpyDeviceToHost));
    unsigned gen = 0;
    BENCH_CHECK(cudaMemcpyFromSymbol(&gen, launch_generation, sizeof gen));
    const std::size_t host_words = std::min(block0_bytes, host_bytes) / 4;
    std::size_t host_bad = 0;
    for (std::size_t j = 0; j < host_words; ++j) host_bad += host_[j] != pattern(1, gen, j);
    if (got[0] != 0 || got[1] != words || host_bad != 0) {
      std::fprintf(stderr,
                   "bench_graphs: wrong results (%s): %llu of %llu words differ on the device (%zu should have been "
                   "checked), %zu of block 0's %zu words read back differ\n",
                   what.c_str(), got[0], got[1], words, host_bad, host_words);
      std::exit(1);
    }
  }

 private:
  unsigned long long* counts_ = nullptr;
  std::uint32_t* host_ = nullptr;
};

// --- capturing the graphs ---------------------------------------------------------------------

/// Who allocates inside the capture: a streamalloc pool, or (nullptr) the driver's memory nodes.
const char* who(const streamalloc::pool* pool) { return pool ? "streamalloc" : "cudaMallocAsync"; }

/// Sizes cycling 1 MiB, 512 KiB, ..., 256 B, so block 0 is always the largest.
std::vector<std::size_t> mixed_sizes(int n) {
  std::vector<std::size_t> sizes;
  for (int i = 0; i < n; ++i) sizes.push_back((1 * MiB) >> (i % 13));
  return sizes;
}

std::size_t words_of(const std::vector<std::size_t>& sizes) {
  std::size_t w = 0;
  for (std::size_t z : sizes) w += z / 4;
  return w;
}

/// Captures on `s`: the generation bump, every block allocated and written by its own kernel,
/// the checks if `chk` is given, then every block freed in the graph unless `free_blocks` is
/// false. `blocks` gets the graph's addresses (fixed for its life, for both allocators).
streamalloc::captured_graph capture(streamalloc::pool* pool, const streamalloc::stream& s,
                                    const std::vector<std::size_t>& sizes, bool free_blocks, const checker* chk,
                                    std::vector<void*>& blocks) {
  blocks.assign(sizes.size(), nullptr);
  BENCH_CHECK(cudaStreamBeginCapture(s.get(), capture_mode));
  next_generation<<<1, 1, 0, s.get()>>>();
  BENCH_CHECK(cudaGetLastError());
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (pool) blocks[i] = pool->allocate(sizes[i], s);
    else BENCH_CHECK(cudaMallocAsync(&blocks[i], sizes[i], s.get()));
    fill<<<grid_for(sizes[i] / 4), 256, 0, s.get()>>>(static_cast<std::uint32_t*>(blocks[i]), sizes[i] / 4,
                                                      static_cast<std::uint32_t>(i + 1));
    BENCH_CHECK(cudaGetLastError());
  }
  if (chk) chk->enqueue(s.get(), blocks, sizes);
  if (free_blocks) {
    for (void* p : blocks) {
      if (pool) pool->deallocate(p, s);
      else BENCH_CHECK(cudaFreeAsync(p, s.get()));
    }
  }
  return streamalloc::end_capture(s);  // as cudaStreamEndCapture, knowing streamalloc's memory in it
}

cudaGraphExec_t instantiate(cudaGraph_t g, unsigned long long flags = 0) {
  cudaGraphExec_t e = nullptr;
  BENCH_CHECK(cudaGraphInstantiate(&e, g, flags));
  return e;
}

/// An executable made the way each side is meant to be used: streamalloc's graphs through
/// `graph_exec` (`ours`), the driver's with cudaGraphInstantiate (`raw`), or streamalloc's with
/// cudaGraphInstantiate too when `raw_for_streamalloc` (to show what the user object costs).
struct executable {
  streamalloc::graph_exec ours;
  cudaGraphExec_t raw = nullptr;

  executable(const streamalloc::captured_graph& g, bool streamalloc, unsigned long long flags = 0,
             bool raw_for_streamalloc = false) {
    if (streamalloc && !raw_for_streamalloc) {
      ours = streamalloc::graph_exec(g, flags);
    } else {
      raw = instantiate(g.get(), flags);
    }
  }
  executable(const executable&) = delete;
  executable& operator=(const executable&) = delete;
  ~executable() {
    if (raw != nullptr) BENCH_CHECK(cudaGraphExecDestroy(raw));
  }
  void launch(cudaStream_t s) {
    if (raw != nullptr) {
      BENCH_CHECK(cudaGraphLaunch(raw, s));
    } else {
      ours.launch(streamalloc::stream_ref{s});
    }
  }
  void upload(cudaStream_t s) {
    if (raw != nullptr) {
      BENCH_CHECK(cudaGraphUpload(raw, s));
    } else {
      ours.upload(streamalloc::stream_ref{s});
    }
  }
};

struct steady_times {
  double enqueue_us = 0;  ///< host time to enqueue one launch
  double device_us = 0;   ///< device time per launch, between events around a loop of launches
};

/// Launches `e` back to back into `s`, in loops of 50, after a warm-up. The loops are short so
/// that the host seldom waits for room in the launch queue, which would make it time the device.
steady_times steady(executable& e, cudaStream_t s) {
  constexpr int per_loop = 50;
  for (int i = 0; i < 10; ++i) e.launch(s);
  BENCH_CHECK(cudaStreamSynchronize(s));
  std::vector<double> host;
  const std::vector<double> ms = bench::time_ms(s, quick ? 5 : 30, [&] {
    const auto t = clk::now();
    for (int i = 0; i < per_loop; ++i) e.launch(s);
    host.push_back(seconds_since(t) * 1e6 / per_loop);
  });
  return {bench::median(host), bench::median(ms) * 1e3 / per_loop};
}

/// Host time of one launch until the stream has finished it.
double launch_and_wait_us(executable& e, cudaStream_t s) {
  const auto t = clk::now();
  e.launch(s);
  BENCH_CHECK(cudaStreamSynchronize(s));
  return seconds_since(t) * 1e6;
}

/// One printed row and two JSON fields of a measure, streamalloc beside the driver (the ratio
/// is driver / streamalloc: above 1, streamalloc is faster).
struct measure {
  const char* label;
  const char* key;
  double ours = 0, driver = 0;
};

void print_measures(const std::string& row, const std::string& n, const std::vector<measure>& ms, const std::string& extra) {
  std::string fields = extra;
  for (const measure& m : ms) {
    std::printf("%8s  %-32s %12.2f %12.2f %9.2fx\n", n.c_str(), m.label, m.ours, m.driver, m.driver / m.ours);
    fields += ", " + field(std::string("streamalloc_") + m.key + "_us", m.ours) + ", " +
              field(std::string("cudaMallocAsync_") + m.key + "_us", m.driver);
  }
  json_row(row, fields);
}

/// Closes a pool, saying whether graph memory came back: once its graphs and execs are gone, a
/// pool should hold no live allocation.
void close_pool(streamalloc::pool& pool, const char* section) {
  const auto st = pool.statistics();
  const streamalloc::pool_close_report r = pool.close();
  std::printf("   streamalloc pool at the end of %s: %.1f MiB reserved; %zu allocations (%zu bytes) live at close\n", section,
              double(st.reserved_current) / MiB, r.live_allocations, r.live_bytes);
  json_row(std::string(section) + "_pool_at_close", "\"reserved_bytes\": " + std::to_string(st.reserved_current) +
                                                        ", \"live_allocations\": " + std::to_string(r.live_allocations) +
                                                        ", \"live_bytes\": " + std::to_string(r.live_bytes));
}

// --- 1. graphs that allocate, write and free ----------------------------------------------------

void freed_graphs() {
  std::printf("\n1. N blocks (1 MiB, 512 KiB, ..., 256 B) allocated on one captured stream, each written by a kernel,\n"
              "   all freed in the graph: us, medians (first launch: host time until the stream is done)\n");
  std::printf("%8s  %-32s %12s %12s %10s\n", "N", "measure", "streamalloc", "mem nodes", "driver/ours");
  streamalloc::pool pool(bench::kept());
  streamalloc::stream s(0);
  checker chk;
  const int reps = quick ? 5 : 25;
  for (int n : {1, 16, 256}) {
    const std::vector<std::size_t> sizes = mixed_sizes(n);
    std::vector<void*> blocks;
    streamalloc::pool* const allocators[2] = {&pool, nullptr};
    // Checked once per configuration, in a graph with the checks added: launched twice, so the
    // second launch shows a relaunch writing its own pattern at the graph's fixed addresses.
    for (streamalloc::pool* a : allocators) {
      const streamalloc::captured_graph g = capture(a, s, sizes, true, &chk, blocks);
      executable e(g, a != nullptr);
      for (int launch = 0; launch < 2; ++launch) {
        chk.reset(s.get());
        e.launch(s.get());
        chk.verify(s.get(), std::string(who(a)) + ", freed, N=" + std::to_string(n), words_of(sizes), sizes[0]);
      }
    }
    // The two allocators interleaved, so that both see the same moments of the machine.
    std::vector<double> cap[2], inst[2], both[2], first[2], uploaded[2];
    for (int r = 0; r < reps; ++r) {
      for (int k = 0; k < 2; ++k) {
        for (bool upload : {false, true}) {
          auto t = clk::now();
          const streamalloc::captured_graph g = capture(allocators[k], s, sizes, true, nullptr, blocks);
          const double c = seconds_since(t) * 1e6;
          t = clk::now();
          executable e(g, k == 0);
          const double i = seconds_since(t) * 1e6;
          cap[k].push_back(c);
          inst[k].push_back(i);
          both[k].push_back(c + i);
          if (upload) {
            e.upload(s.get());
            BENCH_CHECK(cudaStreamSynchronize(s.get()));
          }
          (upload ? uploaded : first)[k].push_back(launch_and_wait_us(e, s.get()));
        }
      }
    }
    steady_times st[3];  // streamalloc through graph_exec, the driver, streamalloc raw
    for (int k = 0; k < 3; ++k) {
      const streamalloc::captured_graph g = capture(allocators[k % 2], s, sizes, true, nullptr, blocks);
      executable e(g, k != 1, 0, k == 2);
      st[k] = steady(e, s.get());
    }
    using bench::median;
    print_measures("freed_N" + std::to_string(n), std::to_string(n),
                   {{"capture", "capture", median(cap[0]), median(cap[1])},
                    {"instantiate", "instantiate", median(inst[0]), median(inst[1])},
                    {"capture + instantiate", "capture_instantiate", median(both[0]), median(both[1])},
                    {"first launch, fresh exec", "first_launch", median(first[0]), median(first[1])},
                    {"first launch after upload", "first_launch_uploaded", median(uploaded[0]), median(uploaded[1])},
                    {"steady launch, host enqueue", "steady_enqueue", st[0].enqueue_us, st[1].enqueue_us},
                    {"steady launch, device (events)", "steady_device", st[0].device_us, st[1].device_us},
                    {"steady, raw exec: host enqueue", "steady_raw_enqueue", st[2].enqueue_us, st[1].enqueue_us}},
                   "\"blocks\": " + std::to_string(n) + ", \"bytes\": " + std::to_string(words_of(sizes) * 4));
  }
  BENCH_CHECK(cudaDeviceSynchronize());
  close_pool(pool, "freed");
}

// --- 2. graphs that leave their blocks allocated ------------------------------------------------

void unfreed_graphs() {
  std::printf("\n2. the same graphs without their frees, launched again and again, both instantiated with\n"
              "   AutoFreeOnLaunch (each launch frees the last one's blocks; streamalloc's make them again at\n"
              "   the same fixed addresses): steady launch, us\n");
  std::printf("%8s  %-32s %12s %12s %10s\n", "N", "measure", "streamalloc", "mem nodes", "driver/ours");
  streamalloc::pool pool(bench::kept());
  streamalloc::stream s(0);
  checker chk;
  for (int n : {1, 16, 256}) {
    const std::vector<std::size_t> sizes = mixed_sizes(n);
    std::vector<void*> blocks;
    steady_times st[2];
    int k = 0;
    for (streamalloc::pool* a : {&pool, static_cast<streamalloc::pool*>(nullptr)}) {
      streamalloc::captured_graph g = capture(a, s, sizes, false, nullptr, blocks);
      executable e(g, a != nullptr, cudaGraphInstantiateFlagAutoFreeOnLaunch);
      st[k++] = steady(e, s.get());
      // After all those launches the blocks still hold the last launch's pattern at the
      // addresses the capture returned: checked outside the graph.
      chk.reset(s.get());
      chk.enqueue(s.get(), blocks, sizes);
      chk.verify(s.get(), std::string(who(a)) + ", unfreed, N=" + std::to_string(n), words_of(sizes), sizes[0]);
      // The driver's last launch's blocks outlive the exec until freed; streamalloc's go with
      // the graph and its exec.
      if (!a) {
        for (void* p : blocks) BENCH_CHECK(cudaFreeAsync(p, s.get()));
        BENCH_CHECK(cudaStreamSynchronize(s.get()));
      }
    }
    print_measures("unfreed_N" + std::to_string(n), std::to_string(n),
                   {{"steady launch, host enqueue", "steady_enqueue", st[0].enqueue_us, st[1].enqueue_us},
                    {"steady launch, device (events)", "steady_device", st[0].device_us, st[1].device_us}},
                   "\"blocks\": " + std::to_string(n) + ", \"bytes\": " + std::to_string(words_of(sizes) * 4));
  }
  BENCH_CHECK(cudaDeviceSynchronize());
  close_pool(pool, "unfreed");
}

// --- 3. memory held for several graphs ----------------------------------------------------------

std::uint64_t driver_graph_reserved() {
  std::uint64_t v = 0;
  BENCH_CHECK(cudaDeviceGetGraphMemAttribute(0, cudaGraphMemAttrReservedMemCurrent, &v));
  return v;
}

/// Captures `k` graphs that each allocate, write, check and free 64 MiB in 8 blocks, each
/// instantiated the way its side is meant to be used (streamalloc's through graph_exec, the
/// graph dropped after: the executable alone holds the memory, which lets graphs of one stream
/// share it), launches them in turn into `s` and verifies every launch's results. The first
/// round may find a dropped graph's user object not yet released (the driver runs its
/// destructor on a thread of its own), and leave that graph's memory where it is; so one round,
/// a short pause, and two more.
void launch_k_graphs(streamalloc::pool* pool, const streamalloc::stream& s, int k, const checker& chk,
                     std::vector<std::unique_ptr<executable>>& execs) {
  const std::vector<std::size_t> sizes(8, 8 * MiB);
  std::vector<void*> blocks;
  for (int i = 0; i < k; ++i) {
    const streamalloc::captured_graph g = capture(pool, s, sizes, true, &chk, blocks);
    execs.push_back(std::make_unique<executable>(g, pool != nullptr));
  }
  chk.reset(s.get());
  for (int round = 0; round < 3; ++round) {
    for (auto& e : execs) e->launch(s.get());
    if (round == 0) {
      BENCH_CHECK(cudaStreamSynchronize(s.get()));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  chk.verify(s.get(), std::string(who(pool)) + ", reserved, K=" + std::to_string(k), 3 * k * words_of(sizes), sizes[0]);
}

void reserved_memory() {
  std::printf("\n3. memory held for K graphs, each allocating 64 MiB (8 blocks of 8 MiB), writing and freeing it,\n"
              "   launched in turn into one stream (three rounds): MiB (driver: its graph memory's reservedMemCurrent\n"
              "   after cudaDeviceGraphMemTrim; streamalloc: the growth of a fresh pool's reserved_current)\n");
  std::printf("%8s %14s %14s %12s\n", "K", "streamalloc", "mem nodes", "driver/ours");
  streamalloc::stream s(0);
  checker chk;
  for (int k : {1, 4, 16}) {
    std::vector<std::unique_ptr<executable>> execs;
    auto destroy_all = [&] {
      execs.clear();
      BENCH_CHECK(cudaDeviceSynchronize());
    };
    // The driver: its graph memory is per device and kept after use, so give it all back first.
    BENCH_CHECK(cudaDeviceSynchronize());
    BENCH_CHECK(cudaDeviceGraphMemTrim(0));
    const std::uint64_t driver_before = driver_graph_reserved();
    launch_k_graphs(nullptr, s, k, chk, execs);
    const std::uint64_t driver_after = driver_graph_reserved();
    const std::uint64_t driver_bytes = driver_after > driver_before ? driver_after - driver_before : 0;
    destroy_all();
    BENCH_CHECK(cudaDeviceGraphMemTrim(0));

    std::size_t ours_bytes = 0;
    {
      streamalloc::pool pool(bench::kept());
      const std::size_t before = pool.statistics().reserved_current;
      launch_k_graphs(&pool, s, k, chk, execs);
      ours_bytes = pool.statistics().reserved_current - before;
      destroy_all();
      const streamalloc::pool_close_report r = pool.close();
      if (r.live_allocations != 0) {
        std::printf("   (K=%d: %zu streamalloc graph allocations, %zu bytes, still live once the graphs were gone)\n", k,
                    r.live_allocations, r.live_bytes);
      }
    }
    std::printf("%8d %14.1f %14.1f %11.2fx\n", k, double(ours_bytes) / MiB, double(driver_bytes) / MiB,
                double(driver_bytes) / double(ours_bytes));
    json_row("reserved_K" + std::to_string(k), "\"graphs\": " + std::to_string(k) + ", \"graph_bytes\": " +
                                                   std::to_string(64 * MiB) + ", \"streamalloc_reserved_bytes\": " +
                                                   std::to_string(ours_bytes) + ", \"cudaMallocAsync_reserved_bytes\": " +
                                                   std::to_string(driver_bytes));
  }
}

// --- 4. the pair outside capture ----------------------------------------------------------------

// As bench_pool's section 1 (same pools, warm-up and loop), at 4 KiB only: every allocate now
// asks whether its stream is capturing, and this is where that cost shows.
void pairs_outside_capture() {
  std::printf("\n4. allocate + free 4 KiB on one ordinary stream (no capture), ns per pair (warm pools)\n");
  std::printf("%10s %12s %12s %12s %10s\n", "size", "streamalloc", "(raw handle)", "MallocAsync", "vs Async");
  streamalloc::pool pool(bench::kept());
  streamalloc::stream s(0);
  cudaMemPool_t dp = bench::make_driver_pool();
  const int n = quick ? 20000 : 200000;
  const std::size_t size = 4 * KiB;
  auto time_pairs = [&](auto&& pair) {
    for (int i = 0; i < 1000; ++i) pair();  // warm
    auto t = clk::now();
    for (int i = 0; i < n; ++i) pair();
    return seconds_since(t) * 1e9 / n;
  };
  const double ours = time_pairs([&] { pool.deallocate(pool.allocate(size, s), s); });
  const streamalloc::stream_ref raw{s.get()};
  const double ours_raw = time_pairs([&] { pool.deallocate(pool.allocate(size, raw), raw); });
  const double async = time_pairs([&] {
    void* p;
    BENCH_CHECK(cudaMallocFromPoolAsync(&p, size, dp, s.get()));
    BENCH_CHECK(cudaFreeAsync(p, s.get()));
  });
  std::printf("%10zu %12.1f %12.1f %12.1f %9.2fx\n", size, ours, ours_raw, async, async / ours);
  json_row("pair_" + std::to_string(size), "\"streamalloc_ns\": " + std::to_string(ours) + ", \"streamalloc_raw_handle_ns\": " +
                                               std::to_string(ours_raw) + ", \"cudaMallocAsync_ns\": " + std::to_string(async));
  s.synchronize();
  BENCH_CHECK(cudaMemPoolDestroy(dp));
}

}  // namespace

int main(int argc, char** argv) {
  bench::require_gpu("bench_graphs");
  std::string json, only, mode = "global";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--capture-mode") && i + 1 < argc) mode = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_graphs [--quick] [--json FILE] [--only freed,unfreed,reserved,pairs]\n"
                           "                    [--capture-mode global|thread|relaxed]\n");
      return 2;
    }
  }
  if (mode == "global") capture_mode = cudaStreamCaptureModeGlobal;
  else if (mode == "thread") capture_mode = cudaStreamCaptureModeThreadLocal;
  else if (mode == "relaxed") capture_mode = cudaStreamCaptureModeRelaxed;
  else {
    std::fprintf(stderr, "bench_graphs: --capture-mode is global, thread or relaxed, not '%s'\n", mode.c_str());
    return 2;
  }
  BENCH_CHECK(cudaSetDevice(0));
  BENCH_CHECK(cudaFree(nullptr));
  const bench::gpu_info gpu = bench::describe_gpu();
  std::printf("capture mode: %s\n", mode.c_str());
  // Whole names only: "freed" is a substring of "unfreed".
  auto want = [&](const std::string& k) { return only.empty() || ("," + only + ",").find("," + k + ",") != std::string::npos; };
  // A pool refusing an allocation inside a capture throws; say what it said rather than let
  // the exception end the process unexplained.
  try {
    if (want("freed")) freed_graphs();
    if (want("unfreed")) unfreed_graphs();
    if (want("reserved")) reserved_memory();
    if (want("pairs")) pairs_outside_capture();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_graphs: %s\n", e.what());
    return 1;
  }
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"bench\": \"graphs\",\n  \"gpu\": \"" << bench::json_escape(gpu.name) << "\",\n  \"driver\": " << gpu.driver
        << ",\n  \"runtime\": " << gpu.runtime << ",\n  \"quick\": " << (quick ? "true" : "false")
        << ",\n  \"capture_mode\": \"" << mode << "\",\n  \"rows\": [\n"
        << rows.str() << "\n  ]\n}\n";
    std::printf("\nwrote %s\n", json.c_str());
  }
  return 0;
}
