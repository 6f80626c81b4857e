// Allocation inside kernels: device_arena beside a plain atomicAdd per thread (spec/002's sketch)
// and CUDA's in-kernel malloc/free, in one process, as allocations per second.
//
// Every thread of a full grid (8 blocks of 256 threads per SM) makes k allocations and keeps a
// checksum of the pointers (nothing is written into the memory: the table measures allocation,
// not memory traffic), then the memory is given back:
//   atomicAdd / thread      spec/002's sketch: one atomicAdd of the size per thread, then the
//                           capacity check (wrong at exhaustion: the offset grows with each
//                           failing caller), reset by a memset. With one size for the whole
//                           grid, nvcc merges the lanes' atomics itself (one per warp);
//   atomicAdd, not merged   the same with the size read from memory per lane (equal values),
//                           so nvcc cannot merge: one atomic per thread;
//   arena (warp)            device_arena_view::allocate: lanes asking at once share one atomic;
//   arena (block)           device_block_arena: each block takes its memory with one atomic, its
//                           threads allocate with shared-memory atomics (lanes merged too);
//   malloc + free           CUDA's device heap, sized to fit: malloc then free, in the same
//                           kernel, one allocation per thread (its best case).
// Time: one kernel and its reset (the memset of the offset; for malloc, the frees inside the
// kernel), from CUDA events; the median of --reps runs after a warm-up.
//
//   bench_device_arena [--reps N] [--json FILE]

#include <streamalloc/device_arena.hpp>
#include <streamalloc/stream.hpp>

#include "bench_common.hpp"

#include <cuda/atomic>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace {

constexpr int threads_per_block = 256;
constexpr int max_k = 64;

/// How the lanes ask: all the same size, sizes differing lane to lane (16..256 bytes), or every
/// other lane only.
enum class lanes : int { all_same = 0, mixed = 1, half = 2 };

__device__ inline unsigned size_for(lanes mode, unsigned size, unsigned t, int i) {
  switch (mode) {
    case lanes::mixed: return 16u << ((t * 7u + static_cast<unsigned>(i)) % 5u);
    case lanes::half: return (t & 1u) != 0 ? 0u : size;
    default: return size;
  }
}

struct plain_atomic {
  std::byte* base;
  unsigned long long capacity;
  unsigned long long* offset;
  __device__ void* operator()(unsigned size) const {
    const unsigned long long old = atomicAdd(offset, static_cast<unsigned long long>(size));
    return old + size <= capacity ? base + old : nullptr;
  }
};

struct unmerged_atomic {
  std::byte* base;
  unsigned long long capacity;
  unsigned long long* offset;
  const unsigned* lane_size;  // 32 equal values: nvcc cannot tell, so it cannot merge the atomics
  __device__ void* operator()(unsigned size) const {
    const unsigned long long bytes = size == 0 ? 0 : lane_size[threadIdx.x % 32];
    const unsigned long long old = atomicAdd(offset, bytes);
    return old + bytes <= capacity ? base + old : nullptr;
  }
};

struct warp_arena {
  streamalloc::device_arena_view arena;
  __device__ void* operator()(unsigned size) const { return arena.allocate(size); }
};

template <class Allocate>
__global__ void allocate_kernel(Allocate allocate, int k, unsigned size, lanes mode, unsigned long long* nulls,
                                std::uint64_t* checksums) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  std::uint64_t sum = 0;
  for (int i = 0; i < k; ++i) {
    const unsigned bytes = size_for(mode, size, t, i);
    if (bytes == 0) continue;
    void* p = allocate(bytes);
    if (p == nullptr) atomicAdd(nulls, 1ull);
    sum ^= reinterpret_cast<std::uintptr_t>(p);
  }
  checksums[t] = sum;
}

__global__ void block_arena_kernel(streamalloc::device_arena_view arena, int k, unsigned size, lanes mode,
                                   std::size_t block_bytes, unsigned long long* nulls, std::uint64_t* checksums) {
  __shared__ streamalloc::device_block_arena_state state;
  const streamalloc::device_block_arena block = arena.for_block(state, block_bytes);
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  std::uint64_t sum = 0;
  for (int i = 0; i < k; ++i) {
    const unsigned bytes = size_for(mode, size, t, i);
    if (bytes == 0) continue;
    void* p = block.allocate(bytes);
    if (p == nullptr) atomicAdd(nulls, 1ull);
    sum ^= reinterpret_cast<std::uintptr_t>(p);
  }
  checksums[t] = sum;
}

