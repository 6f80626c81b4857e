// streamalloc's pool beside cudaMallocAsync, cudaMalloc and CUB's CachingDeviceAllocator, in one
// process, on the same GPU, as ratios. Host time per operation is measured without device
// synchronization inside timed loops (allocation is a host-side cost for all four).
//
//   bench_pool [--quick] [--json FILE] [--only SECTIONS]
//   bench_pool --solo CPU START_MS SECONDS     (one process of scripts/scaling-processes.sh)

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include "bench_common.hpp"
#include "thread_rate.hpp"
#include "trace.hpp"

#include <cub/util_allocator.cuh>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {
using bench::clk;
using bench::seconds_since;
constexpr std::size_t KiB = 1024, MiB = KiB * 1024, GiB = MiB * 1024;
bool quick = false;
bench::json_rows rows;

void json_row(const std::string& name, const std::string& fields) { rows.add(name, fields); }



// --- 1. same-stream pairs -------------------------------------------------------------------

void same_stream_pairs() {
  std::printf("\n1. allocate + free on one stream, ns per pair (warm pools)\n");
  std::printf("%10s %12s %12s %12s %12s %10s %10s\n", "size", "streamalloc", "(raw handle)", "MallocAsync",
              "CUB", "vs Async", "vs CUB");
  streamalloc::pool pool(bench::kept());
  streamalloc::stream s(0);
  cudaMemPool_t dp = bench::make_driver_pool();
  cub::CachingDeviceAllocator cub_alloc(8, 3, 9, 4 * GiB);  // bins to 128 MiB, so 16 MiB is cached
  const int n = quick ? 20000 : 200000;
  for (std::size_t size : {256ul, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB}) {
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
    const double cub = time_pairs([&] {
      void* p;
      BENCH_CHECK(cub_alloc.DeviceAllocate(&p, size, s.get()));
      BENCH_CHECK(cub_alloc.DeviceFree(p));
    });
    std::printf("%10zu %12.1f %12.1f %12.1f %12.1f %9.2fx %9.2fx\n", size, ours, ours_raw, async, cub, async / ours, cub / ours);
    json_row("pair_" + std::to_string(size), "\"streamalloc_ns\": " + std::to_string(ours) + ", \"streamalloc_raw_handle_ns\": " +
                                                 std::to_string(ours_raw) + ", \"cudaMallocAsync_ns\": " + std::to_string(async) +
                                                 ", \"cub_ns\": " + std::to_string(cub));
  }
  {
    const int m = quick ? 50 : 300;
    auto t = clk::now();
    for (int i = 0; i < m; ++i) {
      void* p;
      BENCH_CHECK(cudaMalloc(&p, 1 * MiB));
      BENCH_CHECK(cudaFree(p));
    }
    const double malloc_ns = seconds_since(t) * 1e9 / m;
    std::printf("   cudaMalloc + cudaFree, 1 MiB: %.0f ns a pair\n", malloc_ns);
    json_row("pair_cudaMalloc_1MiB", "\"cudaMalloc_ns\": " + std::to_string(malloc_ns));
  }
  s.synchronize();
  BENCH_CHECK(cudaMemPoolDestroy(dp));
}

// --- 2. 1000 live mixed sizes, then 1000 frees ------------------------------------------------

