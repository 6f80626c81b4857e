// A recorded trace (bench/traces/*.trace.gz) replayed through the whole pool (pool.hpp on its
// VMM backend), as bench_trace_replay replays it on the GPU: a `stream` per trace stream, the
// default pool's properties, everything freed between passes. On a machine without a GPU the
// driver is the test suite's fake (STREAMALLOC_LIBCUDA names it), which answers at once and
// models no memory: what this measures there is the pool's own work and, under callgrind, how
// many driver calls each operation makes. Per pass: ns per operation, and the pool's
// reserved high, chunks remapped and growths so far.
//
//   STREAMALLOC_LIBCUDA=build/tests/libstreamalloc_fake_cuda.so FAKE_CUDA_DEVICE_MEMORY=150323855360 \
//     bench_fake_replay TRACE [WARM_PASSES]

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include "trace_file.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_fake_replay TRACE [WARM_PASSES]\n");
    return 2;
  }
  const bench::recorded_trace t = bench::load_trace(argv[1]);
  const int warm = argc > 2 ? std::atoi(argv[2]) : 5;
  std::vector<streamalloc::stream> streams;
  for (std::uint32_t i = 0; i < t.streams; ++i) streams.emplace_back(0);
  streamalloc::pool p;
  std::vector<void*> ptr(t.allocations(), nullptr);
  std::printf("trace %s: %zu operations, %u stream%s\n", t.name.c_str(), t.ops.size(), t.streams,
              t.streams == 1 ? "" : "s");
  for (int pass = 0; pass <= warm; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    for (const auto& op : t.ops) {
      if (op.alloc) {
        ptr[op.id] = p.allocate(op.size, streams[op.stream]);
      } else {
        p.deallocate(ptr[op.id], streams[op.stream]);
        ptr[op.id] = nullptr;
      }
    }
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
                      static_cast<double>(t.ops.size());
    const streamalloc::pool_statistics s = p.statistics();
    std::printf("%s %d: %.0f ns/op; reserved high %.3f GiB (%.3f of the peak live), chunks remapped %llu, grows %llu\n",
                pass == 0 ? "first pass" : "warm pass", pass, ns, static_cast<double>(s.reserved_high) / (1 << 30),
                static_cast<double>(s.reserved_high) / static_cast<double>(t.peak_live),
                static_cast<unsigned long long>(s.remapped_chunks), static_cast<unsigned long long>(s.grows));
    for (std::size_t id = 0; id < ptr.size(); ++id) {
      if (ptr[id] == nullptr) continue;
      p.deallocate(ptr[id], streams[t.stream_of[id]]);
      ptr[id] = nullptr;
    }
  }
  return 0;
}