/// One allocation per thread, freed at once (k = 1: the device heap's best case).
__global__ void malloc_free_kernel(unsigned size, lanes mode, unsigned long long* nulls, std::uint64_t* checksums) {
  const unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned bytes = size_for(mode, size, t, 0);
  void* p = bytes == 0 ? nullptr : malloc(bytes);
  if (bytes != 0 && p == nullptr) atomicAdd(nulls, 1ull);
  checksums[t] = reinterpret_cast<std::uintptr_t>(p);
  free(p);
}

/// Allocations a thread makes of 4 KiB: 64, as at every other size, where the device has the
/// 71 GB region that takes on a full H100 grid (main decides); 16 otherwise. With 16, the
/// kernel is a quarter as long and its fixed costs (blocks starting, each block's first atomic,
/// the reset) weigh four times as much.
int k_at_4k = max_k;

/// Allocations a thread makes of `size`: 64, a kernel long enough that its start and the reset
/// weigh little.
int k_for(unsigned size) { return size <= 1024 ? max_k : k_at_4k; }

struct setup {
  int blocks = 0;
  int reps = 5;
  streamalloc::stream* s = nullptr;
  streamalloc::device_arena* arena = nullptr;
  unsigned long long* counters = nullptr;  // [0] the plain offset, [1] nulls
  unsigned* lane_size = nullptr;           // 32 sizes, all equal, for unmerged_atomic
  std::uint64_t* checksums = nullptr;      // one per thread
};

struct measured {
  double per_second = 0;  ///< allocations per second
  unsigned long long nulls = 0;
  std::size_t allocations = 0;
};

template <class Launch, class Reset>
measured measure(const setup& su, std::size_t allocations, Launch launch, Reset reset) {
  const cudaStream_t st = su.s->get();
  auto once = [&] {
    launch();
    reset();
  };
  once();  // warm-up: first touches of the memory, the device heap's set-up
  BENCH_CHECK(cudaMemsetAsync(su.counters, 0, 2 * sizeof(unsigned long long), st));
  const double ms = bench::median(bench::time_ms(st, su.reps, once));
  unsigned long long h[2] = {0, 0};
  BENCH_CHECK(cudaMemcpyAsync(h, su.counters, sizeof h, cudaMemcpyDeviceToHost, st));
  BENCH_CHECK(cudaStreamSynchronize(st));
  return {static_cast<double>(allocations) / (ms * 1e-3), h[1], allocations};
}

/// Allocations made by one kernel of the grid in `mode` (the half mode skips every other lane).
std::size_t allocations_of(const setup& su, int k, lanes mode) {
  const std::size_t per = std::size_t{static_cast<unsigned>(su.blocks)} * threads_per_block * k;
  return mode == lanes::half ? per / 2 : per;
}

struct row {
  measured plain, unmerged, warp, block, heap;
};

row run_all(const setup& su, unsigned size, lanes mode) {
  const int k = k_for(size);
  const std::size_t n = allocations_of(su, k, mode);
  const cudaStream_t st = su.s->get();
  const streamalloc::device_arena_view v = su.arena->view();
  unsigned long long* plain_offset = su.counters;
  unsigned long long* nulls = su.counters + 1;
  std::vector<unsigned> sizes(32, size);
  BENCH_CHECK(cudaMemcpyAsync(su.lane_size, sizes.data(), 32 * sizeof(unsigned), cudaMemcpyHostToDevice, st));
  auto reset_plain = [&] { BENCH_CHECK(cudaMemsetAsync(plain_offset, 0, sizeof *plain_offset, st)); };
  auto reset_arena = [&] { su.arena->reset(); };
  const unsigned max_size = mode == lanes::mixed ? 256u : size;
  const std::size_t block_bytes = std::size_t{threads_per_block} * k * ((max_size + 15u) & ~15u);
  const dim3 grid(static_cast<unsigned>(su.blocks));
  row r;
  r.plain = measure(su, n, [&] {
    allocate_kernel<<<grid, threads_per_block, 0, st>>>(plain_atomic{v.base(), v.capacity(), plain_offset}, k, size,
                                                        mode, nulls, su.checksums);
  }, reset_plain);
  r.unmerged = measure(su, n, [&] {
    allocate_kernel<<<grid, threads_per_block, 0, st>>>(
        unmerged_atomic{v.base(), v.capacity(), plain_offset, su.lane_size}, k, size, mode, nulls, su.checksums);
  }, reset_plain);
  r.warp = measure(su, n, [&] {
    allocate_kernel<<<grid, threads_per_block, 0, st>>>(warp_arena{v}, k, size, mode, nulls, su.checksums);
  }, reset_arena);
  r.block = measure(su, n, [&] {
    block_arena_kernel<<<grid, threads_per_block, 0, st>>>(v, k, size, mode, block_bytes, nulls, su.checksums);
  }, reset_arena);
  r.heap = measure(su, allocations_of(su, 1, mode),
                   [&] { malloc_free_kernel<<<grid, threads_per_block, 0, st>>>(size, mode, nulls, su.checksums); },
                   [] {});
  BENCH_CHECK(cudaGetLastError());
  return r;
}

