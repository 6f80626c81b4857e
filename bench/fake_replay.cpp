// A recorded trace (bench/traces/*.trace.gz) replayed through the whole pool (pool.hpp on its
// VMM backend), as bench_trace_replay replays it on the GPU: a `stream` per trace stream, the
// default pool's properties, everything freed between passes. On a machine without a GPU the
// driver is the test suite's fake (STREAMALLOC_LIBCUDA names it), which answers at once and
// models no memory: what this measures there is the pool's own work and how many
// stream-ordered driver calls each operation makes (the fake counts them per thread). Per
// pass: ns per operation, the pool's reserved high, chunks remapped and growths so far, and
// with the fake, those calls per operation.
//
//   STREAMALLOC_LIBCUDA=build/tests/libstreamalloc_fake_cuda.so FAKE_CUDA_DEVICE_MEMORY=150323855360 \
//     bench_fake_replay TRACE [WARM_PASSES]

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include "../tests/fake_driver/fake_stream_calls.hpp"
#include "trace_file.hpp"

#include <dlfcn.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {
using stream_call_counts = fake_stream_call_counts;  // the fake's per-thread counts
using counts_fn = stream_call_counts (*)();

/// The fake's counter, when the driver streamalloc loaded is the fake; null otherwise.
counts_fn fake_counts() {
  const char* path = std::getenv("STREAMALLOC_LIBCUDA");
  if (path == nullptr) return nullptr;
  void* lib = ::dlopen(path, RTLD_NOW | RTLD_NOLOAD);  // the copy streamalloc loaded
  return lib == nullptr ? nullptr : reinterpret_cast<counts_fn>(::dlsym(lib, "fake_cuda_stream_calls"));
}
}  // namespace

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
  const counts_fn counts = fake_counts();  // after the pool: the driver is loaded by then
  std::vector<void*> ptr(t.allocations(), nullptr);
  std::printf("trace %s: %zu operations, %u stream%s\n", t.name.c_str(), t.ops.size(), t.streams,
              t.streams == 1 ? "" : "s");
  for (int pass = 0; pass <= warm; ++pass) {
    const stream_call_counts before = counts != nullptr ? counts() : stream_call_counts{};
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
    if (counts != nullptr) {
      const stream_call_counts after = counts();
      const double n = static_cast<double>(t.ops.size());
      std::printf("  driver calls per operation: capture questions %.3f, stream ids %.4f, stream queries %.4f, "
                  "event records %.4f, event queries %.4f, stream waits %.4f\n",
                  double(after.capture_questions - before.capture_questions) / n,
                  double(after.stream_ids - before.stream_ids) / n,
                  double(after.stream_queries - before.stream_queries) / n,
                  double(after.event_records - before.event_records) / n,
                  double(after.event_queries - before.event_queries) / n,
                  double(after.stream_waits - before.stream_waits) / n);
    }
    for (std::size_t id = 0; id < ptr.size(); ++id) {
      if (ptr[id] == nullptr) continue;
      p.deallocate(ptr[id], streams[t.stream_of[id]]);
      ptr[id] = nullptr;
    }
  }
  return 0;
}