void mixed_rounds() {
  std::printf("\n2. 1000 live allocations of mixed sizes (256 B .. 1 MiB), then 1000 frees: us per round\n");
  std::mt19937_64 rng(42);
  std::vector<std::size_t> sizes(1000);
  for (auto& z : sizes) z = static_cast<std::size_t>(std::exp2(std::uniform_real_distribution<double>(8, 20)(rng)));
  streamalloc::pool pool(bench::kept());
  streamalloc::stream s(0);
  cudaMemPool_t dp = bench::make_driver_pool();
  cub::CachingDeviceAllocator cub_alloc(8, 3, 9, 4 * GiB);
  std::vector<void*> ptrs(sizes.size());
  const int rounds = quick ? 20 : 200;
  auto time_rounds = [&](auto&& alloc, auto&& free) {
    for (int r = 0; r < 3; ++r) {  // warm
      for (std::size_t i = 0; i < sizes.size(); ++i) ptrs[i] = alloc(sizes[i]);
      for (void* p : ptrs) free(p);
    }
    std::vector<double> us;
    for (int r = 0; r < rounds; ++r) {
      auto t = clk::now();
      for (std::size_t i = 0; i < sizes.size(); ++i) ptrs[i] = alloc(sizes[i]);
      for (void* p : ptrs) free(p);
      us.push_back(seconds_since(t) * 1e6);
    }
    return bench::median(us);
  };
  const double ours = time_rounds([&](std::size_t z) { return pool.allocate(z, s); }, [&](void* p) { pool.deallocate(p, s); });
  const double async = time_rounds(
      [&](std::size_t z) {
        void* p;
        BENCH_CHECK(cudaMallocFromPoolAsync(&p, z, dp, s.get()));
        return p;
      },
      [&](void* p) { BENCH_CHECK(cudaFreeAsync(p, s.get())); });
  const double cub = time_rounds(
      [&](std::size_t z) {
        void* p;
        BENCH_CHECK(cub_alloc.DeviceAllocate(&p, z, s.get()));
        return p;
      },
      [&](void* p) { BENCH_CHECK(cub_alloc.DeviceFree(p)); });
  std::printf("   streamalloc %.1f us, cudaMallocAsync %.1f us (%.2fx), CUB %.1f us (%.2fx)\n", ours, async, async / ours,
              cub, cub / ours);
  json_row("mixed_1000", "\"streamalloc_us\": " + std::to_string(ours) + ", \"cudaMallocAsync_us\": " + std::to_string(async) +
                             ", \"cub_us\": " + std::to_string(cub));
  s.synchronize();
  BENCH_CHECK(cudaMemPoolDestroy(dp));
}

// --- 3. threads on their own streams --------------------------------------------------------

void threads_own_streams() {
  std::vector<int> cores = bench::one_cpu_per_core();
  // STREAMALLOC_BENCH_CPUS="0 2 4 ..." pins thread i to the i-th CPU listed instead.
  if (const char* list = std::getenv("STREAMALLOC_BENCH_CPUS")) {
    std::istringstream in(list);
    cores.clear();
    for (int c; in >> c;) cores.push_back(c);
  }
  std::printf("\n3. threads allocating and freeing 4 KiB on their own streams: million pairs/s, all threads\n"
              "   together over the same window (%zu cores seen; up to that many threads each get one).\n"
              "   Controls: each thread with a pool of its own (shares nothing in the pool), and a CPU-only\n"
              "   loop of similar length (what the machine gives independent threads). 'slowest': the\n"
              "   slowest thread's count over the mean (1.00: every thread ran equally fast)\n",
              cores.size());
  std::printf("%8s %12s %12s %9s %9s %8s %10s %10s %12s\n", "threads", "streamalloc", "MallocAsync", "ratio", "scaling",
              "slowest", "own pools", "CPU-only", "vs CPU-only");
  streamalloc::pool pool(bench::kept());
  std::vector<std::unique_ptr<streamalloc::pool>> own;
  for (int i = 0; i < 16; ++i) own.push_back(std::make_unique<streamalloc::pool>(bench::kept()));
  cudaMemPool_t dp = bench::make_driver_pool();
  std::vector<streamalloc::stream> streams;
  for (int i = 0; i < 16; ++i) streams.emplace_back(0);
  std::vector<bench::cpu_only_work> work(16);
  const auto window = std::chrono::milliseconds(quick ? 10 : 50);
  const auto on_device = [](int) { BENCH_CHECK(cudaSetDevice(0)); };
  double ours1 = 0, own1 = 0, cpu1 = 0;
  for (int threads : {1, 2, 4, 8, 16}) {
    auto run = [&](auto&& op) { return bench::run_threads(threads, cores, window, on_device, op); };
    // Medians of five runs, interleaved so that the three see the same moments of the machine.
    std::vector<double> ours_runs, own_runs, cpu_runs, slowest;
    for (int r = 0; r < 5; ++r) {
      const bench::thread_rate o = run([&](int t) { pool.deallocate(pool.allocate(4 * KiB, streams[t]), streams[t]); });
      ours_runs.push_back(o.total);
      slowest.push_back(o.slowest_share);
      own_runs.push_back(run([&](int t) { own[t]->deallocate(own[t]->allocate(4 * KiB, streams[t]), streams[t]); }).total);
      cpu_runs.push_back(run([&](int t) { work[t](); }).total);
    }
    const double ours = bench::median(ours_runs), mine = bench::median(own_runs), cpu = bench::median(cpu_runs);
    const double async = run([&](int t) {
                           void* p;
                           BENCH_CHECK(cudaMallocFromPoolAsync(&p, 4 * KiB, dp, streams[t].get()));
                           BENCH_CHECK(cudaFreeAsync(p, streams[t].get()));
                         }).total;
    if (threads == 1) ours1 = ours, own1 = mine, cpu1 = cpu;
    std::printf("%8d %12.2f %12.2f %8.1fx %8.2fx %8.2f %9.2fx %9.2fx %12.2f\n", threads, ours, async, ours / async,
                ours / ours1, bench::median(slowest), mine / own1, cpu / cpu1, (ours / ours1) / (cpu / cpu1));
    json_row("threads_" + std::to_string(threads),
             "\"streamalloc_mpairs_s\": " + std::to_string(ours) + ", \"cudaMallocAsync_mpairs_s\": " + std::to_string(async) +
                 ", \"own_pools_mpairs_s\": " + std::to_string(mine) + ", \"cpu_only_mops_s\": " + std::to_string(cpu) +
                 ", \"slowest_share\": " + std::to_string(bench::median(slowest)));
  }
  for (auto& s : streams) s.synchronize();
  BENCH_CHECK(cudaMemPoolDestroy(dp));
}

