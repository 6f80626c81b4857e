// The C interface (include/streamalloc/c_api.h) on a GPU, through the shared library PyTorch
// and CuPy load: memory from streamalloc_malloc written by kernels and read back, stream
// order kept across raw handles (a block freed behind a long kernel is not handed to another
// stream while the kernel runs), the default stream from a thread with no context, errors,
// and statistics that match what was allocated. tests/cpu/c_api_test.cpp covers the bad
// input on the fake driver; tests/python/ runs PyTorch and CuPy on it.

#include <streamalloc/c_api.h>

#include <doctest/doctest.h>

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <cuda_runtime.h>

#include <new>
#include <string>
#include <thread>

using namespace streamalloc_test;

namespace {
streamalloc_statistics c_api_stats() {
  streamalloc_statistics s{};
  REQUIRE(streamalloc_get_statistics(0, &s, sizeof s) == 0);
  return s;
}
}  // namespace

TEST_CASE("memory from the C interface holds what kernels write, in stream order") {
  cudaStream_t s;
  SA_CUDA_REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const streamalloc_statistics before = c_api_stats();
  constexpr std::size_t bytes = 16 * MiB;
  void* p = streamalloc_malloc(bytes, 0, s);
  REQUIRE(p != nullptr);
  fill_async(p, bytes, 11, s);
  CHECK(mismatches_on(p, bytes, 11, s) == 0);
  const streamalloc_statistics held = c_api_stats();
  CHECK(held.live_allocations == before.live_allocations + 1);
  CHECK(held.used_current == before.used_current + bytes);
  streamalloc_free(p, bytes, 0, s);
  CHECK(c_api_stats().live_allocations == before.live_allocations);
  // Same stream: the block comes back at once, and work on it stays in order.
  void* again = streamalloc_malloc(bytes, 0, s);
  CHECK(again == p);
  fill_async(again, bytes, 12, s);
  CHECK(mismatches_on(again, bytes, 12, s) == 0);
  streamalloc_free(again, bytes, 0, s);
  SA_CUDA_REQUIRE(cudaStreamSynchronize(s));
  SA_CUDA_REQUIRE(cudaStreamDestroy(s));
}

TEST_CASE("a block freed behind a long kernel is not another raw stream's while the kernel runs") {
  cudaStream_t a, b;
  SA_CUDA_REQUIRE(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  SA_CUDA_REQUIRE(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  constexpr std::size_t bytes = 4 * MiB;
  void* p = streamalloc_malloc(bytes, 0, a);
  REQUIRE(p != nullptr);
  // About 0.1 s of spinning, then seed 1 everywhere: if b got the block meanwhile, b's seed 2
  // is overwritten and b's check (which waits for a's kernel) sees it.
  slow_fill_kernel<<<64, 256, 0, a>>>(static_cast<std::uint32_t*>(p), bytes / 4, 1, busy_cycles);
  SA_CUDA_REQUIRE(cudaGetLastError());
  streamalloc_free(p, bytes, 0, a);
  void* q = streamalloc_malloc(bytes, 0, b);
  REQUIRE(q != nullptr);
  fill_async(q, bytes, 2, b);
  SA_CUDA_REQUIRE(cudaStreamSynchronize(a));
  CHECK(mismatches_on(q, bytes, 2, b) == 0);
  MESSAGE("the other stream got ", std::string(q == p ? "the same block (after the kernel)" : "another block"));
  streamalloc_free(q, bytes, 0, b);
  SA_CUDA_REQUIRE(cudaStreamSynchronize(b));
  SA_CUDA_REQUIRE(cudaStreamDestroy(a));
  SA_CUDA_REQUIRE(cudaStreamDestroy(b));
}

TEST_CASE("the legacy default stream from a thread that never made a CUDA call") {
  std::thread([] {
    void* p = streamalloc_malloc(MiB, 0, nullptr);
    REQUIRE(p != nullptr);
    fill_async(p, MiB, 5, nullptr);
    CHECK(mismatches_on(p, MiB, 5, nullptr) == 0);
    streamalloc_free(p, MiB, 0, nullptr);
  }).join();
}

TEST_CASE("a free on the default stream given as a null handle: another stream's once the work before it is done") {
  // PyTorch hands its default stream to the C interface as handle 0. The pool used to key it
  // by that null handle, which to the pool means no stream at all: it never asked the stream
  // whether its work had run, so these frees were never known complete, other streams never
  // reused them, and a model with a side stream grew the pool every step.
  cudaStream_t b;
  SA_CUDA_REQUIRE(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  REQUIRE(streamalloc_synchronize(0) == 0);
  REQUIRE(streamalloc_trim(0, 0) == 0);  // nothing free: which block comes back is certain
  constexpr std::size_t bytes = 40 * MiB;
  auto* p = static_cast<std::uint32_t*>(streamalloc_malloc(bytes, 0, nullptr));
  REQUIRE(p != nullptr);
  slow_fill_kernel<<<64, 256, 0, nullptr>>>(p, bytes / 4, 1, busy_cycles);  // the legacy stream
  SA_CUDA_REQUIRE(cudaGetLastError());
  streamalloc_free(p, bytes, 0, nullptr);
  // While the kernel runs, the block is not b's.
  void* q = streamalloc_malloc(bytes, 0, b);
  REQUIRE(q != nullptr);
  CHECK(q != static_cast<void*>(p));
  fill_async(q, bytes, 2, b);
  SA_CUDA_REQUIRE(cudaDeviceSynchronize());  // around streamalloc: it learns nothing from this
  CHECK(mismatches_on(q, bytes, 2, b) == 0);
  // Once it is done, b gets it: the pool asks the legacy stream when it needs memory.
  const std::uint64_t reserved = c_api_stats().reserved_current;
  void* r = streamalloc_malloc(bytes, 0, b);
  CHECK(r == static_cast<void*>(p));
  CHECK(c_api_stats().reserved_current == reserved);
  fill_async(r, bytes, 3, b);
  CHECK(mismatches_on(r, bytes, 3, b) == 0);
  CHECK(mismatches_on(q, bytes, 2, b) == 0);
  streamalloc_free(q, bytes, 0, b);
  streamalloc_free(r, bytes, 0, b);
  SA_CUDA_REQUIRE(cudaStreamSynchronize(b));
  SA_CUDA_REQUIRE(cudaStreamDestroy(b));
}

TEST_CASE("out of memory: null and the reason from streamalloc_malloc, an exception from the torch entry") {
  cudaStream_t s;
  SA_CUDA_REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::size_t huge = std::size_t{1} << 50;  // a petabyte
  const streamalloc_statistics before = c_api_stats();
  CHECK(streamalloc_malloc(huge, 0, s) == nullptr);
  CHECK(std::string(streamalloc_last_error()).find("cannot allocate " + std::to_string(huge) + " bytes") !=
        std::string::npos);
  CHECK_THROWS_AS((void)streamalloc_torch_malloc(huge, 0, s), std::bad_alloc);
  const streamalloc_statistics after = c_api_stats();
  CHECK(after.live_allocations == before.live_allocations);
  CHECK(after.reserved_current == before.reserved_current);
  // Still serving.
  void* p = streamalloc_malloc(MiB, 0, s);
  CHECK(p != nullptr);
  streamalloc_free(p, MiB, 0, s);
  CHECK(streamalloc_synchronize(0) == 0);
  CHECK(streamalloc_trim(0, 0) == 0);
  CHECK(c_api_stats().reserved_current == 0);
  SA_CUDA_REQUIRE(cudaStreamDestroy(s));
}
