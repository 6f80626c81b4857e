// Growing a buffer from 1 MiB to 8 GiB by doubling (a kernel writes each new half), side by
// side in one process:
//   streamalloc in place   stream_buffer::resize: more physical memory mapped behind the buffer
//   streamalloc + copy     a new pool allocation each time, the old contents copied, old freed
//   cudaMallocAsync + copy the same with the driver's stream-ordered pool
//   cudaMalloc + copy      the same with cudaMalloc / cudaFree
// Time: from the first allocation to the device finishing the last write (host clock, one
// synchronization at the end). Peak: the most device memory the method held at once (the
// pool's reserved high-water mark; the driver pool's reservedMemHigh; for cudaMalloc, the sum
// of live allocations), and the drop in free device memory seen by cudaMemGetInfo.
//
//   bench_stream_buffer [--max-gib N] [--reps N] [--json FILE]

#include <streamalloc/streamalloc.hpp>

#include "bench_common.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

__global__ void write_range(std::uint64_t* p, std::size_t from, std::size_t to) {
  for (std::size_t i = from + blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < to; i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = i;
  }
}
void write(std::uint64_t* p, std::size_t from, std::size_t to, cudaStream_t s) {
  write_range<<<1024, 256, 0, s>>>(p, from, to);
}

struct result {
  const char* method;
  double ms;
  std::size_t peak;      ///< bytes held at once, as the allocator reports it
  std::size_t seen;      ///< the largest drop of free device memory seen (cudaMemGetInfo)
  int in_place = 0, moved = 0;
  bool correct = false;
};

std::size_t free_now() {
  std::size_t f = 0, t = 0;
  BENCH_CHECK(cudaMemGetInfo(&f, &t));
  return f;
}

bool spot_check(const std::uint64_t* p, std::size_t n, cudaStream_t s) {
  for (std::size_t k = 0; k < 64; ++k) {
    const std::size_t i = (n / 64) * k + k;
    std::uint64_t v = 0;
    BENCH_CHECK(cudaMemcpyAsync(&v, p + i, sizeof v, cudaMemcpyDeviceToHost, s));
    BENCH_CHECK(cudaStreamSynchronize(s));
    if (v != i) return false;
  }
  return true;
}

