// What the driver calls the pool is built on cost, measured on the host.
//
// The pool's design rests on these numbers: how growth by many 2 MiB handles compares with
// growth by one large handle, whether cuMemSetAccess pays per handle or per call, what the
// calls on the allocation fast path would cost (stream ids, events), and how fast the driver's
// own pool grows.
//
//   bench_vmm_costs [--reps N]

#include <streamalloc/vmm.hpp>

#include "bench_common.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

namespace {
using namespace streamalloc;
using clk = std::chrono::steady_clock;
constexpr std::size_t MiB = std::size_t{1} << 20;
const auto gpu = memory_location::device(0);

double us_since(clk::time_point t) { return std::chrono::duration<double, std::micro>(clk::now() - t).count(); }
void rw(CUdeviceptr p, std::size_t n) { set_access(p, n, {{gpu, access_flags::read_write}}); }

template <class F>
double ns_per_call(int n, F f) {
  auto t = clk::now();
  for (int i = 0; i < n; ++i) f();
  return us_since(t) * 1000.0 / n;
}
}  // namespace

int main(int argc, char** argv) {
  bench::require_gpu("bench_vmm_costs");
  int reps = 15;
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--reps") && i + 1 < argc) reps = std::atoi(argv[++i]);
  BENCH_CHECK(cudaSetDevice(0));
  BENCH_CHECK(cudaFree(nullptr));
  bench::describe_gpu();
  std::printf("host time per call, median of %d (microseconds)\n\n", reps);

  std::printf("%-12s %8s %8s %11s %8s %8s\n", "handle", "create", "map", "set access", "unmap", "release");
  for (std::size_t h : {2 * MiB, 32 * MiB, 64 * MiB, 512 * MiB}) {
    std::vector<double> c, m, a, u, r;
    for (int i = 0; i < reps; ++i) {
      address_reservation va(h);
      auto t = clk::now();
      physical_allocation mem(h, gpu);
      c.push_back(us_since(t));
      t = clk::now();
      mapping mp(va.address(), mem);
      m.push_back(us_since(t));
      t = clk::now();
      rw(mp.address(), h);
      a.push_back(us_since(t));
      t = clk::now();
      mp.unmap();
      u.push_back(us_since(t));
      t = clk::now();
      mem = physical_allocation();
      r.push_back(us_since(t));
    }
    std::printf("%6zu MiB   %8.1f %8.1f %11.1f %8.1f %8.1f\n", h / MiB, bench::median(c), bench::median(m),
                bench::median(a), bench::median(u), bench::median(r));
  }

  // Growth by 64 MiB: one handle, or 32 handles of 2 MiB with one access call for all.
  {
    std::vector<double> one, many_create, many_map, many_access;
    for (int i = 0; i < reps; ++i) {
      address_reservation va(64 * MiB), va2(64 * MiB);
      auto t = clk::now();
      {
        physical_allocation mem(64 * MiB, gpu);
        mapping mp(va.address(), mem);
        rw(va.address(), 64 * MiB);
        one.push_back(us_since(t));
        std::vector<physical_allocation> hs;
        std::vector<mapping> ms;
        t = clk::now();
        for (int k = 0; k < 32; ++k) hs.emplace_back(2 * MiB, gpu);
        many_create.push_back(us_since(t));
        t = clk::now();
        for (int k = 0; k < 32; ++k) ms.emplace_back(va2.address() + k * 2 * MiB, hs[k]);
        many_map.push_back(us_since(t));
        t = clk::now();
        rw(va2.address(), 64 * MiB);
        many_access.push_back(us_since(t));
      }
    }
    std::printf("\ngrowing by 64 MiB: one handle (create+map+access) %.1f us;\n"
                "  32 handles of 2 MiB: create %.1f + map %.1f + one access call over all %.1f = %.1f us\n",
                bench::median(one), bench::median(many_create), bench::median(many_map),
                bench::median(many_access),
                bench::median(many_create) + bench::median(many_map) + bench::median(many_access));
  }

  // Where the handles go: 128 handles of 64 MiB (8 GiB) made, mapped and made accessible one
  // after another, packed in one range, 1 GiB apart, or each in the middle of the largest
  // unused range of a 512 GiB reservation (how the pool places large allocations so they can
  // grow in place). Every new GiB of addresses needs new page-table pages on the GPU.
  {
    const std::size_t h = 64 * MiB, count = 128, GiB = 1024 * MiB;
    std::printf("\n128 handles of 64 MiB, create + map + access each, by placement (ms, median of 3):\n");
    for (int layout = 0; layout < 3; ++layout) {
      std::vector<double> ms;
      for (int rep = 0; rep < 3; ++rep) {
        const std::size_t span = layout == 0 ? count * h : layout == 1 ? count * GiB : 512 * GiB;
        address_reservation va(span);
        std::vector<std::pair<std::size_t, std::size_t>> unused{{0, span}};  // offset, size
        std::vector<physical_allocation> hs;
        std::vector<mapping> maps;
        hs.reserve(count);
        maps.reserve(count);
        auto t = clk::now();
        for (std::size_t k = 0; k < count; ++k) {
          std::size_t at = layout == 0 ? k * h : k * GiB;
          if (layout == 2) {
            auto best = std::max_element(unused.begin(), unused.end(),
                                         [](auto& a, auto& b) { return a.second < b.second; });
            const auto [start, size] = *best;
            at = start + (size - h) / 2 / (2 * MiB) * (2 * MiB);
            *best = {start, at - start};
            unused.emplace_back(at + h, start + size - at - h);
          }
          hs.emplace_back(h, gpu);
          maps.emplace_back(va.address() + at, hs.back());
          rw(va.address() + at, h);
        }
        ms.push_back(us_since(t) / 1000.0);
      }
      static const char* names[] = {"packed", "1 GiB apart", "middle of the largest unused range"};
      std::printf("  %-36s %8.2f ms (%.1f us a handle)\n", names[layout], bench::median(ms),
                  bench::median(ms) * 1000.0 / count);
    }
  }

  // Growth to 8 GiB by handles of PyTorch's expandable-segment size (20 MiB) against the pool's
  // 64 MiB chunks, made, mapped and made accessible by 1 to 8 threads at once, each in its own
  // part of one reservation. Smaller chunks would hold less memory on the recorded traces
  // (docs/deep-learning.md) but cost a create, a map and an access call each: this says whether
  // making them on several threads (ahead of need, off the allocating thread) hides that.
  {
    const std::size_t total = 8192 * MiB;
    std::printf("\ngrowing to 8 GiB by handles made by T threads at once, each create + map + access (ms, median of 3):\n");
    std::printf("%-8s %10s %10s %10s %10s\n", "handle", "T=1", "T=2", "T=4", "T=8");
    for (std::size_t h : {20 * MiB, 64 * MiB}) {
      const std::size_t count = (total + h - 1) / h;
      std::printf("%3zu MiB ", h / MiB);
      for (unsigned threads : {1u, 2u, 4u, 8u}) {
        std::vector<double> ms;
        for (int rep = 0; rep < 3; ++rep) {
          address_reservation va(count * h);
          std::vector<std::vector<physical_allocation>> hs(threads);
          std::vector<std::vector<mapping>> maps(threads);
          for (unsigned k = 0; k < threads; ++k) {
            hs[k].reserve(count / threads + 1);
            maps[k].reserve(count / threads + 1);
          }
          std::vector<std::thread> pool;
          auto t = clk::now();
          for (unsigned k = 0; k < threads; ++k) {
            pool.emplace_back([&, k] {
              BENCH_CHECK(cudaSetDevice(0));  // the primary context, current on this thread
              for (std::size_t j = k; j < count; j += threads) {
                hs[k].emplace_back(h, gpu);
                maps[k].emplace_back(va.address() + j * h, hs[k].back());
                rw(va.address() + j * h, h);
              }
            });
          }
          for (auto& th : pool) th.join();
          ms.push_back(us_since(t) / 1000.0);
        }
        std::printf(" %10.2f", bench::median(ms));
      }
      std::printf("   (%zu handles)\n", count);
    }
  }

  // Mapping part of a handle (offset != 0): the driver's answer.
  {
    address_reservation va(4 * MiB);
    physical_allocation mem(4 * MiB, gpu);
    CUresult r = detail::cu::cuMemMap_nothrow(va.address(), 2 * MiB, 2 * MiB, mem.handle(), 0ULL);
    std::printf("\nmapping 2 MiB of a 4 MiB handle at offset 2 MiB: %s\n", detail::result_name(r).c_str());
    if (r == CUDA_SUCCESS) (void)detail::cu::cuMemUnmap_nothrow(va.address(), 2 * MiB);
  }

  // Calls a fast path might make.
  {
    cudaStream_t s;
    BENCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e;
    BENCH_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    unsigned long long id = 0;
    const int n = 100000;
    std::printf("\nnanoseconds per call (mean of %d):\n", n);
    std::printf("  cudaStreamGetId           %8.1f\n", ns_per_call(n, [&] { cudaStreamGetId(s, &id); }));
    std::printf("  cudaStreamGetId(per-thread)%7.1f\n", ns_per_call(n, [&] { cudaStreamGetId(cudaStreamPerThread, &id); }));
    std::printf("  cudaEventRecord           %8.1f\n", ns_per_call(n, [&] { cudaEventRecord(e, s); }));
    BENCH_CHECK(cudaStreamSynchronize(s));
    std::printf("  cudaEventQuery (complete) %8.1f\n", ns_per_call(n, [&] { (void)cudaEventQuery(e); }));
    std::printf("  cudaStreamQuery (idle)    %8.1f\n", ns_per_call(n, [&] { (void)cudaStreamQuery(s); }));
    std::printf("  cudaStreamWaitEvent       %8.1f\n", ns_per_call(n, [&] { cudaStreamWaitEvent(s, e, 0); }));
    BENCH_CHECK(cudaStreamSynchronize(s));
    // How soon an event recorded on an idle stream completes, as the host sees it: the pool
    // covers another thread's stream's frees with such an event and, before growing, polls it
    // for up to 50 us (pool_core::fresh_cover_poll).
    std::vector<double> until_done;
    for (int i = 0; i < 1000; ++i) {
      BENCH_CHECK(cudaStreamSynchronize(s));
      const auto t = clk::now();
      BENCH_CHECK(cudaEventRecord(e, s));
      while (cudaEventQuery(e) == cudaErrorNotReady) {
      }
      until_done.push_back(us_since(t));
    }
    std::sort(until_done.begin(), until_done.end());
    std::printf("  an event on an idle stream, record until a query says done: median %.1f us, 99th percentile %.1f, "
                "max %.1f\n",
                until_done[500], until_done[990], until_done.back());
    cudaEventDestroy(e);
    cudaStreamDestroy(s);
  }

  // How fast the driver's own pool grows from nothing to 8 GiB in use.
  {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location = {cudaMemLocationTypeDevice, 0};
    cudaStream_t s;
    BENCH_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::printf("\ndriver pool (cudaMemPoolCreate, new each time) growing to 8 GiB in use:\n");
    for (std::size_t piece : {2 * MiB, 64 * MiB}) {
      std::vector<double> ms;
      for (int i = 0; i < 3; ++i) {
        cudaMemPool_t pool;
        BENCH_CHECK(cudaMemPoolCreate(&pool, &props));
        std::vector<void*> ptrs;
        auto t = clk::now();
        for (std::size_t got = 0; got < 8192 * MiB; got += piece) {
          void* p = nullptr;
          BENCH_CHECK(cudaMallocFromPoolAsync(&p, piece, pool, s));
          ptrs.push_back(p);
        }
        BENCH_CHECK(cudaStreamSynchronize(s));
        ms.push_back(us_since(t) / 1000.0);
        for (void* p : ptrs) BENCH_CHECK(cudaFreeAsync(p, s));
        BENCH_CHECK(cudaStreamSynchronize(s));
        BENCH_CHECK(cudaMemPoolDestroy(pool));
      }
      std::printf("  in %2zu MiB allocations: %.1f ms\n", piece / MiB, bench::median(ms));
    }
    cudaStreamDestroy(s);
  }
  return 0;
}
