// streamalloc's main demo (what the README's quick start runs).
//
// It shows the driver loaded at run time; a buffer that grows in place by mapping more physical
// memory behind the addresses it already has, with no copy and no pointer change; and the pool
// handing memory from one stream to another in stream order.
//
// Without a usable GPU it says why and exits 77.

#include <streamalloc/streamalloc.hpp>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

__global__ void fill(std::uint32_t* p, std::size_t n, std::uint32_t first) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = first + static_cast<std::uint32_t>(i);
  }
}

__global__ void count_wrong(const std::uint32_t* p, std::size_t n, unsigned long long* wrong) {
  unsigned long long bad = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    bad += p[i] != static_cast<std::uint32_t>(i) ? 1 : 0;
  }
  if (bad) atomicAdd(wrong, bad);
}

bool ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

}  // namespace

int main() {
  using namespace streamalloc;
  if (!driver_available()) {
    std::printf("streamalloc demo: no usable GPU, nothing to run.\n  reason: %s\n",
                driver_problem().c_str());
    return 77;
  }
  try {
    constexpr std::size_t MiB = std::size_t{1} << 20;
    const auto gpu = memory_location::device(0);
    std::printf("streamalloc %d.%d.%d on %s (driver %d)\n", STREAMALLOC_VERSION_MAJOR,
                STREAMALLOC_VERSION_MINOR, STREAMALLOC_VERSION_PATCH, device_name(0).c_str(),
                driver_version());
    require_virtual_memory(0);
    if (!ok(cudaSetDevice(0), "cudaSetDevice")) return 1;

    const std::size_t chunk = 64 * MiB;
    const std::size_t capacity = 16 * chunk;  // 1 GiB of addresses, no memory behind them yet
    address_reservation va(capacity);
    std::vector<mapping> mapped;
    std::size_t size = 0;
    auto grow_to = [&](std::size_t bytes) {
      physical_allocation more(bytes - size, gpu);  // released at scope end; the mapping keeps it
      mapped.emplace_back(va, size, more);
      set_access(va.address() + size, bytes - size, {{gpu, access_flags::read_write}});
      size = bytes;
    };

    const std::size_t free_before = device_memory(0).free;
    grow_to(chunk);
    auto* data = static_cast<std::uint32_t*>(va.data());
    fill<<<512, 256>>>(data, chunk / 4, 0);
    std::printf("  buffer at %p: %zu MiB, filled by a kernel\n", va.data(), size / MiB);

    grow_to(4 * chunk);  // grow in place
    fill<<<512, 256>>>(data + chunk / 4, (size - chunk) / 4, static_cast<std::uint32_t>(chunk / 4));
    std::printf("  buffer at %p: %zu MiB, grown in place (same address, nothing copied)\n",
                va.data(), size / MiB);

    unsigned long long* wrong = nullptr;
    unsigned long long host_wrong = ~0ULL;
    if (!ok(cudaMalloc(&wrong, sizeof *wrong), "cudaMalloc") ||
        !ok(cudaMemset(wrong, 0, sizeof *wrong), "cudaMemset")) return 1;
    count_wrong<<<512, 256>>>(data, size / 4, wrong);
    if (!ok(cudaMemcpy(&host_wrong, wrong, sizeof host_wrong, cudaMemcpyDeviceToHost), "cudaMemcpy")) return 1;
    cudaFree(wrong);
    const std::size_t free_grown = device_memory(0).free;
    std::printf("  checked %zu words across the growth: %llu wrong\n", size / 4, host_wrong);

    mapped.clear();  // unmap: the physical memory goes back to the device
    const std::size_t free_after = device_memory(0).free;
    std::printf("  device free memory: %zu MiB before, %zu MiB grown, %zu MiB after unmapping\n",
                free_before / MiB, free_grown / MiB, free_after / MiB);
    if (host_wrong != 0) return 1;

    // The pool: stream-ordered allocation, memory handed from one stream to another.
    pool p(pool_properties{.release_threshold = SIZE_MAX});
    stream a(0), b(0);
    auto* x = static_cast<std::uint32_t*>(p.allocate(64 * MiB, a));
    fill<<<512, 256, 0, a.get()>>>(x, 16 * MiB, 0);
    event ready;
    ready.record(a);
    b.wait(ready);  // b runs after the fill, and the pool knows it
    p.deallocate(x, b);
    void* y = p.allocate(64 * MiB, b);  // freed on b: reused on b at once
    std::printf("  pool: 64 MiB freed on stream b is reused on b at once: %s\n", y == x ? "yes" : "no");
    p.deallocate(y, b);
    b.synchronize();
    const auto st = p.statistics();
    std::printf("  pool: %zu MiB reserved, %zu live allocations, high-water %zu MiB used\n",
                st.reserved_current / MiB, st.live_allocations, st.used_high / MiB);
    return y == x ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "streamalloc demo failed: %s\n", e.what());
    return 1;
  }
}
