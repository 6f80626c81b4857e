// NCCL collectives over streamalloc pool memory: all-reduce and all-gather on buffers taken from
// a pool per GPU, with one process driving every GPU (ncclCommInitAll) and with one process per
// GPU (this binary started again as `--child nccl_rank ...`, ranks joined by ncclCommInitRank);
// each unregistered and registered with ncclCommRegister; every result read back and compared
// with what the ranks contributed. And the pool's promise with NCCL in the picture: memory freed
// right after a collective was enqueued is not handed to another stream while the collective
// has not run.
//
// Uses every GPU of the machine (one on most machines, where each collective has one rank);
// STREAMALLOC_NCCL_GPUS=N asks for N and exits 77 (skipped) where there are fewer: CTest's
// gpu.nccl_two_gpus (label multigpu) runs it with 2. NVLink multicast (NVLS) is never used:
// every process sets NCCL_NVLS_ENABLE=0 before NCCL starts.

#include <streamalloc/streamalloc.hpp>

#include <doctest/doctest.h>

#include "child_process.hpp"
#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {

// The helpers below run in doctest cases and in rank processes (outside any doctest run, where
// its assertions cannot be used): they throw, and each side reports what they threw.
void nccl_or_throw(ncclResult_t r, const char* call) {
  if (r != ncclSuccess) {
    throw std::runtime_error(std::string(call) + ": " + ncclGetErrorString(r) + " (" + ncclGetLastError(nullptr) + ")");
  }
}
void cuda_or_throw(cudaError_t e, const char* call) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(e));
}
#define SA_NCCL_OK(call) nccl_or_throw((call), #call)
#define SA_CUDA_OK(call) cuda_or_throw((call), #call)

/// The GPUs the collectives use: all of them, or STREAMALLOC_NCCL_GPUS; exits 77 (skipped) when
/// that asks for more than the machine has.
int nccl_gpu_count() {
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);  // never NVLink multicast on these machines
  int have = 0;
  if (cudaGetDeviceCount(&have) != cudaSuccess) have = 0;
  const char* asked = std::getenv("STREAMALLOC_NCCL_GPUS");
  const int want = asked != nullptr && *asked != '\0' ? std::atoi(asked) : have;
  if (want > have) {
    std::printf("SKIPPED: STREAMALLOC_NCCL_GPUS=%d but this machine has %d GPU(s)\n", want, have);
    std::fflush(stdout);
    std::exit(skip_code);
  }
  return want;
}

/// What rank `r` contributes at index `i`: small integers, so float sums are exact.
__host__ __device__ inline float contribution(int r, std::size_t i) { return static_cast<float>(r + 1 + i % 7); }

__global__ void fill_contribution(float* p, std::size_t n, int rank) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = contribution(rank, i);
  }
}

/// Wrong elements of an all-reduce (sum over `ranks`) result.
std::size_t wrong_sum(const std::vector<float>& got, int ranks) {
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    float want = 0;
    for (int r = 0; r < ranks; ++r) want += contribution(r, i);
    wrong += got[i] != want ? 1 : 0;
  }
  return wrong;
}

/// Wrong elements of an all-gather result: rank r's `count` values at r * count.
std::size_t wrong_gather(const std::vector<float>& got, int ranks, std::size_t count) {
  std::size_t wrong = 0;
  for (int r = 0; r < ranks; ++r) {
    for (std::size_t i = 0; i < count; ++i) wrong += got[r * count + i] != contribution(r, i) ? 1 : 0;
  }
  return wrong;
}

/// One rank's view: its device's pool and stream, and the buffers of one round of collectives.
struct rank_memory {
  int rank;
  // posix_fd: NCCL registers buffers of other processes' ranks by exporting their memory.
  pool p;
  stream s;
  stream_buffer<float> reduce_in, reduce_out, gather_in, gather_out;

  rank_memory(int rank, int ranks, std::size_t count)
      : rank(rank),
        p(pool_properties{.location = memory_location::device(rank), .handle_types = shareable_handle_type::posix_fd}),
        s(rank),
        reduce_in(count, s, p),
        reduce_out(count, s, p),
        gather_in(count, s, p),
        gather_out(count * static_cast<std::size_t>(ranks), s, p) {
    fill_contribution<<<256, 256, 0, s.get()>>>(reduce_in.data(), count, rank);
    fill_contribution<<<256, 256, 0, s.get()>>>(gather_in.data(), count, rank);
  }
};

