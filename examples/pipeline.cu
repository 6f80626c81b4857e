// A multi-stream pipeline: batches go through three stages on three streams (upload, compute,
// download). Each stage hands its buffer to the next with an ordering token, so no stage
// synchronizes the host, and the pool reuses the memory of finished batches on the upload
// stream without asking the driver for more.

#include <streamalloc/streamalloc.hpp>

#include "common.cuh"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <deque>
#include <vector>

namespace {
__global__ void scale(float* p, std::size_t n, float k) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] *= k;
  }
}
}  // namespace

int main() {
  if (!example::have_gpu()) return example::no_gpu;
  streamalloc::pool pool;
  const streamalloc::device_resource mr(pool);
  streamalloc::stream upload(0), compute(0), download(0);

  constexpr int batches = 64;
  constexpr std::size_t n = 1 << 20;  // 4 MiB of floats per batch
  std::vector<std::vector<float>> in(batches, std::vector<float>(n)), out(batches, std::vector<float>(n));
  for (int b = 0; b < batches; ++b) {
    for (std::size_t i = 0; i < n; ++i) in[b][i] = static_cast<float>(b * 1000 + i % 1000);
  }

  std::deque<streamalloc::stream_buffer<float>> in_flight;
  for (int b = 0; b < batches; ++b) {
    streamalloc::stream_buffer<float> buf(n, upload, mr);
    buf.copy_from(in[b]);
    buf.set_stream(compute, streamalloc::order_after(compute, upload));
    scale<<<128, 256, 0, compute.get()>>>(buf.data(), n, 2.0f);
    buf.set_stream(download, streamalloc::order_after(download, compute));
    buf.copy_to(out[b]);
    // Freed on the download stream when it leaves the deque. The upload stream reuses that
    // memory once the pool knows the free has executed (it asks the device when it would
    // otherwise grow: opportunistic reuse), never before; until then it takes other memory.
    in_flight.push_back(std::move(buf));
    if (in_flight.size() > 4) in_flight.pop_front();
  }
  in_flight.clear();
  (void)download.synchronize();

  std::size_t wrong = 0;
  for (int b = 0; b < batches; ++b) {
    for (std::size_t i = 0; i < n; ++i) wrong += out[b][i] != 2.0f * in[b][i] ? 1 : 0;
  }
  const auto st = pool.statistics();
  std::printf("%d batches of %zu MiB through 3 streams: %zu wrong values; pool reserved high %zu MiB for %zu MiB "
              "of batches in flight\n",
              batches, n * sizeof(float) >> 20, wrong, st.reserved_high >> 20, 5 * n * sizeof(float) >> 20);
  example::expect(wrong == 0, "pipeline results");
  example::expect(st.reserved_high < std::size_t{batches} * n * sizeof(float), "memory reused across batches");
  std::printf("pipeline OK\n");
  return 0;
}
