// Tutorial step 5: handing the pool to library code through a memory resource. A library
// function that needs temporary device memory takes CCCL's type-erased stream-ordered resource
// (cuda::mr::async_resource_ref<cuda::mr::device_accessible>), so it knows nothing of
// streamalloc; the program gives it a streamalloc::device_resource over its pool. The
// library's temporaries then come from the same pool as the program's buffers, in the order of
// the stream it is given, and are reused from one call to the next.
//
// Without a usable GPU it says why and exits 77.

#include <streamalloc/streamalloc.hpp>

#include "../common.cuh"
#include "kernels.cuh"

#include <cuda/memory_resource>
#include <cuda/stream_ref>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

using tutorial::fill;  // shared by the steps: examples/tutorial/kernels.cuh

}  // namespace

// --- a library written against CCCL, not against streamalloc ------------------------------------
namespace mylib {

/// Any stream-ordered resource whose memory kernels may use.
using device_memory = cuda::mr::async_resource_ref<cuda::mr::device_accessible>;

__global__ void square(const std::uint32_t* in, std::uint32_t* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] = in[i] * in[i];
  }
}
__global__ void add_next(const std::uint32_t* sq, std::uint32_t* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] = sq[i] + sq[(i + 1) % n];
  }
}

/// out[i] = in[i]^2 + in[i + 1]^2 (wrapping), in the order of `s`, through a temporary buffer
/// taken from `mr` and given back to it on `s`.
inline void sum_of_next_squares(device_memory mr, cuda::stream_ref s, const std::uint32_t* in, std::uint32_t* out,
                                std::size_t n) {
  const std::size_t bytes = n * sizeof(std::uint32_t);
  auto* squares = static_cast<std::uint32_t*>(mr.allocate_async(bytes, alignof(std::uint32_t), s));
  square<<<256, 256, 0, s.get()>>>(in, squares, n);
  example::check_cuda(cudaGetLastError(), "mylib::square");
  add_next<<<256, 256, 0, s.get()>>>(squares, out, n);
  example::check_cuda(cudaGetLastError(), "mylib::add_next");
  mr.deallocate_async(squares, bytes, alignof(std::uint32_t), s);  // after the kernels, in s's order
}

}  // namespace mylib

namespace {

constexpr std::size_t n = std::size_t{1} << 21;
constexpr std::size_t bytes = n * sizeof(std::uint32_t);
constexpr int calls = 8;

int run() {
  streamalloc::pool pool({.release_threshold = SIZE_MAX});
  // A CCCL resource over the pool whose type says its memory is for kernels (device_accessible).
  streamalloc::device_resource mr(pool);
  static_assert(streamalloc::device_memory_resource<streamalloc::device_resource>);
  streamalloc::stream s(0);

  streamalloc::stream_buffer<std::uint32_t> in(n, s, mr), out(n, s, mr);
  std::size_t wrong = 0;
  std::size_t grows_after_first = 0;
  for (int c = 0; c < calls; ++c) {
    fill<<<256, 256, 0, s.get()>>>(in.data(), n, static_cast<std::uint32_t>(c));
    example::check_cuda(cudaGetLastError(), "fill");
    // The library gets the resource and the stream; CCCL's stream_ref carries only the handle,
    // so the pool looks the stream up by its id (one cuStreamGetId) at each call.
    mylib::sum_of_next_squares(mr, cuda::stream_ref(s.get()), in.data(), out.data(), n);
    const std::vector<std::uint32_t> host = out.to_host();  // copies on s and synchronizes s
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t a = static_cast<std::uint32_t>(i % 1000) + static_cast<std::uint32_t>(c);
      const std::uint32_t b = static_cast<std::uint32_t>((i + 1) % n % 1000) + static_cast<std::uint32_t>(c);
      wrong += host[i] != a * a + b * b ? 1 : 0;
    }
    if (c == 0) grows_after_first = pool.statistics().grows;
  }
  const streamalloc::pool_statistics st = pool.statistics();
  std::printf("step 5 (resources): %d library calls, %zu wrong values; pool used high %zu MiB (two buffers and the "
              "library's temporary), grew %zu time(s), none after the first call\n",
              calls, wrong, st.used_high >> 20, st.grows);
  example::expect(wrong == 0, "results");
  example::expect(st.used_high >= 3 * bytes, "the library's temporary came from the pool");
  example::expect(st.grows == grows_after_first, "the temporary is reused from call to call");
  std::printf("step 5 OK\n");
  return 0;
}

}  // namespace

int main() { return example::main_of(run); }