// --- 4. cross-stream round --------------------------------------------------------------------

void cross_stream() {
  std::printf("\n4. allocate on A, record an event, B waits on it, free on B: ns per round\n");
  streamalloc::pool pool(bench::kept());
  streamalloc::stream a(0), b(0);
  streamalloc::event e;
  cudaMemPool_t dp = bench::make_driver_pool();
  cudaEvent_t re;
  BENCH_CHECK(cudaEventCreateWithFlags(&re, cudaEventDisableTiming));
  const int n = quick ? 5000 : 50000;
  auto time_rounds = [&](auto&& round) {
    for (int i = 0; i < 1000; ++i) round();
    BENCH_CHECK(cudaDeviceSynchronize());
    auto t = clk::now();
    for (int i = 0; i < n; ++i) round();
    const double ns = seconds_since(t) * 1e9 / n;
    BENCH_CHECK(cudaDeviceSynchronize());
    return ns;
  };
  const double ours = time_rounds([&] {
    void* p = pool.allocate(64 * KiB, a);
    e.record(a);
    b.wait(e);
    pool.deallocate(p, b);
  });
  const double async = time_rounds([&] {
    void* p;
    BENCH_CHECK(cudaMallocFromPoolAsync(&p, 64 * KiB, dp, a.get()));
    BENCH_CHECK(cudaEventRecord(re, a.get()));
    BENCH_CHECK(cudaStreamWaitEvent(b.get(), re, 0));
    BENCH_CHECK(cudaFreeAsync(p, b.get()));
  });
  const auto st = pool.statistics();
  std::printf("   streamalloc %.0f ns, cudaMallocAsync %.0f ns (%.2fx); streamalloc reserved %zu MiB after %d rounds\n",
              ours, async, async / ours, st.reserved_current / MiB, n);
  json_row("cross_stream_round", "\"streamalloc_ns\": " + std::to_string(ours) + ", \"cudaMallocAsync_ns\": " +
                                     std::to_string(async) + ", \"streamalloc_reserved_bytes\": " + std::to_string(st.reserved_current));
  BENCH_CHECK(cudaEventDestroy(re));
  BENCH_CHECK(cudaMemPoolDestroy(dp));
}

