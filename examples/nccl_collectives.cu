// NCCL over streamalloc pool memory: one process drives every GPU of the machine, each GPU with
// its own pool and stream. The buffers NCCL reads and writes are ordinary stream_buffers: NCCL's
// kernels run on the buffer's stream, so the pool's stream order covers them like any other
// work, and a buffer freed right after a collective is reused only once the collective has run.
// Registering the buffers with ncclCommRegister (NCCL 2.19 and later) lets NCCL skip its own
// staging copies where it can; the registration must end before the memory goes back to the pool.
//
// NVLink multicast (NVLS) is turned off before NCCL starts: it must not be used on the machines
// this project runs on, and pool memory does not need it.

#include <streamalloc/streamalloc.hpp>

#include "common.cuh"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

namespace {

void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) {
    std::fprintf(stderr, "FAILED: %s: %s (%s)\n", what, ncclGetErrorString(r), ncclGetLastError(nullptr));
    std::exit(1);
  }
}

__global__ void fill(float* p, std::size_t n, float value) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = value;
  }
}

/// One GPU's share: its pool, its stream, and the buffers of one all-reduce and one all-gather.
struct gpu {
  streamalloc::pool pool;
  streamalloc::stream stream;
  streamalloc::stream_buffer<float> reduce_in, reduce_out, gather_in, gather_out;
  std::vector<void*> registrations;

  gpu(int device, int gpus, std::size_t n)
      : pool(streamalloc::pool_properties{.location = streamalloc::memory_location::device(device)}),
        stream(device),
        reduce_in(n, stream, pool),
        reduce_out(n, stream, pool),
        gather_in(n, stream, pool),
        gather_out(n * static_cast<std::size_t>(gpus), stream, pool) {
    fill<<<256, 256, 0, stream.get()>>>(reduce_in.data(), n, static_cast<float>(device + 1));
    fill<<<256, 256, 0, stream.get()>>>(gather_in.data(), n, static_cast<float>(device + 1));
  }
};

}  // namespace

int main() {
  if (!example::have_gpu()) return example::no_gpu;
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);

  int gpus = 0;
  example::check_cuda(cudaGetDeviceCount(&gpus), "cudaGetDeviceCount");
  std::vector<int> devices(static_cast<std::size_t>(gpus));
  for (int d = 0; d < gpus; ++d) devices[static_cast<std::size_t>(d)] = d;
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(gpus));
  check_nccl(ncclCommInitAll(comms.data(), gpus, devices.data()), "ncclCommInitAll");

  constexpr std::size_t n = std::size_t{8} << 20;  // 32 MiB of floats per buffer
  std::vector<std::unique_ptr<gpu>> g;
  for (int d = 0; d < gpus; ++d) g.push_back(std::make_unique<gpu>(d, gpus, n));

  // Registration is optional: NCCL works on unregistered pool memory too.
  for (int d = 0; d < gpus; ++d) {
    auto& x = *g[static_cast<std::size_t>(d)];
    for (auto* b : {&x.reduce_in, &x.reduce_out, &x.gather_in, &x.gather_out}) {
      void* handle = nullptr;
      check_nccl(ncclCommRegister(comms[static_cast<std::size_t>(d)], b->data(), b->size() * sizeof(float), &handle),
                 "ncclCommRegister");
      x.registrations.push_back(handle);
    }
  }

  // One call per GPU, grouped: NCCL starts them together.
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (int d = 0; d < gpus; ++d) {
    auto& x = *g[static_cast<std::size_t>(d)];
    check_nccl(ncclAllReduce(x.reduce_in.data(), x.reduce_out.data(), n, ncclFloat, ncclSum,
                             comms[static_cast<std::size_t>(d)], x.stream.get()),
               "ncclAllReduce");
    check_nccl(ncclAllGather(x.gather_in.data(), x.gather_out.data(), n, ncclFloat, comms[static_cast<std::size_t>(d)],
                             x.stream.get()),
               "ncclAllGather");
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");

  // Every GPU holds the sum 1 + 2 + ... + gpus, and every GPU's contribution in its place.
  const float sum = static_cast<float>(gpus * (gpus + 1) / 2);
  std::size_t wrong = 0;
  for (int d = 0; d < gpus; ++d) {
    auto& x = *g[static_cast<std::size_t>(d)];
    std::vector<float> reduced(n), gathered(n * static_cast<std::size_t>(gpus));
    x.reduce_out.copy_to(reduced);
    x.gather_out.copy_to(gathered);
    example::check_cuda(cudaStreamSynchronize(x.stream.get()), "cudaStreamSynchronize");
    for (float v : reduced) wrong += v != sum ? 1 : 0;
    for (std::size_t i = 0; i < gathered.size(); ++i) wrong += gathered[i] != static_cast<float>(i / n + 1) ? 1 : 0;
    // The collectives have run (synchronized above): the registrations may end, then the buffers.
    for (void* handle : x.registrations) check_nccl(ncclCommDeregister(comms[static_cast<std::size_t>(d)], handle), "ncclCommDeregister");
  }
  std::printf("%d GPU(s): all-reduce and all-gather of %zu MiB per GPU over pool memory (registered with NCCL): "
              "%zu wrong values\n",
              gpus, n * sizeof(float) >> 20, wrong);
  g.clear();
  for (ncclComm_t c : comms) check_nccl(ncclCommDestroy(c), "ncclCommDestroy");
  example::expect(wrong == 0, "collective results");
  std::printf("nccl_collectives OK\n");
  return 0;
}
