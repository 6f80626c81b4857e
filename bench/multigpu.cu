// Pool memory used across GPUs, against cudaMalloc memory, in one process:
//
//   1. peer bandwidth (two GPUs or more): GPU 1 reads GPU 0's memory, by a copy engine
//      (cudaMemcpyAsync on a GPU 1 stream) and by a copy kernel on GPU 1; GPU 0's memory from
//      a streamalloc pool granted to GPU 1 (pool::set_access), against cudaMalloc memory with
//      cudaDeviceEnablePeerAccess. GB/s of bytes moved, and pool / cudaMalloc (target >= 0.98).
//   2. NCCL all-reduce (where NCCL is found): every GPU of the machine in one process, buffers
//      from a pool per GPU against cudaMalloc buffers, each unregistered and registered with
//      ncclCommRegister. Bus bandwidth as nccl-tests computes it (bytes / time x 2(n-1)/n), or,
//      with one GPU, where the bus carries nothing, the algorithm bandwidth (bytes / time); and
//      pool / cudaMalloc (target >= 0.98).
// Pointer import latency against cudaMemPoolImportPointer is bench_ipc's.
//
// Each figure is the median of the repetitions. NVLink multicast is turned off before NCCL starts.
//
//   bench_multigpu [--json FILE]

#include <streamalloc/streamalloc.hpp>

#include "bench_common.hpp"

#include <cuda_runtime.h>
#if STREAMALLOC_BENCH_NCCL
#include <nccl.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;
constexpr int reps = 20;

__global__ void copy_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    dst[i] = src[i];
  }
}

/// Median GB/s of `op` moving `bytes` on `stream` (a warm-up run first).
double gbps(cudaStream_t stream, std::size_t bytes, const std::function<void()>& op) {
  op();
  BENCH_CHECK(cudaStreamSynchronize(stream));
  const double ms = bench::median(bench::time_ms(stream, reps, op));
  return static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

void peer_bandwidth(bench::json_rows& rows) {
  int gpus = 0;
  BENCH_CHECK(cudaGetDeviceCount(&gpus));
  std::printf("1. GPU 1 reads GPU 0's memory, GB/s (median of %d)\n", reps);
  if (gpus < 2) {
    std::printf("   not measured: it needs two GPUs, this machine has %d\n\n", gpus);
    return;
  }
  int can = 0;
  BENCH_CHECK(cudaDeviceCanAccessPeer(&can, 1, 0));
  if (can == 0) {
    std::printf("   not measured: GPU 1 cannot access GPU 0's memory\n\n");
    return;
  }
  constexpr std::size_t bytes = 1024 * MiB;
  streamalloc::pool p(bench::kept());
  p.set_access(streamalloc::memory_location::device(1), streamalloc::access_flags::read_write);
  streamalloc::stream s0(0);
  void* from_pool = p.allocate(bytes, s0);
  BENCH_CHECK(cudaStreamSynchronize(s0.get()));
  void* from_malloc = nullptr;
  BENCH_CHECK(cudaSetDevice(0));
  BENCH_CHECK(cudaMalloc(&from_malloc, bytes));
  BENCH_CHECK(cudaMemset(from_malloc, 1, bytes));
  BENCH_CHECK(cudaSetDevice(1));
  const cudaError_t enabled = cudaDeviceEnablePeerAccess(0, 0);
  if (enabled != cudaSuccess && enabled != cudaErrorPeerAccessAlreadyEnabled) bench::check(enabled, "cudaDeviceEnablePeerAccess");
  (void)cudaGetLastError();
  void* local = nullptr;
  BENCH_CHECK(cudaMalloc(&local, bytes));
  cudaStream_t s1;
  BENCH_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  std::printf("   %-30s %10s %10s %8s\n", "", "pool", "cudaMalloc", "ratio");
  const auto row = [&](const char* name, const std::function<void(void*)>& op) {
    const double ours = gbps(s1, bytes, [&] { op(from_pool); });
    const double theirs = gbps(s1, bytes, [&] { op(from_malloc); });
    std::printf("   %-30s %10.1f %10.1f %8.3f\n", name, ours, theirs, ours / theirs);
    rows.add(name, "\"bytes\": " + std::to_string(bytes) + ", \"pool_gbps\": " + std::to_string(ours) +
                       ", \"malloc_gbps\": " + std::to_string(theirs) + ", \"ratio\": " + std::to_string(ours / theirs));
  };
  row("peer copy (copy engine)", [&](void* src) { BENCH_CHECK(cudaMemcpyAsync(local, src, bytes, cudaMemcpyDefault, s1)); });
  row("peer copy kernel", [&](void* src) {
    copy_kernel<<<1024, 512, 0, s1>>>(static_cast<const uint4*>(src), static_cast<uint4*>(local), bytes / sizeof(uint4));
  });
  std::printf("\n");
  BENCH_CHECK(cudaStreamDestroy(s1));
  BENCH_CHECK(cudaFree(local));
  BENCH_CHECK(cudaSetDevice(0));
  BENCH_CHECK(cudaFree(from_malloc));
  p.deallocate(from_pool, s0);
  BENCH_CHECK(cudaStreamSynchronize(s0.get()));
}

#if STREAMALLOC_BENCH_NCCL
void check_nccl(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) {
    std::fprintf(stderr, "%s failed: %s (%s)\n", what, ncclGetErrorString(r), ncclGetLastError(nullptr));
    std::exit(1);
  }
}

