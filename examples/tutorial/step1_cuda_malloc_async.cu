// Tutorial step 1: the starting point, plain CUDA. Batches go through two streams: a producer
// fills a buffer, a consumer squares it into a second buffer and copies the result to the host.
// Memory comes from the driver's pool (cudaMallocAsync / cudaFreeAsync), and an event orders
// the consumer after the producer. docs/tutorial.md walks from here to streamalloc.
//
// Without a usable GPU it says why and exits 77.

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

constexpr std::size_t n = std::size_t{1} << 21;  // 8 MiB of uint32 per buffer
constexpr int batches = 12;

}  // namespace

int main() {
  if (!example::have_gpu()) return example::no_gpu;

  // Every CUDA call is checked (example::check_cuda, in examples/common.cuh): a tutorial that
  // ignores errors teaches ignoring them.
  cudaStream_t producer = nullptr, consumer = nullptr;
  example::check_cuda(cudaStreamCreateWithFlags(&producer, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  example::check_cuda(cudaStreamCreateWithFlags(&consumer, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  cudaEvent_t filled = nullptr;
  example::check_cuda(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming), "cudaEventCreateWithFlags");

  std::vector<std::vector<std::uint32_t>> results(batches, std::vector<std::uint32_t>(n));
  for (int b = 0; b < batches; ++b) {
    // Allocated in the producer's order: usable by work enqueued on the producer from now on.
    std::uint32_t* in = nullptr;
    example::check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&in), n * sizeof(std::uint32_t), producer),
                        "cudaMallocAsync");
    fill<<<256, 256, 0, producer>>>(in, n, static_cast<std::uint32_t>(b));
    example::check_cuda(cudaGetLastError(), "fill");

    // The consumer runs after the fill: an event recorded on the producer, waited for by the consumer.
    example::check_cuda(cudaEventRecord(filled, producer), "cudaEventRecord");
    example::check_cuda(cudaStreamWaitEvent(consumer, filled, 0), "cudaStreamWaitEvent");

    std::uint32_t* out = nullptr;
    example::check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&out), n * sizeof(std::uint32_t), consumer),
                        "cudaMallocAsync");
    square<<<256, 256, 0, consumer>>>(in, out, n);
    example::check_cuda(cudaGetLastError(), "square");
    example::check_cuda(
        cudaMemcpyAsync(results[b].data(), out, n * sizeof(std::uint32_t), cudaMemcpyDeviceToHost, consumer),
        "cudaMemcpyAsync");

    // Both freed on the consumer, whose order already follows every use of them (the fill on
    // the producer through the event). Freeing `in` on the producer instead would be a race:
    // the producer is not ordered after the consumer's square.
    example::check_cuda(cudaFreeAsync(in, consumer), "cudaFreeAsync");
    example::check_cuda(cudaFreeAsync(out, consumer), "cudaFreeAsync");
  }
  example::check_cuda(cudaStreamSynchronize(consumer), "cudaStreamSynchronize");  // before reading the results

  std::size_t wrong = 0;
  for (int b = 0; b < batches; ++b) {
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t v = static_cast<std::uint32_t>(i % 1000) + static_cast<std::uint32_t>(b);
      wrong += results[b][i] != v * v ? 1 : 0;
    }
  }
  std::printf("step 1 (cudaMallocAsync): %d batches of %zu MiB through two streams, %zu wrong values\n", batches,
              n * sizeof(std::uint32_t) >> 20, wrong);
  example::expect(wrong == 0, "results");

  example::check_cuda(cudaEventDestroy(filled), "cudaEventDestroy");
  example::check_cuda(cudaStreamDestroy(consumer), "cudaStreamDestroy");
  example::check_cuda(cudaStreamDestroy(producer), "cudaStreamDestroy");
  std::printf("step 1 OK\n");
  return 0;
}