/// ncclCommRegister over each buffer of `m`, undone by the destructor (after the stream is idle).
struct registrations {
  ncclComm_t comm;
  std::vector<void*> handles;
  registrations(ncclComm_t c, rank_memory& m) : comm(c) {
    for (auto* b : {&m.reduce_in, &m.reduce_out, &m.gather_in, &m.gather_out}) {
      void* h = nullptr;
      SA_NCCL_OK(ncclCommRegister(comm, b->data(), b->size() * sizeof(float), &h));
      handles.push_back(h);
    }
  }
  ~registrations() {
    for (void* h : handles) (void)ncclCommDeregister(comm, h);
  }
};

void enqueue_collectives(ncclComm_t comm, rank_memory& m, std::size_t count) {
  SA_NCCL_OK(ncclAllReduce(m.reduce_in.data(), m.reduce_out.data(), count, ncclFloat, ncclSum, comm, m.s.get()));
  SA_NCCL_OK(ncclAllGather(m.gather_in.data(), m.gather_out.data(), count, ncclFloat, comm, m.s.get()));
}

/// Reads back and checks one rank's results; the counts of wrong elements.
std::pair<std::size_t, std::size_t> check_results(rank_memory& m, int ranks, std::size_t count) {
  std::vector<float> reduced(count), gathered(count * static_cast<std::size_t>(ranks));
  m.reduce_out.copy_to(reduced);
  m.gather_out.copy_to(gathered);
  SA_CUDA_OK(cudaStreamSynchronize(m.s.get()));
  return {wrong_sum(reduced, ranks), wrong_gather(gathered, ranks, count)};
}

// Sizes: a small buffer (several per chunk) and one larger than a chunk (64 MiB: a chunk of its own).
constexpr std::size_t small_count = (1 * MiB) / sizeof(float);
constexpr std::size_t large_count = (80 * MiB) / sizeof(float);

// --- one process per GPU: a rank ------------------------------------------------------------------

/// `--child nccl_rank <rank> <ranks> <hex unique id> <count> <register 0|1>`: prints "ok" and
/// exits 0 when its results are right, else prints what was wrong and exits 1.
int rank_main(int argc, char** argv) {
  if (argc != 5) return 2;
  ::alarm(120);  // a rank whose peers died waits in NCCL forever: the watchdog ends it
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);
  const int rank = std::atoi(argv[0]), ranks = std::atoi(argv[1]);
  const std::size_t count = std::strtoull(argv[3], nullptr, 10);
  const bool registered = argv[4][0] == '1';
  ncclUniqueId id{};
  if (std::strlen(argv[2]) != 2 * sizeof id.internal) return 3;
  for (std::size_t i = 0; i < sizeof id.internal; ++i) {
    id.internal[i] = static_cast<char>(std::stoi(std::string(argv[2] + 2 * i, 2), nullptr, 16));
  }
  std::size_t wrong_reduce = 0, wrong_all_gather = 0;
  try {
    SA_CUDA_OK(cudaSetDevice(rank));
    ncclComm_t comm = nullptr;
    SA_NCCL_OK(ncclCommInitRank(&comm, ranks, id, rank));
    {
      rank_memory m(rank, ranks, count);
      std::unique_ptr<registrations> reg;
      if (registered) reg = std::make_unique<registrations>(comm, m);
      enqueue_collectives(comm, m, count);
      std::tie(wrong_reduce, wrong_all_gather) = check_results(m, ranks, count);
    }
    SA_NCCL_OK(ncclCommDestroy(comm));
  } catch (const std::exception& e) {
    std::printf("rank %d: %s\n", rank, e.what());
    return 4;
  }
  std::printf("rank %d: %zu wrong reduced, %zu wrong gathered\n", rank, wrong_reduce, wrong_all_gather);
  return wrong_reduce == 0 && wrong_all_gather == 0 ? 0 : 1;
}
register_child nccl_rank_child("nccl_rank", rank_main);

std::string hex(const ncclUniqueId& id) {
  std::string s;
  char b[3];
  for (char c : id.internal) {
    std::snprintf(b, sizeof b, "%02x", static_cast<unsigned char>(c));
    s += b;
  }
  return s;
}

}  // namespace

