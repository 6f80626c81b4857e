// What seeing into a pool costs: the allocate + free pair of 4 KiB on one stream with the
// history off and on (pool::keep_history), at 1 and 8 threads, against cudaMallocAsync in the
// same run; and pool::snapshot's time as the live blocks grow (1,000 to 100,000).
//
// Expected before measuring: history off costs nothing measurable (one relaxed load per call);
// on, a steady-clock reading (about 20 ns) and an uncontended mutex (about 20 ns) per event, so
// about +50 ns a pair on one thread, and much more at 8 threads (one mutex for all). A snapshot
// walks every block under the pool lock and formats about 80 bytes of JSON each: about 0.3 us
// a block.
//
//   bench_snapshot [--json FILE]

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include "bench_common.hpp"

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {
using bench::clk;
using bench::seconds_since;

/// ns per allocate + free pair of 4 KiB, `threads` threads each on a stream of its own.
template <class Pair>
double pair_ns(int threads, int n, Pair pair) {
  std::vector<double> each(threads);
  std::atomic<int> ready{0};
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      BENCH_CHECK(cudaSetDevice(0));
      streamalloc::stream s;
      for (int i = 0; i < n / 10; ++i) pair(s);
      ready.fetch_add(1);
      while (ready.load() < threads) {
      }
      const auto t0 = clk::now();
      for (int i = 0; i < n; ++i) pair(s);
      each[t] = seconds_since(t0) * 1e9 / n;
      s.synchronize();
    });
  }
  for (auto& w : workers) w.join();
  return bench::median(each);
}

}  // namespace

int main(int argc, char** argv) {
  const char* json = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
  }
  bench::require_gpu("bench_snapshot");
  const bench::gpu_info gpu = bench::describe_gpu();
  bench::json_rows rows;
  constexpr int n = 200'000;
  constexpr std::size_t bytes = 4096;

  std::printf("allocate + free %zu B on one stream, ns per pair (median over threads):\n", bytes);
  std::printf("%8s %14s %14s %14s %16s\n", "threads", "history off", "history on", "on / off", "cudaMallocAsync");
  for (int threads : {1, 8}) {
    streamalloc::pool p(bench::kept());
    auto ours = [&](streamalloc::stream& s) { p.deallocate(p.allocate(bytes, s), s); };
    const double off = pair_ns(threads, n, ours);
    p.keep_history(1 << 16);
    const double on = pair_ns(threads, n, ours);
    p.keep_history(0);
    const double off_again = pair_ns(threads, n, ours);
    const double driver = pair_ns(threads, n / 4, [&](streamalloc::stream& s) {
      void* x = nullptr;
      BENCH_CHECK(cudaMallocAsync(&x, bytes, s.get()));
      BENCH_CHECK(cudaFreeAsync(x, s.get()));
    });
    const double off_best = std::min(off, off_again);
    std::printf("%8d %14.1f %14.1f %13.2fx %16.1f\n", threads, off_best, on, on / off_best, driver);
    rows.add("pair_history", "\"threads\": " + std::to_string(threads) + ", \"off_ns\": " + std::to_string(off_best) +
                                 ", \"on_ns\": " + std::to_string(on) + ", \"driver_ns\": " + std::to_string(driver));
  }

  std::printf("\npool::snapshot with N live blocks of 256 B .. 4 KiB:\n%10s %12s %14s %12s\n", "blocks", "ms",
              "ns per block", "JSON bytes");
  for (std::size_t live : {1'000u, 10'000u, 100'000u}) {
    streamalloc::pool p(bench::kept());
    streamalloc::stream s;
    std::vector<void*> held;
    held.reserve(live);
    for (std::size_t i = 0; i < live; ++i) held.push_back(p.allocate(256 * (1 + i % 16), s));
    std::string doc = p.snapshot();  // warm
    std::vector<double> ms;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = clk::now();
      doc = p.snapshot();
      ms.push_back(seconds_since(t0) * 1e3);
    }
    const double m = bench::median(ms);
    std::printf("%10zu %12.2f %14.1f %12zu\n", live, m, m * 1e6 / double(live), doc.size());
    rows.add("snapshot", "\"live_blocks\": " + std::to_string(live) + ", \"ms\": " + std::to_string(m) +
                             ", \"json_bytes\": " + std::to_string(doc.size()));
    for (void* x : held) p.deallocate(x, s);
  }

  if (json != nullptr) {
    std::ofstream out(json);
    out << "{\n  \"bench\": \"snapshot\",\n  \"gpu\": \"" << bench::json_escape(gpu.name) << "\",\n  \"driver\": " << gpu.driver
        << ",\n  \"runtime\": " << gpu.runtime << ",\n  \"rows\": [\n" << rows.str() << "\n  ]\n}\n";
    std::printf("wrote %s\n", json);
  }
  return 0;
}