// --- 5. random trace: reserved memory against live bytes ---------------------------------------

using bench::make_trace;

void random_trace() {
  const std::size_t live_target = quick ? 1 * GiB : 8 * GiB;
  const int steps = quick ? 3000 : 20000;
  std::size_t peak = 0;
  const auto ops = make_trace(live_target, steps, peak);
  std::printf("\n5. random trace: sizes log-uniform 4 KiB..64 MiB, %zu GiB live, %d frees; peak live %.2f GiB\n",
              live_target / GiB, steps, double(peak) / GiB);
  std::printf("%-34s %16s %12s %10s\n", "allocator", "reserved high", "/ peak live", "seconds");
  streamalloc::stream s(0);
  std::vector<void*> ptr;
  auto run = [&](auto&& alloc, auto&& free) {
    ptr.assign(ops.size(), nullptr);
    auto t = clk::now();
    for (const auto& op : ops) {
      if (op.alloc) ptr[op.id] = alloc(op.size);
      else free(ptr[op.id]);
    }
    return seconds_since(t);
  };
  {
    cudaMemPool_t dp = bench::make_driver_pool();
    const double secs = run(
        [&](std::size_t z) {
          void* p;
          BENCH_CHECK(cudaMallocFromPoolAsync(&p, z, dp, s.get()));
          return p;
        },
        [&](void* p) { BENCH_CHECK(cudaFreeAsync(p, s.get())); });
    std::uint64_t high = 0;
    BENCH_CHECK(cudaMemPoolGetAttribute(dp, cudaMemPoolAttrReservedMemHigh, &high));
    for (const auto& op : ops) (void)op;
    std::printf("%-34s %13.2f GiB %12.3f %10.2f\n", "cudaMallocAsync", double(high) / GiB, double(high) / peak, secs);
    json_row("trace_cudaMallocAsync", "\"reserved_high\": " + std::to_string(high) + ", \"peak_live\": " + std::to_string(peak));
    // free what is still live, then give the memory back
    std::vector<bool> freed(ptr.size(), false);
    for (const auto& op : ops) if (!op.alloc) freed[op.id] = true;
    for (std::size_t i = 0; i < ptr.size(); ++i) if (ptr[i] && !freed[i]) BENCH_CHECK(cudaFreeAsync(ptr[i], s.get()));
    s.synchronize();
    BENCH_CHECK(cudaMemPoolDestroy(dp));
  }
  for (bool compact : {false, true}) {
    auto props = bench::kept();
    props.compact = compact;
    const std::size_t chunk = compact ? 2 * MiB : 0;
    streamalloc::pool pool(props);
    const double secs = run([&](std::size_t z) { return pool.allocate(z, s); }, [&](void* p) { pool.deallocate(p, s); });
    const auto st = pool.statistics();
    const std::string name = chunk == 0 ? "streamalloc (default, 64 MiB chunks)" : "streamalloc (compact, 2 MiB chunks)";
    std::printf("%-34s %13.2f GiB %12.3f %10.2f   (%zu chunks remapped)\n", name.c_str(), double(st.reserved_high) / GiB,
                double(st.reserved_high) / peak, secs, st.remapped_chunks);
    json_row(chunk == 0 ? "trace_streamalloc_default" : "trace_streamalloc_compact",
             "\"reserved_high\": " + std::to_string(st.reserved_high) + ", \"peak_live\": " + std::to_string(peak) +
                 ", \"remapped_chunks\": " + std::to_string(st.remapped_chunks) + ", \"seconds\": " + std::to_string(secs));
    s.synchronize();
    pool.close();
  }
}

// --- 6. bandwidth over pool memory ---------------------------------------------------------------

__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    dst[i] = src[i];
  }
}