const char* mode_name(lanes m) { return m == lanes::mixed ? "mixed" : m == lanes::half ? "half" : "all"; }

}  // namespace

int main(int argc, char** argv) {
  bench::require_gpu("bench_device_arena");
  std::string json;
  setup su;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) su.reps = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
  }
  BENCH_CHECK(cudaSetDevice(0));
  const bench::gpu_info gpu = bench::describe_gpu();
  su.blocks = gpu.sms * 8;  // 2,048 threads per SM
  const std::size_t threads = std::size_t{static_cast<unsigned>(su.blocks)} * threads_per_block;
  const std::vector<unsigned> sizes = {16, 64, 256, 1024, 4096};
  std::size_t device_free = 0, device_total = 0;
  BENCH_CHECK(cudaMemGetInfo(&device_free, &device_total));
  const std::size_t heap = 2 * threads * sizes.back() + (std::size_t{256} << 20);
  // A full region of 4 KiB allocations, the device heap and a margin must fit the free memory.
  if (threads * max_k * std::size_t{4096} + heap + (std::size_t{2} << 30) > device_free) k_at_4k = max_k / 4;
  std::size_t most = 0;  // the most bytes one kernel hands out
  for (unsigned size : sizes) most = std::max(most, threads * k_for(size) * std::size_t{size});
  // The device heap, sized to fit a kernel's allocations (one per thread) twice over, for its
  // own bookkeeping; set before any kernel uses malloc, as CUDA requires.
  BENCH_CHECK(cudaDeviceSetLimit(cudaLimitMallocHeapSize, heap));

  streamalloc::stream s(0);
  streamalloc::pool pool(bench::kept());
  streamalloc::device_arena arena(most + (std::size_t{16} << 20), s, pool);
  su.s = &s;
  su.arena = &arena;
  BENCH_CHECK(cudaMalloc(&su.counters, 2 * sizeof(unsigned long long)));
  BENCH_CHECK(cudaMalloc(&su.lane_size, 32 * sizeof(unsigned)));
  BENCH_CHECK(cudaMalloc(&su.checksums, threads * sizeof(std::uint64_t)));

  std::printf("allocations per second (millions) from one kernel: %zu threads (%d blocks of %d), each making k "
              "allocations (malloc: 1); the memory given back after each kernel (arena: reset; malloc: free in the "
              "kernel); median of %d runs\n\n",
              threads, su.blocks, threads_per_block, su.reps);
  std::printf("%-6s %6s %3s %10s %10s %10s %10s %9s | %8s %8s %8s %8s %5s\n", "lanes", "size", "k", "atomicAdd",
              "atomicAdd", "arena", "arena", "malloc", "arena/", "arena/", "arena/", "block/", "check");
  std::printf("%-6s %6s %3s %10s %10s %10s %10s %9s | %8s %8s %8s %8s %5s\n", "", "bytes", "", "/ thread",
              "unmerged", "(warp)", "(block)", "+ free", "malloc", "atomic", "unmerged", "atomic", "");
  bench::json_rows rows;
  bool malloc_met = true, atomic_met = true, all_ok = true;
  double worst_vs_malloc = 1e300, worst_vs_atomic = 1e300, worst_vs_unmerged = 1e300, worst_block_vs_atomic = 1e300;
  auto report = [&](lanes mode, unsigned size) {
    const row r = run_all(su, size, mode);
    // Every variant has room for every request: a null is a failure of the bench.
    const unsigned long long nulls = r.plain.nulls + r.unmerged.nulls + r.warp.nulls + r.block.nulls + r.heap.nulls;
    all_ok = all_ok && nulls == 0;
    const double vs_malloc = r.warp.per_second / r.heap.per_second;
    const double vs_atomic = r.warp.per_second / r.plain.per_second;
    const double vs_unmerged = r.warp.per_second / r.unmerged.per_second;
    const double block_vs_atomic = r.block.per_second / r.plain.per_second;
    worst_vs_malloc = std::min(worst_vs_malloc, vs_malloc);
    malloc_met = malloc_met && vs_malloc >= 20;
    if (mode == lanes::all_same) {
      worst_vs_atomic = std::min(worst_vs_atomic, vs_atomic);
      worst_vs_unmerged = std::min(worst_vs_unmerged, vs_unmerged);
      worst_block_vs_atomic = std::min(worst_block_vs_atomic, block_vs_atomic);
      atomic_met = atomic_met && vs_unmerged >= 4;
    }
    std::printf("%-6s %6s %3d %10.0f %10.0f %10.0f %10.0f %9.2f | %7.0fx %7.1fx %7.1fx %7.1fx %5s\n",
                mode_name(mode), mode == lanes::mixed ? "16-256" : std::to_string(size).c_str(), k_for(size),
                r.plain.per_second / 1e6, r.unmerged.per_second / 1e6, r.warp.per_second / 1e6,
                r.block.per_second / 1e6, r.heap.per_second / 1e6, vs_malloc, vs_atomic, vs_unmerged, block_vs_atomic,
                nulls == 0 ? "ok" : "NULLS");
    rows.add(std::string(mode_name(mode)) + "_" + std::to_string(size),
             "\"lanes\": \"" + std::string(mode_name(mode)) + "\", \"bytes\": " + std::to_string(size) +
                 ", \"k\": " + std::to_string(k_for(size)) +
                 ", \"allocations_per_kernel\": " + std::to_string(r.warp.allocations) +
                 ", \"atomicAdd_per_thread_per_s\": " + std::to_string(r.plain.per_second) +
                 ", \"atomicAdd_unmerged_per_s\": " + std::to_string(r.unmerged.per_second) +
                 ", \"arena_warp_per_s\": " + std::to_string(r.warp.per_second) +
                 ", \"arena_block_per_s\": " + std::to_string(r.block.per_second) +
                 ", \"malloc_free_per_s\": " + std::to_string(r.heap.per_second) + ", \"nulls\": " + std::to_string(nulls));
  };
  for (unsigned size : sizes) report(lanes::all_same, size);
  std::printf("\nlanes asking differently (mixed: sizes 16..256 B differing lane to lane; half: every other lane "
              "asks); nvcc merges no atomicAdd here:\n");
  report(lanes::mixed, 16);
  report(lanes::half, 64);
  report(lanes::half, 1024);

  const streamalloc::device_arena_usage u = arena.usage();
  all_ok = all_ok && u.failures == 0;
  std::printf("\ntargets: arena (warp) >= 20x malloc+free: worst %.0fx, %s; arena (warp) >= 4x a per-thread "
              "atomicAdd, all lanes asking one size: worst %.1fx against unmerged atomics, %s (against the atomics nvcc "
              "merges: %.1fx; arena (block): %.1fx)\n",
              worst_vs_malloc, malloc_met ? "met" : "NOT met", worst_vs_unmerged, atomic_met ? "met" : "NOT met",
              worst_vs_atomic, worst_block_vs_atomic);
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"bench\": \"device_arena\",\n  \"gpu\": \"" << bench::json_escape(gpu.name)
        << "\",\n  \"driver\": " << gpu.driver << ",\n  \"runtime\": " << gpu.runtime << ",\n  \"threads\": " << threads
        << ",\n  \"reps\": " << su.reps << ",\n  \"worst_arena_vs_malloc\": " << worst_vs_malloc
        << ",\n  \"worst_arena_vs_atomicAdd_unmerged\": " << worst_vs_unmerged
        << ",\n  \"worst_arena_vs_atomicAdd_merged_by_nvcc\": " << worst_vs_atomic
        << ",\n  \"worst_block_vs_atomicAdd_merged_by_nvcc\": " << worst_block_vs_atomic << ",\n  \"rows\": [\n"
        << rows.str() << "\n  ]\n}\n";
    std::printf("wrote %s\n", json.c_str());
  }
  BENCH_CHECK(cudaFree(su.counters));
  BENCH_CHECK(cudaFree(su.lane_size));
  BENCH_CHECK(cudaFree(su.checksums));
  return all_ok ? 0 : 1;
}
