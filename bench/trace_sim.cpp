// The memory trace of bench_pool (section 5), replayed on the CPU through streamalloc's pool
// core on a simulated device that runs every stream at once (as the idle GPU does in the
// bench). Reports the reserved high-water mark against the peak live bytes for several chunk
// sizes, in seconds instead of device minutes: this is where the memory policy is tuned.
//
//   bench_trace_sim [--live-gib N] [--steps N]

#include <streamalloc/detail/core/pool_core.hpp>

#include "../tests/support/sim_backend.hpp"
#include "trace.hpp"

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

int main(int argc, char** argv) {
  using namespace streamalloc::detail;
  std::size_t live_gib = 8;
  int steps = 20000;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--live-gib") && i + 1 < argc) live_gib = std::strtoull(argv[++i], nullptr, 10);
    else if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) steps = std::atoi(argv[++i]);
  }
  std::size_t peak = 0;
  const auto ops = bench::make_trace(live_gib << 30, steps, peak);
  std::printf("trace: %zu operations, peak live %.3f GiB\n", ops.size(), double(peak) / (1 << 30));
  std::printf("%12s %14s %12s %10s %10s %8s\n", "chunk", "reserved high", "/ peak live", "remapped", "chunks", "seconds");
  struct config {
    std::size_t chunk;
    bool own;
  };
  for (config c : {config{64u << 20, true}, config{16u << 20, false}, config{2u << 20, false}}) {
    const std::size_t chunk = c.chunk;
    auto dev = std::make_shared<streamalloc_test::sim_device>();
    core_options o;
    o.chunk_size = chunk;
    o.own_chunk_for_large = c.own;
    o.release_threshold = ~0ull;
    o.address_space = 4 * (live_gib << 30) + (64ull << 30);
    pool_core<streamalloc_test::sim_backend> pool(streamalloc_test::sim_backend{dev}, o);
    static char handle;
    stream_key s{&ordering().record(1ull << 60), &handle};
    std::vector<std::uint64_t> ptr(ops.size());
    const auto t = std::chrono::steady_clock::now();
    std::size_t step = 0;
    try {
      for (const auto& op : ops) {
        if (op.alloc) ptr[op.id] = pool.allocate(op.size, s);
        else pool.deallocate(ptr[op.id], s);
        dev->run(s.native);  // an idle device: every event completes at once
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
    std::printf("%9zu MiB %11.3f GiB %12.3f %10llu %10llu %8.2f\n", chunk >> 20, double(st.reserved_high) / (1 << 30),
                double(st.reserved_high) / double(peak), static_cast<unsigned long long>(st.remapped_chunks),
                static_cast<unsigned long long>(st.chunks), secs);
    pool.shutdown();
  }
  return 0;
}
