// Why scripts/gpu-check.sh leaves the multi-process NCCL case out of memcheck on two GPUs.
//
// Two processes (one per GPU) register four buffers with ncclCommRegister, run an all-reduce and
// an all-gather, check the gathered values and exit without waiting for each other. With the
// buffers from NCCL's own ncclMemAlloc, compute-sanitizer's memcheck reports NCCL's all-gather
// kernel writing "out of bounds ... inside the nearest allocation" (the peer's output, mapped
// into this process by NCCL) and the launch then fails; without memcheck both ranks read back
// the right values. Buffers from a streamalloc pool behave the same way (room_to_grow, as
// stream_buffer allocates), so it is not the pool's memory. Seen with NCCL 2.28 and driver 580 on
// two H200s (2026-11-28); run it again with newer versions before putting the case back.
//
//   nvcc -std=c++20 -arch=sm_90 -Iinclude scripts/nccl-memcheck-repro.cu -o /tmp/repro -lnccl -ldl
//   NCCL_NVLS_ENABLE=0 /tmp/repro ncclmem                        # ok
//   NCCL_NVLS_ENABLE=0 compute-sanitizer --report-api-errors no /tmp/repro ncclmem   # reports
//   ... /tmp/repro pool                                            # the same with pool memory
#include <streamalloc/streamalloc.hpp>

#include <cuda_runtime.h>
#include <nccl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::printf("%s failed\n", what);
    std::fflush(stdout);
    _exit(5);
  }
}
#define REPRO_OK(call) check((call) == 0, #call)

__global__ void fill(float* p, std::size_t n, int rank) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = static_cast<float>(rank + 1 + i % 7);
  }
}

int rank_main(int rank, const ncclUniqueId& id, bool from_pool) {
  constexpr std::size_t count = 80 * 1024 * 1024 / sizeof(float);
  REPRO_OK(cudaSetDevice(rank));
  ncclComm_t comm = nullptr;
  REPRO_OK(ncclCommInitRank(&comm, 2, id, rank));
  cudaStream_t s = nullptr;
  REPRO_OK(cudaStreamCreate(&s));
  const std::size_t sizes[4] = {count * 4, count * 4, count * 4, 2 * count * 4};  // reduce in, out; gather in, out
  float* buf[4] = {};
  std::unique_ptr<streamalloc::pool> p;
  if (from_pool) {
    p = std::make_unique<streamalloc::pool>(streamalloc::pool_properties{
        .location = streamalloc::memory_location::device(rank), .handle_types = streamalloc::shareable_handle_type::posix_fd});
    for (int i = 0; i < 4; ++i) buf[i] = static_cast<float*>(p->allocate(sizes[i], streamalloc::stream_ref{s}, streamalloc::placement::room_to_grow));
  } else {
    for (int i = 0; i < 4; ++i) REPRO_OK(ncclMemAlloc(reinterpret_cast<void**>(&buf[i]), sizes[i]));
  }
  void* handles[4] = {};
  for (int i = 0; i < 4; ++i) REPRO_OK(ncclCommRegister(comm, buf[i], sizes[i], &handles[i]));
  fill<<<256, 256, 0, s>>>(buf[0], count, rank);
  fill<<<256, 256, 0, s>>>(buf[2], count, rank);
  REPRO_OK(ncclAllReduce(buf[0], buf[1], count, ncclFloat, ncclSum, comm, s));
  REPRO_OK(ncclAllGather(buf[2], buf[3], count, ncclFloat, comm, s));
  REPRO_OK(cudaStreamSynchronize(s));
  std::vector<float> got(2 * count);
  REPRO_OK(cudaMemcpy(got.data(), buf[3], got.size() * sizeof(float), cudaMemcpyDeviceToHost));
  std::size_t wrong = 0;
  for (int r = 0; r < 2; ++r) {
    for (std::size_t i = 0; i < count; ++i) wrong += got[r * count + i] != static_cast<float>(r + 1 + i % 7) ? 1 : 0;
  }
  std::printf("rank %d: %zu wrong gathered\n", rank, wrong);
  for (void* h : handles) (void)ncclCommDeregister(comm, h);
  if (!from_pool) {
    for (float* b : buf) (void)ncclMemFree(b);
  }
  p.reset();  // the pool's destructor reports the four buffers still live and releases them
  (void)ncclCommDestroy(comm);
  return wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast on these machines
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "ncclmem" && mode != "pool") {
    std::printf("usage: %s ncclmem|pool\n", argv[0]);
    return 2;
  }
  ncclUniqueId id{};
  REPRO_OK(ncclGetUniqueId(&id));
  pid_t ranks[2];
  for (int r = 0; r < 2; ++r) {
    ranks[r] = fork();
    if (ranks[r] == 0) _exit(rank_main(r, id, mode == "pool"));
  }
  bool ok = true;
  for (pid_t pid : ranks) {
    int status = 0;
    waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  std::printf("%s: %s\n", mode.c_str(), ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}