TEST_SUITE("nccl") {
TEST_CASE("one process drives every GPU: all-reduce and all-gather over pool memory, unregistered and registered") {
  const int ranks = nccl_gpu_count();
  std::vector<int> devices(static_cast<std::size_t>(ranks));
  for (int d = 0; d < ranks; ++d) devices[static_cast<std::size_t>(d)] = d;
  std::vector<ncclComm_t> comms(static_cast<std::size_t>(ranks));
  SA_NCCL_OK(ncclCommInitAll(comms.data(), ranks, devices.data()));
  for (const std::size_t count : {small_count, large_count}) {
    for (const bool registered : {false, true}) {
      CAPTURE(count);
      CAPTURE(registered);
      std::vector<std::unique_ptr<rank_memory>> m;
      std::vector<std::unique_ptr<registrations>> reg;
      for (int r = 0; r < ranks; ++r) {
        m.push_back(std::make_unique<rank_memory>(r, ranks, count));
        if (registered) reg.push_back(std::make_unique<registrations>(comms[static_cast<std::size_t>(r)], *m.back()));
      }
      SA_NCCL_OK(ncclGroupStart());
      for (int r = 0; r < ranks; ++r) enqueue_collectives(comms[static_cast<std::size_t>(r)], *m[static_cast<std::size_t>(r)], count);
      SA_NCCL_OK(ncclGroupEnd());
      for (int r = 0; r < ranks; ++r) {
        const auto [wrong_reduce, wrong_all_gather] = check_results(*m[static_cast<std::size_t>(r)], ranks, count);
        CHECK(wrong_reduce == 0);
        CHECK(wrong_all_gather == 0);
        // What the pool says it lent is what the buffers hold (four buffers, the gather's output ranks times).
        const auto st = m[static_cast<std::size_t>(r)]->p.statistics();
        CHECK(st.used_current >= (3 + static_cast<std::size_t>(ranks)) * count * sizeof(float));
      }
      reg.clear();  // deregistered while the buffers still live (they were synchronized above)
    }
  }
  for (ncclComm_t c : comms) SA_NCCL_OK(ncclCommDestroy(c));
}

TEST_CASE("one process per GPU: each rank's collectives over its own pool, unregistered and registered") {
  const int ranks = nccl_gpu_count();
  for (const std::size_t count : {small_count, large_count}) {
    for (const bool registered : {false, true}) {
      CAPTURE(count);
      CAPTURE(registered);
      ncclUniqueId id{};
      SA_NCCL_OK(ncclGetUniqueId(&id));
      std::vector<std::unique_ptr<piped_child>> procs;
      for (int r = 0; r < ranks; ++r) {
        procs.push_back(std::make_unique<piped_child>(
            "nccl_rank", std::vector<std::string>{std::to_string(r), std::to_string(ranks), hex(id),
                                                  std::to_string(count), registered ? "1" : "0"}));
      }
      for (int r = 0; r < ranks; ++r) {
        const std::string said = procs[static_cast<std::size_t>(r)]->line();
        const int status = procs[static_cast<std::size_t>(r)]->wait();
        INFO("rank " << r << " said: " << said);
        CHECK(status == 0);
      }
    }
  }
}

TEST_CASE("memory freed right after a collective was enqueued is not lent to another stream before it ran") {
  const int ranks = nccl_gpu_count();
  REQUIRE(ranks >= 1);
  ncclComm_t comm = nullptr;
  int device0 = 0;
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  // A one-rank communicator on GPU 0 is enough: the collective is ordinary work on the stream.
  SA_NCCL_OK(ncclCommInitAll(&comm, 1, &device0));
  pool p;
  stream a(0), b(0);
  constexpr std::size_t count = 16 * MiB / sizeof(float);
  void* in = p.allocate(count * sizeof(float), a);
  void* out = p.allocate(count * sizeof(float), a);
  // Spins about 0.3 s before it fills `in`: the collective waits behind it.
  slow_fill_kernel<<<132, 256, 0, a.get()>>>(static_cast<std::uint32_t*>(in), count, 1, 3 * busy_cycles);
  SA_NCCL_OK(ncclAllReduce(in, out, count, ncclFloat, ncclSum, comm, a.get()));
  p.deallocate(in, a);
  p.deallocate(out, a);
  // b knows nothing of a: while the collective has not run, b gets other memory.
  REQUIRE(cudaStreamQuery(a.get()) == cudaErrorNotReady);
  void* again = p.allocate(2 * count * sizeof(float), b);
  void* again_small = p.allocate(count * sizeof(float), b);
  const bool a_still_running = cudaStreamQuery(a.get()) == cudaErrorNotReady;
  CHECK(!overlaps(again, 2 * count * sizeof(float), in, count * sizeof(float)));
  CHECK(!overlaps(again, 2 * count * sizeof(float), out, count * sizeof(float)));
  CHECK(!overlaps(again_small, count * sizeof(float), in, count * sizeof(float)));
  CHECK(!overlaps(again_small, count * sizeof(float), out, count * sizeof(float)));
  CHECK(a_still_running);  // otherwise the test proved nothing: the kernel was too short
  p.deallocate(again, b);
  p.deallocate(again_small, b);
  SA_CUDA_REQUIRE(cudaStreamSynchronize(a.get()));
  SA_CUDA_REQUIRE(cudaStreamSynchronize(b.get()));
  SA_NCCL_OK(ncclCommDestroy(comm));
}
}