void bandwidth() {
  std::printf("\n6. copy kernel and cudaMemcpy over 1 GiB buffers: pool memory against cudaMalloc memory\n");
  const std::size_t size = 1 * GiB;
  streamalloc::pool pool(bench::kept());
  streamalloc::stream s(0);
  void *ms, *md;
  BENCH_CHECK(cudaMalloc(&ms, size));
  BENCH_CHECK(cudaMalloc(&md, size));
  void* ps = pool.allocate(size, s);
  void* pd = pool.allocate(size, s);
  int sms = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  BENCH_CHECK(cudaMemsetAsync(ms, 1, size, s.get()));
  BENCH_CHECK(cudaMemsetAsync(ps, 1, size, s.get()));
  const int reps = quick ? 5 : 30;
  auto gbps = [&](auto&& op) {
    op();
    std::vector<double> ms_;
    for (int i = 0; i < reps; ++i) ms_.push_back(bench::time_ms(s.get(), 1, op)[0]);
    return 2.0 * size / (bench::median(ms_) * 1e6);
  };
  std::vector<double> k_m, k_p, c_m, c_p;
  for (int round = 0; round < 3; ++round) {  // interleaved
    k_m.push_back(gbps([&] { copy_kernel<<<sms * 8, 512, 0, s.get()>>>((const uint4*)ms, (uint4*)md, size / 16); }));
    k_p.push_back(gbps([&] { copy_kernel<<<sms * 8, 512, 0, s.get()>>>((const uint4*)ps, (uint4*)pd, size / 16); }));
    c_m.push_back(gbps([&] { BENCH_CHECK(cudaMemcpyAsync(md, ms, size, cudaMemcpyDeviceToDevice, s.get())); }));
    c_p.push_back(gbps([&] { BENCH_CHECK(cudaMemcpyAsync(pd, ps, size, cudaMemcpyDeviceToDevice, s.get())); }));
  }
  const double km = bench::median(k_m), kp = bench::median(k_p), cm = bench::median(c_m), cp = bench::median(c_p);
  std::printf("   copy kernel: pool %.0f GB/s, cudaMalloc %.0f GB/s (%.3f)\n", kp, km, kp / km);
  std::printf("   cudaMemcpy:  pool %.0f GB/s, cudaMalloc %.0f GB/s (%.3f)\n", cp, cm, cp / cm);
  json_row("bandwidth_1GiB", "\"kernel_pool\": " + std::to_string(kp) + ", \"kernel_cudaMalloc\": " + std::to_string(km) +
                                 ", \"memcpy_pool\": " + std::to_string(cp) + ", \"memcpy_cudaMalloc\": " + std::to_string(cm));
  pool.deallocate(ps, s);
  pool.deallocate(pd, s);
  s.synchronize();
  cudaFree(ms);
  cudaFree(md);
}

// --- 7. growing from empty to 8 GiB ----------------------------------------------------------------

void growth() {
  const std::size_t target = quick ? 1 * GiB : 8 * GiB;
  std::printf("\n7. growing a new pool from empty to %zu GiB in use: ms (compact: 2 MiB chunks, the setting that meets\n"
              "   the random trace's 1.10; every chunk costs a cuMemCreate, cuMemMap and cuMemSetAccess)\n",
              target / GiB);
  std::printf("%-24s %12s %12s %12s %10s %14s\n", "allocations", "streamalloc", "compact", "MallocAsync", "ratio",
              "compact ratio");
  streamalloc::stream s(0);
  for (int kind = 0; kind < 2; ++kind) {
    std::mt19937_64 rng(5);
    std::vector<std::size_t> sizes;
    for (std::size_t got = 0; got < target;) {
      const std::size_t z = kind == 0 ? 64 * MiB
                                      : static_cast<std::size_t>(std::exp(std::uniform_real_distribution<double>(std::log(4.0 * KiB), std::log(64.0 * MiB))(rng)));
      sizes.push_back(z);
      got += z;
    }
    std::vector<void*> ptrs(sizes.size());
    std::vector<double> ours_ms, compact_ms, async_ms;
    auto ours = [&](bool compact) {
      streamalloc::pool_properties props = bench::kept();
      props.compact = compact;
      streamalloc::pool pool(props);
      auto t = clk::now();
      for (std::size_t i = 0; i < sizes.size(); ++i) ptrs[i] = pool.allocate(sizes[i], s);
      s.synchronize();
      const double ms = seconds_since(t) * 1e3;
      for (void* p : ptrs) pool.deallocate(p, s);
      s.synchronize();
      return ms;
    };
    for (int rep = 0; rep < 3; ++rep) {
      ours_ms.push_back(ours(false));
      compact_ms.push_back(ours(true));
      {
        cudaMemPool_t dp = bench::make_driver_pool();
        auto t = clk::now();
        for (std::size_t i = 0; i < sizes.size(); ++i) BENCH_CHECK(cudaMallocFromPoolAsync(&ptrs[i], sizes[i], dp, s.get()));
        s.synchronize();
        async_ms.push_back(seconds_since(t) * 1e3);
        for (void* p : ptrs) BENCH_CHECK(cudaFreeAsync(p, s.get()));
        s.synchronize();
        BENCH_CHECK(cudaMemPoolDestroy(dp));
      }
    }
    const double o = bench::median(ours_ms), c = bench::median(compact_ms), a = bench::median(async_ms);
    const char* name = kind == 0 ? "64 MiB each" : "random 4 KiB..64 MiB";
    std::printf("%-24s %12.2f %12.2f %12.2f %9.2fx %13.2fx\n", name, o, c, a, a / o, a / c);
    json_row(std::string("growth_") + (kind == 0 ? "64MiB" : "random"),
             "\"streamalloc_ms\": " + std::to_string(o) + ", \"streamalloc_compact_ms\": " + std::to_string(c) +
                 ", \"cudaMallocAsync_ms\": " + std::to_string(a));
  }
}

