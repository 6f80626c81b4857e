// Peer access on two GPUs (pool::set_access): kernels on GPU 1 read and write GPU 0's pool
// memory allocated before and after the grant, after growth, after a defragmenting remap and
// after grow_in_place; read-only access reads (and, in a child process, a write faults);
// revoking and granting again; a host pool open to both GPUs; independence from
// cudaDeviceEnablePeerAccess; graph memory with GPU 1 as its peer (an allocation node's access
// descriptor, a capture's), used by kernels of GPU 1 after the pool revoked GPU 1's access.
// Every result is read back and compared.
//
// Needs two GPUs that are peers: with fewer, or without peer capability, it exits 77 (skipped),
// saying why. CTest label `multigpu` (scripts/gpu-check.sh runs it where there are two GPUs).
// The refusals (a device that is not a peer, the resident device's access) are checked on the
// CPU against the fake driver (tests/cpu/pool_access_test.cpp), where any topology can be made.

#include <streamalloc/access.hpp>
#include <streamalloc/captured_graph.hpp>
#include <streamalloc/driver.hpp>
#include <streamalloc/graph_allocation.hpp>
#include <streamalloc/graph_exec.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "child_process.hpp"
#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {

/// Exits 77 (CTest: skipped) unless GPU 1 can access GPU 0's memory and GPU 0 GPU 1's.
void require_two_peer_gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  int one_to_zero = 0, zero_to_one = 0;
  if (n >= 2) {
    (void)cudaDeviceCanAccessPeer(&one_to_zero, 1, 0);
    (void)cudaDeviceCanAccessPeer(&zero_to_one, 0, 1);
  }
  if (n < 2 || one_to_zero == 0 || zero_to_one == 0) {
    if (n < 2) {
      std::printf("SKIPPED: peer access needs two GPUs; this machine has %d\n", n);
    } else {
      std::printf("SKIPPED: GPUs 0 and 1 are not peers (cudaDeviceCanAccessPeer: 1 -> 0 %d, 0 -> 1 %d)\n",
                  one_to_zero, zero_to_one);
    }
    std::fflush(stdout);
    std::exit(skip_code);
  }
}

/// Makes `device` current: kernels go to streams of the current device.
void on(int device) { SA_CUDA_REQUIRE(cudaSetDevice(device)); }

/// `seed`'s pattern written over [p, p + bytes) by a kernel on `device`, in `s`'s order.
void fill_on(int device, void* p, std::size_t bytes, std::uint32_t seed, const stream& s) {
  on(device);
  fill_async(p, bytes, seed, s.get());
  SA_CUDA_REQUIRE(cudaGetLastError());
}

/// The words of [p, p + bytes) not holding `seed`'s pattern, counted by a kernel on `device` in
/// `s`'s order (the host waits for `s` only).
unsigned long long mismatches_seen_by(int device, const void* p, std::size_t bytes, std::uint32_t seed,
                                      const stream& s) {
  on(device);
  return mismatches_on(p, bytes, seed, s.get());
}

pool_properties two_mib_chunks() {
  pool_properties p;
  p.location = memory_location::device(0);
  p.chunk_size = 2 * MiB;
  p.release_threshold = SIZE_MAX;
  return p;
}

int device_of(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) return -1;
  return a.device;
}

// A kernel of GPU 1 writing where it may only read: the write faults (the driver's check, not
// streamalloc's). In a child process, since the fault ends its context.
CHILD_CASE(read_only_write_faults) {
  pool p0(two_mib_chunks());
  stream s0(0), s1(1);
  void* x = p0.allocate(2 * MiB, s0);
  p0.set_access(memory_location::device(1), access_flags::read);
  (void)s0.synchronize();
  CHILD_CUDA(cudaSetDevice(1));
  fill_async(x, 2 * MiB, 1, s1.get());
  const cudaError_t e = cudaStreamSynchronize(s1.get());
  note("a write by GPU 1 through read-only access: %s", cudaGetErrorName(e));
  CHILD_EXPECT(e != cudaSuccess, 1, "GPU 1 wrote to memory it may only read, and nothing faulted");
  std::fflush(stderr);
  std::_Exit(0);  // the context is lost: no destructor may use it
}
/// A device counter (zeroed) on `device`; freed by the caller with cudaFree.
unsigned long long* counter_on(int device) {
  unsigned long long* c = nullptr;
  CHILD_CUDA(cudaSetDevice(device));
  CHILD_CUDA(cudaMalloc(&c, sizeof *c));
  CHILD_CUDA(cudaMemset(c, 0, sizeof *c));
  CHILD_CUDA(cudaSetDevice(0));
  return c;
}
unsigned long long read_counter(const unsigned long long* c) {
  unsigned long long h = ~0ULL;
  CHILD_CUDA(cudaMemcpy(&h, c, sizeof h, cudaMemcpyDeviceToHost));
  return h;
}
/// A kernel node of `device` after `dep` (the device current when it is added runs it).
cudaGraphNode_t kernel_node(cudaGraph_t g, int device, cudaGraphNode_t dep, void* func, void** args) {
  cudaKernelNodeParams k{};
  k.func = func;
  k.gridDim = dim3(256);
  k.blockDim = dim3(256);
  k.kernelParams = args;
  cudaGraphNode_t n = nullptr;
  CHILD_CUDA(cudaSetDevice(device));
  CHILD_CUDA(cudaGraphAddKernelNode(&n, g, &dep, 1, &k));
  CHILD_CUDA(cudaSetDevice(0));
  return n;
}

