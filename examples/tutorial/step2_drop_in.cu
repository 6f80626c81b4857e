// Tutorial step 2: streamalloc as a drop-in. The program of step 1, with cudaMallocAsync and
// cudaFreeAsync replaced by streamalloc::allocate and streamalloc::deallocate on the same raw
// cudaStream_t handles, wrapped in streamalloc::stream_ref. Memory now comes from the current
// streamalloc pool of the stream's device. Everything else (streams, event, kernels, copies)
// is unchanged. docs/tutorial.md explains what the pool learns, and what it cannot.
//
// Without a usable GPU it says why and exits 77.

#include <streamalloc/streamalloc.hpp>

#include "../common.cuh"
#include "kernels.cuh"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

// The kernels the steps share (examples/tutorial/kernels.cuh).
using tutorial::fill;
using tutorial::square;

constexpr std::size_t n = std::size_t{1} << 21;
constexpr int batches = 12;

int run() {
  // The application's own streams and event, made and destroyed by raw CUDA calls as before.
  cudaStream_t producer = nullptr, consumer = nullptr;
  example::check_cuda(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  example::check_cuda(cudaStreamCreateWithFlags(&consumer, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  cudaEvent_t filled = nullptr;
  example::check_cuda(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming), "cudaEventCreateWithFlags");

  // streamalloc takes a stream as a stream_ref, made explicitly (a stray 0 never becomes a
  // stream). resolved() looks the stream's identity up once (cuStreamGetId) instead of at each call.
  const streamalloc::stream_ref prod = streamalloc::stream_ref{producer}.resolved();
  const streamalloc::stream_ref cons = streamalloc::stream_ref{consumer}.resolved();

  std::vector<std::vector<std::uint32_t>> results(batches, std::vector<std::uint32_t>(n));
  for (int b = 0; b < batches; ++b) {
    auto* in = static_cast<std::uint32_t*>(streamalloc::allocate(n * sizeof(std::uint32_t), prod));
    fill<<<256, 256, 0, producer>>>(in, n, static_cast<std::uint32_t>(b));
    example::check_cuda(cudaGetLastError(), "fill");

    // A raw event: the GPU orders the consumer after the fill. The pool does not see it (it is
    // not the driver), which only costs reuse, never correctness.
    example::check_cuda(cudaEventRecord(filled, producer), "cudaEventRecord");
    example::check_cuda(cudaStreamWaitEvent(consumer, filled, 0), "cudaStreamWaitEvent");

    auto* out = static_cast<std::uint32_t*>(streamalloc::allocate(n * sizeof(std::uint32_t), cons));
    square<<<256, 256, 0, consumer>>>(in, out, n);
    example::check_cuda(cudaGetLastError(), "square");
    example::check_cuda(
        cudaMemcpyAsync(results[b].data(), out, n * sizeof(std::uint32_t), cudaMemcpyDeviceToHost, consumer),
        "cudaMemcpyAsync");

    streamalloc::deallocate(in, cons);   // the same rule as cudaFreeAsync: every use ordered before
    streamalloc::deallocate(out, cons);  // reusable by the consumer at once
  }
  // Synchronizing through the stream_ref (cudaStreamSynchronize underneath) also tells the
  // pool that the frees made on the consumer have run: their memory is reusable by any stream,
  // and the pool applies its release threshold.
  (void)cons.synchronize();

  std::size_t wrong = 0;
  for (int b = 0; b < batches; ++b) {
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t v = static_cast<std::uint32_t>(i % 1000) + static_cast<std::uint32_t>(b);
      wrong += results[b][i] != v * v ? 1 : 0;
    }
  }
  const streamalloc::pool_statistics st = streamalloc::current_pool(cons.device()).statistics();
  std::printf("step 2 (drop-in): %d batches, %zu wrong values; current pool: %zu live allocation(s), "
              "used high %zu MiB, reserved high %zu MiB, now %zu MiB\n",
              batches, wrong, st.live_allocations, st.used_high >> 20, st.reserved_high >> 20,
              st.reserved_current >> 20);
  example::expect(wrong == 0, "results");
  example::expect(st.live_allocations == 0, "every allocation freed");

  example::check_cuda(cudaEventDestroy(filled), "cudaEventDestroy");
  example::check_cuda(cudaStreamDestroy(consumer), "cudaStreamDestroy");
  example::check_cuda(cudaStreamDestroy(producer), "cudaStreamDestroy");
  std::printf("step 2 OK\n");
  return 0;
}

}  // namespace

int main() { return example::main_of(run); }  // also catches what streamalloc throws: it reports failures as exceptions