// One thread's 4 KiB pairs in a process of its own, from `start_ms` (ms since the epoch, so
// that several processes started together measure the same moments) for `seconds`: prints
// million pairs/s. Processes share nothing but the machine and the GPU driver, so running
// 1, 2, 4 and 8 of them at once shows how the machine scales the pool's code with no shared
// memory at all (scripts/scaling-processes.sh).
int solo(int cpu, long long start_ms, double seconds) {
  if (cpu >= 0) bench::pin_to(cpu);
  streamalloc::pool pool(bench::kept());
  streamalloc::stream s(0);
  for (int i = 0; i < 100000; ++i) pool.deallocate(pool.allocate(4 * KiB, s), s);
  while (std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count() <
         start_ms) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::uint64_t pairs = 0;
  auto t = clk::now();
  double elapsed = 0;
  while (elapsed < seconds) {
    for (int i = 0; i < 10000; ++i) pool.deallocate(pool.allocate(4 * KiB, s), s);
    pairs += 10000;
    elapsed = seconds_since(t);
  }
  std::printf("solo cpu %d: %.3f million pairs/s\n", cpu, static_cast<double>(pairs) / elapsed / 1e6);
  s.synchronize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bench::require_gpu("bench_pool");
  std::string json;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--solo") && i + 3 < argc) {
      const int cpu = std::atoi(argv[i + 1]);
      const long long start_ms = std::atoll(argv[i + 2]);
      const double secs = std::atof(argv[i + 3]);
      return solo(cpu, start_ms, secs);
    }
  }
  BENCH_CHECK(cudaSetDevice(0));
  BENCH_CHECK(cudaFree(nullptr));
  const bench::gpu_info gpu = bench::describe_gpu();
  auto want = [&](const char* k) { return only.empty() || only.find(k) != std::string::npos; };
  if (want("pairs")) same_stream_pairs();
  if (want("mixed")) mixed_rounds();
  if (want("threads")) threads_own_streams();
  if (want("cross")) cross_stream();
  if (want("trace")) random_trace();
  if (want("bandwidth")) bandwidth();
  if (want("growth")) growth();
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"bench\": \"pool\",\n  \"gpu\": \"" << bench::json_escape(gpu.name) << "\",\n  \"driver\": " << gpu.driver
        << ",\n  \"runtime\": " << gpu.runtime << ",\n  \"quick\": " << (quick ? "true" : "false") << ",\n  \"rows\": [\n"
        << rows.str() << "\n  ]\n}\n";
    std::printf("\nwrote %s\n", json.c_str());
  }
  return 0;
}