// A graph built by hand on a pool GPU 1 has no access to: its allocation node names GPU 1
// (read-write); a kernel of GPU 1 writes the memory, kernels of GPU 0 and of GPU 1 check it,
// a free node ends it. The pool grants GPU 1 and revokes it between launches; the launches go
// on while the graph's memory moves onto the stream's shared pages. A lost access faults a
// kernel of GPU 1, hence the child process.
CHILD_CASE(graph_allocation_peer) {
  pool p0(two_mib_chunks());
  stream s0(0);
  constexpr std::size_t bytes = 8 * MiB;
  const access_descriptor peer{memory_location::device(1), access_flags::read_write};
  unsigned long long* bad0 = counter_on(0);
  unsigned long long* bad1 = counter_on(1);
  graph_exec exec;
  {
    captured_graph g = make_graph();
    graph_allocation a = add_allocation(g, p0, bytes, {}, {&peer, 1});
    CHILD_EXPECT(get_access(memory_location::device(1), reinterpret_cast<CUdeviceptr>(a.get())) ==
                     access_flags::read_write, 1, "the allocation node's peer has no access");
    CHILD_EXPECT(p0.access(memory_location::device(1)) == access_flags::none, 2, "the pool's own access changed");
    auto* words = static_cast<std::uint32_t*>(a.get());
    std::size_t n = bytes / 4;
    std::uint32_t seed = 61;
    void* fill_args[] = {&words, &n, &seed};
    void* check0_args[] = {&words, &n, &seed, &bad0};
    void* check1_args[] = {&words, &n, &seed, &bad1};
    const cudaGraphNode_t filled = kernel_node(g.get(), 1, a.node(), reinterpret_cast<void*>(&fill_kernel), fill_args);
    const cudaGraphNode_t checked0 = kernel_node(g.get(), 0, filled, reinterpret_cast<void*>(&check_kernel), check0_args);
    const cudaGraphNode_t checked1 =
        kernel_node(g.get(), 1, checked0, reinterpret_cast<void*>(&check_kernel), check1_args);
    (void)add_free(g, a, {&checked1, 1});
    exec = graph_exec(g);
  }  // the executable alone holds the graph: its memory may move onto s0's shared pages
  exec.launch(s0.ref());
  CHILD_CUDA(cudaStreamSynchronize(s0.get()));
  p0.set_access(memory_location::device(1), access_flags::read_write);
  p0.set_access(memory_location::device(1), access_flags::none);
  constexpr int launches = 20;
  for (int i = 1; i < launches; ++i) {
    exec.launch(s0.ref());
    CHILD_CUDA(cudaStreamSynchronize(s0.get()));
  }
  note("graph memory after %d launches: %zu MiB; the pool's own reserved: %zu MiB", launches,
       p0.statistics().graph_reserved_current / MiB, p0.statistics().reserved_current / MiB);
  CHILD_EXPECT(read_counter(bad0) == 0, 3, "GPU 0 found words GPU 1 did not write");
  CHILD_EXPECT(read_counter(bad1) == 0, 4, "GPU 1 read words other than those it wrote");
  exec.reset();
  CHILD_CUDA(cudaFree(bad0));
  CHILD_CUDA(cudaFree(bad1));
  std::fflush(stderr);
}