/// Each GPU's send and receive buffers of one size, from its pool or from cudaMalloc.
struct nccl_buffers {
  std::vector<void*> send, recv;
  std::vector<void*> registrations;
};

void nccl_allreduce(bench::json_rows& rows) {
  int gpus = 0;
  BENCH_CHECK(cudaGetDeviceCount(&gpus));
  std::vector<int> devices(static_cast<std::size_t>(gpus));
  for (int d = 0; d < gpus; ++d) devices[static_cast<std::size_t>(d)] = d;
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(gpus));
  check_nccl(ncclCommInitAll(comms.data(), gpus, devices.data()), "ncclCommInitAll");
  std::vector<std::unique_ptr<streamalloc::pool>> pools;
  std::vector<cudaStream_t> streams(static_cast<std::size_t>(gpus));
  for (int d = 0; d < gpus; ++d) {
    auto props = bench::kept();
    props.location = streamalloc::memory_location::device(d);
    pools.push_back(std::make_unique<streamalloc::pool>(props));
    BENCH_CHECK(cudaSetDevice(d));
    BENCH_CHECK(cudaStreamCreateWithFlags(&streams[static_cast<std::size_t>(d)], cudaStreamNonBlocking));
  }
  const bool bus = gpus > 1;
  std::printf("2. NCCL all-reduce (sum of floats) on %d GPU(s), %s GB/s (median of %d)\n", gpus,
              bus ? "bus" : "algorithm (one GPU: the bus carries nothing)", reps);
  std::printf("   %8s %-12s %10s %10s %8s\n", "MiB", "buffers", "pool", "cudaMalloc", "ratio");

  const auto make = [&](std::size_t bytes, bool pool_memory, bool registered) {
    nccl_buffers b;
    for (int d = 0; d < gpus; ++d) {
      const auto i = static_cast<std::size_t>(d);
      for (auto* list : {&b.send, &b.recv}) {
        void* p = nullptr;
        if (pool_memory) {
          p = pools[i]->allocate(bytes, streamalloc::stream_ref{streams[i]});
        } else {
          BENCH_CHECK(cudaSetDevice(d));
          BENCH_CHECK(cudaMalloc(&p, bytes));
        }
        BENCH_CHECK(cudaSetDevice(d));
        BENCH_CHECK(cudaMemsetAsync(p, 0, bytes, streams[i]));
        list->push_back(p);
        if (registered) {
          void* h = nullptr;
          check_nccl(ncclCommRegister(comms[i], p, bytes, &h), "ncclCommRegister");
          b.registrations.push_back(h);
        }
      }
    }
    return b;
  };
  const auto release = [&](nccl_buffers& b, bool pool_memory) {
    for (int d = 0; d < gpus; ++d) BENCH_CHECK(cudaStreamSynchronize(streams[static_cast<std::size_t>(d)]));
    for (std::size_t k = 0; k < b.registrations.size(); ++k) {
      check_nccl(ncclCommDeregister(comms[k / 2], b.registrations[k]), "ncclCommDeregister");
    }
    for (int d = 0; d < gpus; ++d) {
      const auto i = static_cast<std::size_t>(d);
      for (void* p : {b.send[i], b.recv[i]}) {
        if (pool_memory) {
          pools[i]->deallocate(p, streamalloc::stream_ref{streams[i]});
        } else {
          BENCH_CHECK(cudaSetDevice(d));
          BENCH_CHECK(cudaFree(p));
        }
      }
    }
  };
  const auto measure = [&](std::size_t bytes, const nccl_buffers& b) {
    const auto op = [&] {
      check_nccl(ncclGroupStart(), "ncclGroupStart");
      for (int d = 0; d < gpus; ++d) {
        const auto i = static_cast<std::size_t>(d);
        check_nccl(ncclAllReduce(b.send[i], b.recv[i], bytes / sizeof(float), ncclFloat, ncclSum, comms[i], streams[i]),
                   "ncclAllReduce");
      }
      check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    };
    // Times on GPU 0's stream; every rank's collective is part of one group, so GPU 0's ends
    // when the all-reduce does.
    BENCH_CHECK(cudaSetDevice(0));
    const double algorithm = gbps(streams[0], bytes, op);
    return bus ? algorithm * 2.0 * (gpus - 1) / gpus : algorithm;
  };

  for (const std::size_t mib : {std::size_t{1}, std::size_t{16}, std::size_t{256}}) {
    const std::size_t bytes = mib * MiB;
    for (const bool registered : {false, true}) {
      auto ours_buffers = make(bytes, true, registered);
      const double ours = measure(bytes, ours_buffers);
      release(ours_buffers, true);
      auto their_buffers = make(bytes, false, registered);
      const double theirs = measure(bytes, their_buffers);
      release(their_buffers, false);
      const char* kind = registered ? "registered" : "unregistered";
      std::printf("   %8zu %-12s %10.1f %10.1f %8.3f\n", mib, kind, ours, theirs, ours / theirs);
      rows.add(std::string("nccl all-reduce ") + kind,
               "\"gpus\": " + std::to_string(gpus) + ", \"bytes\": " + std::to_string(bytes) +
                   ", \"bandwidth\": \"" + (bus ? "bus" : "algorithm") + "\", \"pool_gbps\": " + std::to_string(ours) +
                   ", \"malloc_gbps\": " + std::to_string(theirs) + ", \"ratio\": " + std::to_string(ours / theirs));
    }
  }
  for (ncclComm_t c : comms) check_nccl(ncclCommDestroy(c), "ncclCommDestroy");
  for (cudaStream_t s : streams) BENCH_CHECK(cudaStreamDestroy(s));
  std::printf("\n");
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  if (argc == 3 && std::strcmp(argv[1], "--json") == 0) {
    json = argv[2];
  } else if (argc != 1) {
    std::fprintf(stderr, "usage: bench_multigpu [--json FILE]\n");
    return 2;
  }
  bench::require_gpu("bench_multigpu");
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  const bench::gpu_info gpu = bench::describe_gpu();
  bench::json_rows rows;
  peer_bandwidth(rows);
#if STREAMALLOC_BENCH_NCCL
  nccl_allreduce(rows);
#else
  std::printf("2. NCCL all-reduce: not measured: this build found no NCCL (cmake/streamallocNccl.cmake)\n");
#endif
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"bench\": \"multigpu\",\n  \"gpu\": \"" << bench::json_escape(gpu.name) << "\",\n  \"driver\": " << gpu.driver
        << ",\n  \"runtime\": " << gpu.runtime << ",\n  \"rows\": [\n" << rows.str() << "\n  ]\n}\n";
    std::printf("wrote %s\n", json.c_str());
  }
  return 0;
}