// Allocate-and-copy growth through alloc(bytes)/release(p), shared by the three peers.
template <class Alloc, class Release>
result grow_by_copy(const char* name, std::size_t max_bytes, cudaStream_t s, Alloc alloc, Release release) {
  result r{name, 0, 0, 0};
  const std::size_t base = free_now();
  std::size_t low = base;
  const auto t = std::chrono::steady_clock::now();
  std::size_t n = MiB / 8;
  auto* p = static_cast<std::uint64_t*>(alloc(n * 8));
  write(p, 0, n, s);
  while (n * 8 < max_bytes) {
    auto* q = static_cast<std::uint64_t*>(alloc(2 * n * 8));
    r.peak = std::max(r.peak, 3 * n * 8);  // old and new live at once
    low = std::min(low, free_now());
    BENCH_CHECK(cudaMemcpyAsync(q, p, n * 8, cudaMemcpyDeviceToDevice, s));
    release(p);
    p = q;
    write(p, n, 2 * n, s);
    n *= 2;
    ++r.moved;
  }
  BENCH_CHECK(cudaStreamSynchronize(s));
  r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
  low = std::min(low, free_now());
  r.seen = base - low;
  r.correct = spot_check(p, n, s);
  release(p);
  BENCH_CHECK(cudaStreamSynchronize(s));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  bench::require_gpu("bench_stream_buffer");
  std::size_t max_gib = 8;
  int reps = 3;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--max-gib") && i + 1 < argc) max_gib = std::strtoull(argv[++i], nullptr, 10);
    else if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
  }
  const std::size_t max_bytes = max_gib << 30;
  const auto gpu = bench::describe_gpu();
  std::printf("growing a buffer from 1 MiB to %zu GiB by doubling (%zu steps), a kernel writing each new half; "
              "median of %d runs\n\n",
              max_gib, static_cast<std::size_t>(std::log2(double(max_bytes / MiB))), reps);

  streamalloc::stream s(0);
  std::vector<std::vector<result>> runs(4);
  for (int rep = 0; rep < reps; ++rep) {
    {  // streamalloc in place: a fresh pool each run, so each run maps its memory anew
      streamalloc::pool pool;
      result r{"streamalloc resize (in place)", 0, 0, 0};
      const std::size_t base = free_now();
      std::size_t low = base;
      const auto t = std::chrono::steady_clock::now();
      streamalloc::stream_buffer<std::uint64_t> buf(MiB / 8, s, streamalloc::device_resource(pool));
      write(buf.data(), 0, buf.size(), s.get());
      while (buf.size_bytes() < max_bytes) {
        const std::size_t old = buf.size();
        (buf.resize(2 * old) == streamalloc::growth::in_place ? r.in_place : r.moved) += 1;
        low = std::min(low, free_now());
        write(buf.data(), old, buf.size(), s.get());
      }
      BENCH_CHECK(cudaStreamSynchronize(s.get()));
      r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
      r.peak = pool.statistics().reserved_high;
      r.seen = base - std::min(low, free_now());
      r.correct = spot_check(buf.data(), buf.size(), s.get());
      runs[0].push_back(r);
    }
    {
      streamalloc::pool pool;
      auto r = grow_by_copy("streamalloc allocate + copy", max_bytes, s.get(),
                            [&](std::size_t b) { return pool.allocate(b, s); },
                            [&](void* p) { pool.deallocate(p, s); });
      r.peak = pool.statistics().reserved_high;
      runs[1].push_back(r);
    }
    {
      cudaMemPool_t mp{};
      BENCH_CHECK(cudaDeviceGetDefaultMemPool(&mp, 0));
      BENCH_CHECK(cudaMemPoolTrimTo(mp, 0));
      std::uint64_t zero = 0;
      BENCH_CHECK(cudaMemPoolSetAttribute(mp, cudaMemPoolAttrReservedMemHigh, &zero));
      auto r = grow_by_copy("cudaMallocAsync + copy", max_bytes, s.get(),
                            [&](std::size_t b) {
                              void* p = nullptr;
                              BENCH_CHECK(cudaMallocAsync(&p, b, s.get()));
                              return p;
                            },
                            [&](void* p) { BENCH_CHECK(cudaFreeAsync(p, s.get())); });
      std::uint64_t high = 0;
      BENCH_CHECK(cudaMemPoolGetAttribute(mp, cudaMemPoolAttrReservedMemHigh, &high));
      r.peak = high;
      BENCH_CHECK(cudaMemPoolTrimTo(mp, 0));
      runs[2].push_back(r);
    }
    {
      auto r = grow_by_copy("cudaMalloc + copy", max_bytes, s.get(),
                            [&](std::size_t b) {
                              void* p = nullptr;
                              BENCH_CHECK(cudaMalloc(&p, b));
                              return p;
                            },
                            [&](void* p) { BENCH_CHECK(cudaFree(p)); });
      runs[3].push_back(r);
    }
  }

  std::printf("%-32s %10s %9s %12s %12s %9s %8s %7s\n", "method", "time ms", "vs place", "peak MiB", "seen MiB",
              "in place", "moved", "check");
  std::vector<result> med;
  for (auto& rs : runs) {
    std::vector<double> ms;
    for (auto& r : rs) ms.push_back(r.ms);
    result m = rs.front();
    m.ms = bench::median(ms);
    for (auto& r : rs) {
      m.peak = std::max(m.peak, r.peak);
      m.seen = std::max(m.seen, r.seen);
      m.correct = m.correct && r.correct;
    }
    med.push_back(m);
  }
  for (auto& m : med) {
    std::printf("%-32s %10.2f %8.2fx %12zu %12zu %9d %8d %7s\n", m.method, m.ms, m.ms / med[0].ms, m.peak >> 20,
                m.seen >> 20, m.in_place, m.moved, m.correct ? "ok" : "WRONG");
  }
  std::printf("\npeak memory vs in place: ");
  for (std::size_t i = 1; i < med.size(); ++i) {
    std::printf("%s %.2fx%s", med[i].method, double(med[i].peak) / double(med[0].peak), i + 1 < med.size() ? ", " : "\n");
  }
  bool all_ok = true;
  for (auto& m : med) all_ok = all_ok && m.correct;

  // What the typed layer costs over the pool: a 4 KiB buffer made and destroyed on one stream
  // (allocation, free, and the bookkeeping of its stream), against the pool's own pair.
  double buffer_ns = 0, pool_ns = 0, async_ns = 0;
  {
    streamalloc::pool pool;
    const streamalloc::device_resource mr(pool);
    constexpr int n = 200000;
    auto ns_per = [&](auto&& f) {
      for (int i = 0; i < 1000; ++i) f();
      std::vector<double> v;
      for (int r = 0; r < 5; ++r) {
        const auto t = std::chrono::steady_clock::now();
        for (int i = 0; i < n; ++i) f();
        v.push_back(std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t).count() / n);
      }
      return bench::median(v);
    };
    buffer_ns = ns_per([&] { streamalloc::stream_buffer<char> b(4096, s, mr); });
    pool_ns = ns_per([&] { pool.deallocate(pool.allocate(4096, s), s); });
    async_ns = ns_per([&] {
      void* p = nullptr;
      BENCH_CHECK(cudaMallocAsync(&p, 4096, s.get()));
      BENCH_CHECK(cudaFreeAsync(p, s.get()));
    });
    BENCH_CHECK(cudaStreamSynchronize(s.get()));
  }
  std::printf("\na 4 KiB buffer made and destroyed on one stream: stream_buffer %.0f ns, pool allocate+deallocate "
              "%.0f ns, cudaMallocAsync+cudaFreeAsync %.0f ns\n",
              buffer_ns, pool_ns, async_ns);
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\n  \"gpu\": \"" << bench::json_escape(gpu.name) << "\", \"driver\": " << gpu.driver
      << ", \"runtime\": " << gpu.runtime << ", \"max_bytes\": " << max_bytes << ", \"reps\": " << reps
      << ",\n  \"rows\": [\n";
    for (std::size_t i = 0; i < med.size(); ++i) {
      const auto& m = med[i];
      f << "    {\"method\": \"" << m.method << "\", \"ms\": " << m.ms << ", \"time_vs_in_place\": " << m.ms / med[0].ms
        << ", \"peak_bytes\": " << m.peak << ", \"free_memory_drop_bytes\": " << m.seen
        << ", \"in_place_steps\": " << m.in_place << ", \"moved_steps\": " << m.moved
        << ", \"contents_ok\": " << (m.correct ? "true" : "false") << "}" << (i + 1 < med.size() ? ",\n" : "\n");
    }
    f << "  ],\n  \"buffer_pair_ns\": " << buffer_ns << ", \"pool_pair_ns\": " << pool_ns
      << ", \"malloc_async_pair_ns\": " << async_ns << "\n}\n";
    std::printf("wrote %s\n", json.c_str());
  }
  return all_ok && med[0].moved == 0 ? 0 : 1;
}