// A capture on GPU 0 forks to a stream of GPU 1 through an event; GPU 1 writes a pool
// allocation made in the capture while the pool grants GPU 1 access; GPU 0 checks it. The pool
// revokes GPU 1's access after the capture: the graph keeps it (spec 003: an allocation node
// records the pool's access of capture time).
CHILD_CASE(captured_allocation_peer) {
  pool p0(two_mib_chunks());
  stream s0(0), s1(1);
  constexpr std::size_t bytes = 8 * MiB;
  unsigned long long* bad0 = counter_on(0);
  p0.set_access(memory_location::device(1), access_flags::read_write);
  cudaEvent_t fork = nullptr, join = nullptr;
  CHILD_CUDA(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CHILD_CUDA(cudaSetDevice(1));
  CHILD_CUDA(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  CHILD_CUDA(cudaSetDevice(0));
  CHILD_CUDA(cudaStreamBeginCapture(s0.get(), cudaStreamCaptureModeThreadLocal));
  void* x = p0.allocate(bytes, s0.ref());
  CHILD_CUDA(cudaEventRecord(fork, s0.get()));
  CHILD_CUDA(cudaStreamWaitEvent(s1.get(), fork, 0));
  CHILD_CUDA(cudaSetDevice(1));
  fill_async(x, bytes, 62, s1.get());
  CHILD_LAUNCHED("fill_async on GPU 1");
  CHILD_CUDA(cudaEventRecord(join, s1.get()));
  CHILD_CUDA(cudaSetDevice(0));
  CHILD_CUDA(cudaStreamWaitEvent(s0.get(), join, 0));
  check_async(x, bytes, 62, bad0, s0.get());
  CHILD_LAUNCHED("check_async on GPU 0");
  p0.deallocate(x, s0.ref());
  captured_graph g = end_capture(s0.ref());
  graph_exec exec(g);
  p0.set_access(memory_location::device(1), access_flags::none);
  CHILD_EXPECT(get_access(memory_location::device(1), reinterpret_cast<CUdeviceptr>(x)) == access_flags::read_write,
               1, "the captured allocation lost the access the pool had at capture time");
  for (int i = 0; i < 5; ++i) exec.launch(s0.ref());
  CHILD_CUDA(cudaStreamSynchronize(s0.get()));
  CHILD_EXPECT(read_counter(bad0) == 0, 2, "GPU 0 found words GPU 1 did not write");
  CHILD_CUDA(cudaEventDestroy(fork));
  CHILD_CUDA(cudaEventDestroy(join));
  CHILD_CUDA(cudaFree(bad0));
  std::fflush(stderr);
}

}  // namespace

TEST_SUITE("peer_access") {

TEST_CASE("GPU 1 reads and writes GPU 0's memory allocated before and after the grant, and after growth") {
  require_two_peer_gpus();
  pool p0(two_mib_chunks());
  stream s0(0), s1(1);
  const std::size_t bytes = 8 * MiB;
  void* before = p0.allocate(bytes, s0);
  fill_on(0, before, bytes, 1, s0);
  CHECK(p0.access(memory_location::device(1)) == access_flags::none);
  p0.set_access(memory_location::device(1), access_flags::read_write);
  CHECK(p0.access(memory_location::device(1)) == access_flags::read_write);
  CHECK(get_access(memory_location::device(1), reinterpret_cast<CUdeviceptr>(before)) == access_flags::read_write);
  (void)order_after(s1, s0);
  CHECK(mismatches_seen_by(1, before, bytes, 1, s1) == 0);  // GPU 1 reads what GPU 0 wrote
  fill_on(1, before, bytes, 2, s1);                        // and writes over it
  // A stream of GPU 1 allocates: the pool grows, on GPU 0, after the grant.
  const auto grows = p0.statistics().grows;
  void* after = p0.allocate(bytes, s1);
  CHECK(p0.statistics().grows > grows);
  CHECK(device_of(after) == 0);
  CHECK(get_access(memory_location::device(1), reinterpret_cast<CUdeviceptr>(after)) == access_flags::read_write);
  fill_on(1, after, bytes, 3, s1);
  (void)order_after(s0, s1);
  CHECK(mismatches_seen_by(0, before, bytes, 2, s0) == 0);  // GPU 0 reads what GPU 1 wrote
  CHECK(mismatches_seen_by(0, after, bytes, 3, s0) == 0);
  // Frees across the devices: GPU 0's stream frees what GPU 1's allocated, and the other way.
  p0.deallocate(after, s0);
  p0.deallocate(before, s0);
  void* again = p0.allocate(bytes, s1);
  fill_on(1, again, bytes, 4, s1);
  CHECK(mismatches_seen_by(1, again, bytes, 4, s1) == 0);
  p0.deallocate(again, s1);
  (void)p0.synchronize();
  CHECK(p0.statistics().live_allocations == 0);
}

TEST_CASE("GPU 1 reads and writes GPU 0's memory after a defragmenting remap") {
  require_two_peer_gpus();
  pool_properties props = two_mib_chunks();
  props.max_size = 8 * MiB;
  props.reuse = {false, false, false};
  pool p0(props);
  stream s0(0), s1(1);
  p0.set_access(memory_location::device(1), access_flags::read_write);
  std::vector<void*> x;
  for (int i = 0; i < 4; ++i) {
    x.push_back(p0.allocate(2 * MiB, s0));
    fill_on(0, x.back(), 2 * MiB, 20 + i, s0);
  }
  p0.deallocate(x[0], s0);
  p0.deallocate(x[2], s0);
  (void)s0.synchronize();
  // 4 MiB fits only once the two free chunks are remapped next to each other.
  void* y = p0.allocate(4 * MiB, s1);
  CHECK(p0.statistics().remapped_chunks >= 1);
  CHECK(p0.statistics().reserved_current == 8 * MiB);
  fill_on(1, y, 4 * MiB, 30, s1);
  CHECK(mismatches_seen_by(1, x[1], 2 * MiB, 21, s1) == 0);  // the live blocks kept their data
  CHECK(mismatches_seen_by(1, x[3], 2 * MiB, 23, s1) == 0);
  (void)order_after(s0, s1);
  CHECK(mismatches_seen_by(0, y, 4 * MiB, 30, s0) == 0);
  p0.deallocate(y, s0);
  p0.deallocate(x[1], s0);
  p0.deallocate(x[3], s0);
}

TEST_CASE("GPU 1 reads and writes the memory grow_in_place maps behind an allocation of GPU 0") {
  require_two_peer_gpus();
  pool p0(pool_properties{.location = memory_location::device(0), .release_threshold = SIZE_MAX});
  stream s0(0), s1(1);
  void* x = p0.allocate(64 * MiB, s0, placement::room_to_grow);
  fill_on(0, x, 64 * MiB, 40, s0);
  p0.set_access(memory_location::device(1), access_flags::read_write);
  (void)order_after(s1, s0);
  const auto chunks = p0.statistics().chunks;
  REQUIRE(p0.grow_in_place(x, 128 * MiB, s1) >= 128 * MiB);  // on GPU 1's stream
  CHECK(p0.statistics().chunks > chunks);                     // new memory mapped behind it
  auto* tail = static_cast<char*>(x) + 64 * MiB;
  CHECK(mismatches_seen_by(1, x, 64 * MiB, 40, s1) == 0);  // the first part kept its data
  fill_on(1, tail, 64 * MiB, 41, s1);
  (void)order_after(s0, s1);
  CHECK(mismatches_seen_by(0, tail, 64 * MiB, 41, s0) == 0);
  p0.deallocate(x, s0);
}

TEST_CASE("read-only access: GPU 1 reads GPU 0's memory, and a write faults (in a child process)") {
  require_two_peer_gpus();
  pool p0(two_mib_chunks());
  stream s0(0), s1(1);
  void* x = p0.allocate(8 * MiB, s0);
  fill_on(0, x, 8 * MiB, 50, s0);
  p0.set_access(memory_location::device(1), access_flags::read);
  CHECK(p0.access(memory_location::device(1)) == access_flags::read);
  CHECK(get_access(memory_location::device(1), reinterpret_cast<CUdeviceptr>(x)) == access_flags::read);
  (void)order_after(s1, s0);
  CHECK(mismatches_seen_by(1, x, 8 * MiB, 50, s1) == 0);
  void* y = p0.allocate(4 * MiB, s0);  // mapped after the grant: read-only for GPU 1 too
  CHECK(get_access(memory_location::device(1), reinterpret_cast<CUdeviceptr>(y)) == access_flags::read);
  p0.deallocate(y, s0);
  p0.deallocate(x, s1);
  expect_child_passes("read_only_write_faults");
}

TEST_CASE("revoking GPU 1's access: its streams are refused; granting again works again") {
  require_two_peer_gpus();
  pool p0(two_mib_chunks());
  stream s0(0), s1(1);
  p0.set_access(memory_location::device(1), access_flags::read_write);
  void* x = p0.allocate(4 * MiB, s1);
  fill_on(1, x, 4 * MiB, 60, s1);
  (void)s1.synchronize();  // GPU 1's last use of the memory, before the revocation
  p0.set_access(memory_location::device(1), access_flags::none);
  CHECK(p0.access(memory_location::device(1)) == access_flags::none);
  CHECK(get_access(memory_location::device(1), reinterpret_cast<CUdeviceptr>(x)) == access_flags::none);
  CHECK(get_access(memory_location::device(0), reinterpret_cast<CUdeviceptr>(x)) == access_flags::read_write);
  CHECK_THROWS_AS((void)p0.allocate(MiB, s1), std::invalid_argument);
  CHECK_THROWS_AS(p0.deallocate(x, s1), std::invalid_argument);
  CHECK(mismatches_seen_by(0, x, 4 * MiB, 60, s0) == 0);  // GPU 0 keeps it, data and all
  p0.set_access(memory_location::device(1), access_flags::read_write);
  (void)order_after(s1, s0);
  fill_on(1, x, 4 * MiB, 61, s1);
  (void)order_after(s0, s1);
  CHECK(mismatches_seen_by(0, x, 4 * MiB, 61, s0) == 0);
  p0.deallocate(x, s0);
}

TEST_CASE("a host pool open to both GPUs: each writes, the host reads") {
  require_two_peer_gpus();
  const device_capabilities c0 = query_capabilities(0), c1 = query_capabilities(1);
  if (!c0.host_numa_memory) {
    CHECK_THROWS_AS(pool(pool_properties{.location = memory_location::host_numa(0)}), not_supported);
    return;
  }
  const int node = c0.host_numa_id < 0 ? 0 : c0.host_numa_id;
  pool h(pool_properties{.location = memory_location::host_numa(node), .release_threshold = SIZE_MAX});
  if (!c1.host_numa_memory) {
    CHECK_THROWS_AS(h.set_access(memory_location::device(1), access_flags::read_write), not_supported);
    return;
  }
  h.set_access(memory_location::device(1), access_flags::read_write);
  CHECK(h.access(memory_location::device(0)) == access_flags::read_write);
  CHECK(h.access(memory_location::device(1)) == access_flags::read_write);
  stream s0(0), s1(1);
  const std::size_t bytes = 2 * MiB;
  void* a = h.allocate(bytes, s0);
  void* b = h.allocate(bytes, s1);
  fill_on(0, a, bytes, 70, s0);
  fill_on(1, b, bytes, 71, s1);
  (void)s0.synchronize();
  (void)s1.synchronize();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < bytes / 4; ++i) {
    wrong += static_cast<const std::uint32_t*>(a)[i] != pattern(i, 70) ? 1 : 0;
    wrong += static_cast<const std::uint32_t*>(b)[i] != pattern(i, 71) ? 1 : 0;
  }
  CHECK(wrong == 0);
  h.deallocate(a, s1);
  h.deallocate(b, s0);
}

TEST_CASE("a pool's access is its own: cudaDeviceEnablePeerAccess neither gives nor takes it") {
  require_two_peer_gpus();
  pool p0(two_mib_chunks());
  stream s0(0), s1(1);
  void* x = p0.allocate(2 * MiB, s0);
  fill_on(0, x, 2 * MiB, 80, s0);
  (void)s0.synchronize();
  // Peer access of the runtime's kind, for cudaMalloc memory: the pool's memory stays closed.
  on(1);
  const cudaError_t enabled = cudaDeviceEnablePeerAccess(0, 0);
  REQUIRE((enabled == cudaSuccess || enabled == cudaErrorPeerAccessAlreadyEnabled));
  (void)cudaGetLastError();
  CHECK(p0.access(memory_location::device(1)) == access_flags::none);
  CHECK(get_access(memory_location::device(1), reinterpret_cast<CUdeviceptr>(x)) == access_flags::none);
  CHECK_THROWS_AS((void)p0.allocate(MiB, s1), std::invalid_argument);
  // Granted, then the runtime's peer access disabled: the pool's grant stands.
  p0.set_access(memory_location::device(1), access_flags::read_write);
  on(1);
  SA_CUDA_REQUIRE(cudaDeviceDisablePeerAccess(0));
  CHECK(get_access(memory_location::device(1), reinterpret_cast<CUdeviceptr>(x)) == access_flags::read_write);
  CHECK(mismatches_seen_by(1, x, 2 * MiB, 80, s1) == 0);
  p0.deallocate(x, s1);
}

TEST_CASE("graph memory with GPU 1 as its peer: an allocation node's descriptor, and a capture's") {
  require_two_peer_gpus();
  expect_child_passes("graph_allocation_peer");
  expect_child_passes("captured_allocation_peer");
}

}  // TEST_SUITE
