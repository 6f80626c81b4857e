// The pool on a real GPU: contents written and checked by kernels, each reuse policy on and
// off, the release threshold and trim against the device's free memory, defragmentation,
// limits, host memory, and many threads on many streams at once.

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {
pool_properties exact_chunks() {
  // Blocks that fill whole 2 MiB chunks: no other free memory the pool could prefer.
  pool_properties p;
  p.chunk_size = 2 * MiB;
  p.release_threshold = SIZE_MAX;
  p.reuse = {false, false, false};
  return p;
}

std::size_t device_free() {
  std::size_t f = 0, t = 0;
  cudaMemGetInfo(&f, &t);
  return f;
}

struct counter {
  unsigned long long* d = nullptr;
  counter() {
    cudaMalloc(&d, sizeof *d);
    cudaMemset(d, 0, sizeof *d);
  }
  ~counter() { cudaFree(d); }
  unsigned long long read() {
    unsigned long long h = ~0ull;
    cudaMemcpy(&h, d, sizeof h, cudaMemcpyDeviceToHost);
    return h;
  }
};
}  // namespace

TEST_CASE("allocate and deallocate in stream order; kernels see their own data") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  pool p;
  stream s(0);
  std::vector<std::pair<void*, std::size_t>> live;
  for (std::size_t n : {std::size_t{1}, std::size_t{256}, std::size_t{4097}, 3 * MiB, 70 * MiB}) {
    void* x = p.allocate(n, s);
    REQUIRE(x != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(x) % 256 == 0);
    CHECK(p.owns(x));
    live.emplace_back(x, n);
  }
  counter bad;
  std::uint32_t seed = 100;
  for (auto [x, n] : live) fill_async(x, (n + 3) / 4 * 4, seed++, s.get());
  seed = 100;
  for (auto [x, n] : live) check_async(x, (n + 3) / 4 * 4, seed++, bad.d, s.get());
  s.synchronize();
  CHECK(bad.read() == 0);
  for (auto [x, n] : live) p.deallocate(x, s);
  CHECK(p.statistics().live_allocations == 0);
}

TEST_CASE("placement: packed large allocations are adjacent; room_to_grow ones grow in place; kernels see both") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  pool p;
  stream s(0);
  std::vector<void*> packed;
  for (int i = 0; i < 4; ++i) packed.push_back(p.allocate(64 * MiB, s));
  // One run of chunks, each growth extending it.
  for (int i = 1; i < 4; ++i) CHECK(static_cast<char*>(packed[i - 1]) + 64 * MiB == packed[i]);
  CHECK(p.grow_in_place(packed[1], 128 * MiB, s) == 0);  // its neighbour is right after it
  void* roomy = p.allocate(64 * MiB, s, placement::room_to_grow);
  CHECK(p.grow_in_place(roomy, 1024 * MiB, s) == 1024 * MiB);
  counter bad;
  std::uint32_t seed = 7;
  for (void* x : packed) fill_async(x, 64 * MiB, seed++, s.get());
  fill_async(roomy, 1024 * MiB, seed, s.get());
  seed = 7;
  for (void* x : packed) check_async(x, 64 * MiB, seed++, bad.d, s.get());
  check_async(roomy, 1024 * MiB, seed, bad.d, s.get());
  s.synchronize();
  CHECK(bad.read() == 0);
  for (void* x : packed) p.deallocate(x, s);
  p.deallocate(roomy, s);
  CHECK(p.statistics().live_allocations == 0);
}

TEST_CASE("addresses are reserved as needed: a run goes on past its reservation; a later one serves a large request") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  pool p(pool_properties{.chunk_size = 2 * MiB});
  stream s(0);
  // The first reservation is 8 GiB, filled from its start: an allocation that ends it, grown
  // in place, reserves the addresses right after it, and the run goes on into them.
  const std::size_t first_reservation = std::size_t{8} << 30;
  void* filler = p.allocate(first_reservation - 256 * MiB, s);
  void* top = p.allocate(256 * MiB, s);
  REQUIRE(static_cast<char*>(top) == static_cast<char*>(filler) + first_reservation - 256 * MiB);
  CHECK(p.grow_in_place(top, 1024 * MiB, s) == 1024 * MiB);
  p.deallocate(filler, s);
  // More than the first reservation holds: mapped into a reservation of its own.
  const std::size_t big_bytes = std::size_t{12} << 30;
  void* big = p.allocate(big_bytes, s);
  const auto found = find_pool(static_cast<char*>(big) + big_bytes - 1);
  REQUIRE(found.has_value());
  CHECK(*found == pool_ref(p));
  CHECK(p.owns(static_cast<char*>(top) + 1024 * MiB - 1));
  counter bad;
  fill_async(top, 1024 * MiB, 31, s.get());
  fill_async(big, big_bytes, 32, s.get());
  check_async(top, 1024 * MiB, 31, bad.d, s.get());
  check_async(big, big_bytes, 32, bad.d, s.get());
  s.synchronize();
  CHECK(bad.read() == 0);
  p.deallocate(top, s);
  p.deallocate(big, s);
  s.synchronize();
  p.trim_to(0);
  CHECK(p.statistics().reserved_current == 0);
}

TEST_CASE("zero bytes is nullptr; freeing nullptr does nothing") {
  pool p;
  stream s(0);
  CHECK(p.allocate(0, s) == nullptr);
  CHECK_NOTHROW(p.deallocate(nullptr, s));
  CHECK(p.statistics().live_allocations == 0);
}

TEST_CASE("same-stream reuse is immediate and needs no synchronization") {
  pool p;
  stream s(0);
  void* a = p.allocate(1 * MiB, s);
  slow_fill_kernel<<<1, 32, 0, s.get()>>>(static_cast<std::uint32_t*>(a), 1 * MiB / 4, 1, busy_cycles / 4);
  p.deallocate(a, s);
  void* b = p.allocate(1 * MiB, s);  // same stream: ordered after the kernel
  CHECK(b == a);
  counter bad;
  fill_async(b, 1 * MiB, 2, s.get());
  check_async(b, 1 * MiB, 2, bad.d, s.get());
  s.synchronize();
  CHECK(bad.read() == 0);
  p.deallocate(b, s);
}

TEST_CASE("follow_event_dependencies: on, reuse after an event wait; off, none") {
  for (bool on : {true, false}) {
    CAPTURE(on);
    auto props = exact_chunks();
    props.reuse.follow_event_dependencies = on;
    pool p(props);
    stream a(0), b(0);
    void* x = p.allocate(2 * MiB, a);
    slow_fill_kernel<<<1, 32, 0, a.get()>>>(static_cast<std::uint32_t*>(x), 2 * MiB / 4, 7, busy_cycles);
    p.deallocate(x, a);
    event e;
    e.record(a);
    b.wait(e);
    void* y = p.allocate(2 * MiB, b);
    CHECK((y == x) == on);
    // Whatever was handed out, b's work runs after a's kernel, so b's data survives.
    counter bad;
    fill_async(y, 2 * MiB, 8, b.get());
    check_async(y, 2 * MiB, 8, bad.d, b.get());
    b.synchronize();
    CHECK(bad.read() == 0);
    p.deallocate(y, b);
    a.synchronize();
  }
}

TEST_CASE("opportunistic: on, reuse once the free has executed; off, not without a synchronization") {
  for (bool on : {true, false}) {
    CAPTURE(on);
    auto props = exact_chunks();
    props.reuse.opportunistic = on;
    pool p(props);
    stream a(0), b(0);
    void* x = p.allocate(2 * MiB, a);
    slow_fill_kernel<<<1, 32, 0, a.get()>>>(static_cast<std::uint32_t*>(x), 2 * MiB / 4, 7, busy_cycles);
    p.deallocate(x, a);
    void* y1 = p.allocate(2 * MiB, b);  // a is still busy: never x
    CHECK(y1 != x);
    SA_CUDA_REQUIRE(cudaStreamSynchronize(a.get()));  // raw: the pool is not told
    void* y2 = p.allocate(2 * MiB, b);
    CHECK((y2 == x) == on);
    p.deallocate(y1, b);
    p.deallocate(y2, b);
    b.synchronize();
  }
}

TEST_CASE("internal_dependencies: at the limit, on, wait on the free; off, out_of_memory") {
  for (bool on : {true, false}) {
    CAPTURE(on);
    auto props = exact_chunks();
    props.max_size = 2 * MiB;
    props.reuse.internal_dependencies = on;
    pool p(props);
    stream a(0), b(0);
    void* x = p.allocate(2 * MiB, a);
    // a writes 7 after a long wait; then frees.
    slow_fill_kernel<<<1, 32, 0, a.get()>>>(static_cast<std::uint32_t*>(x), 2 * MiB / 4, 7, busy_cycles);
    p.deallocate(x, a);
    if (on) {
      void* y = p.allocate(2 * MiB, b);
      CHECK(y == x);
      // b writes 8: if b did not wait for a, a's late write would leave 7 behind.
      counter bad;
      fill_async(y, 2 * MiB, 8, b.get());
      check_async(y, 2 * MiB, 8, bad.d, b.get());
      b.synchronize();
      a.synchronize();
      CHECK(mismatches(y, 2 * MiB, 8) == 0);
      CHECK(bad.read() == 0);
      p.deallocate(y, b);
    } else {
      try {
        (void)p.allocate(2 * MiB, b);
        FAIL("should be out of memory");
      } catch (const out_of_memory& e) {
        CHECK(e.requested() == 2 * MiB);
        CHECK(std::string(e.what()).find("2097152") != std::string::npos);
      }
      a.synchronize();
    }
  }
}

TEST_CASE("after a host synchronization every stream reuses, with every policy off") {
  pool p(exact_chunks());
  stream a(0), b(0);
  void* x = p.allocate(2 * MiB, a);
  p.deallocate(x, a);
  a.synchronize();
  CHECK(p.allocate(2 * MiB, b) == x);
}

TEST_CASE("the release threshold and trim, measured against the device's free memory") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t size = 1024 * MiB, slack = 96 * MiB;
  SUBCASE("threshold 0: a synchronization gives everything back") {
    pool p;  // release_threshold 0
    stream s(0);
    const std::size_t before = device_free();
    void* x = p.allocate(size, s);
    fill_async(x, size, 3, s.get());
    CHECK(device_free() + size <= before + slack);
    p.deallocate(x, s);
    CHECK(p.statistics().reserved_current >= size);  // nothing released before a sync point
    s.synchronize();
    CHECK(p.statistics().reserved_current == 0);
    CHECK(device_free() + slack >= before);
  }
  SUBCASE("threshold kept; trim_to gives it back on demand") {
    pool_properties props;
    props.release_threshold = SIZE_MAX;
    pool p(props);
    stream s(0);
    const std::size_t before = device_free();
    void* x = p.allocate(size, s);
    p.deallocate(x, s);
    s.synchronize();
    CHECK(p.statistics().reserved_current >= size);
    CHECK(device_free() + size <= before + slack);  // still held
    p.trim_to(0);
    CHECK(p.statistics().reserved_current == 0);
    CHECK(device_free() + slack >= before);
  }
  SUBCASE("pool::synchronize is a synchronization point") {
    pool p;  // release_threshold 0
    stream s(0);
    const std::size_t before = device_free();
    void* x = p.allocate(size, s);
    slow_fill_kernel<<<1, 32, 0, s.get()>>>(static_cast<std::uint32_t*>(x), 1024, 4, busy_cycles / 4);
    p.deallocate(x, s);
    CHECK(p.statistics().reserved_current >= size);
    p.synchronize();
    CHECK(p.statistics().reserved_current == 0);
    CHECK(device_free() + slack >= before);
  }
  SUBCASE("trim never releases memory whose free may still be running") {
    pool_properties props;
    props.release_threshold = SIZE_MAX;
    props.reuse = {false, false, false};
    pool p(props);
    stream s(0);
    void* x = p.allocate(64 * MiB, s);
    slow_fill_kernel<<<1, 32, 0, s.get()>>>(static_cast<std::uint32_t*>(x), 64 * MiB / 4, 9, busy_cycles);
    p.deallocate(x, s);
    p.trim_to(0);  // the kernel still runs: nothing may go
    CHECK(p.statistics().reserved_current >= 64 * MiB);
    s.synchronize();
    p.trim_to(0);
    CHECK(p.statistics().reserved_current == 0);
  }
}

TEST_CASE("defragmentation: a request that fits only after remapping succeeds without growing") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  pool_properties props;
  props.chunk_size = 2 * MiB;
  props.max_size = 8 * MiB;
  props.release_threshold = SIZE_MAX;
  pool p(props);
  stream s(0);
  std::vector<void*> x;
  for (int i = 0; i < 4; ++i) {
    x.push_back(p.allocate(2 * MiB, s));
    fill_async(x.back(), 2 * MiB, 20 + i, s.get());
  }
  CHECK(p.statistics().reserved_current == 8 * MiB);
  p.deallocate(x[0], s);
  p.deallocate(x[2], s);
  s.synchronize();
  const auto before = p.statistics();
  CHECK(before.largest_free_block == 2 * MiB);  // 4 MiB free, in two holes
  void* y = p.allocate(4 * MiB, s);
  const auto after = p.statistics();
  CHECK(after.reserved_current == 8 * MiB);
  CHECK(after.reserved_high == 8 * MiB);
  CHECK(after.remapped_chunks >= 1);  // 1 when a hole has room after it, else 2
  counter bad;
  fill_async(y, 4 * MiB, 30, s.get());
  check_async(y, 4 * MiB, 30, bad.d, s.get());
  check_async(x[1], 2 * MiB, 21, bad.d, s.get());  // the live blocks kept their data
  check_async(x[3], 2 * MiB, 23, bad.d, s.get());
  s.synchronize();
  CHECK(bad.read() == 0);
}

TEST_CASE("defragmentation and growth: free chunks moved next to new memory for the rest of a request") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  for (const bool running : {true, false}) {
    CAPTURE(running);
    pool_properties props;
    props.chunk_size = 2 * MiB;
    props.release_threshold = SIZE_MAX;
    pool p(props);
    stream s(0), other(0);
    std::vector<void*> x;
    for (int i = 0; i < 4; ++i) {
      x.push_back(p.allocate(2 * MiB, s));
      fill_async(x.back(), 2 * MiB, 40 + i, s.get());
    }
    // A kernel that writes block 0 for a long while, then frees of blocks 0 and 2 behind it.
    slow_fill_kernel<<<1, 32, 0, s.get()>>>(static_cast<std::uint32_t*>(x[0]), 2 * MiB / 4, 44, busy_cycles);
    p.deallocate(x[0], s);
    p.deallocate(x[2], s);
    if (!running) s.synchronize();
    const auto before = p.statistics();
    CHECK(before.reserved_current == 8 * MiB);
    // 6 MiB asked on another stream, 4 MiB free in two chunks between live blocks.
    void* y = p.allocate(6 * MiB, other);
    const auto after = p.statistics();
    if (running) {
      // The kernel still runs on block 0: neither freed chunk may move; the pool grows by 6 MiB.
      CHECK(after.reserved_current == 14 * MiB);
      CHECK(after.remapped_chunks == before.remapped_chunks);
    } else {
      // Both moved next to a new 2 MiB handle: the pool grew by what they lacked.
      CHECK(after.reserved_current == 10 * MiB);
      CHECK(after.remapped_chunks == before.remapped_chunks + 2);
    }
    counter bad;
    fill_async(y, 6 * MiB, 50, other.get());
    check_async(y, 6 * MiB, 50, bad.d, other.get());
    other.synchronize();
    if (running) check_async(x[0], 2 * MiB, 44, bad.d, s.get());  // the slow kernel's writes, intact
    check_async(x[1], 2 * MiB, 41, bad.d, s.get());  // the live blocks kept their data
    check_async(x[3], 2 * MiB, 43, bad.d, s.get());
    s.synchronize();
    CHECK(bad.read() == 0);
    p.deallocate(y, other);
    p.deallocate(x[1], s);
    p.deallocate(x[3], s);
  }
}

TEST_CASE("maximum size and device memory: out_of_memory, and the pool stays usable") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  pool_properties props;
  props.max_size = 64 * MiB;
  pool p(props);
  stream s(0);
  void* a = p.allocate(48 * MiB, s);
  const auto before = p.statistics();
  try {
    (void)p.allocate(32 * MiB, s);
    FAIL("over the maximum size");
  } catch (const out_of_memory& e) {
    CHECK(e.requested() == 32 * MiB);
    CHECK(std::string(e.what()).find("at most 67108864") != std::string::npos);
  }
  CHECK(p.statistics().used_current == before.used_current);
  void* b = p.allocate(8 * MiB, s);  // still fits
  CHECK(b != nullptr);
  p.deallocate(a, s);
  p.deallocate(b, s);

  pool unlimited;
  std::size_t free = 0, total = 0;
  SA_CUDA_REQUIRE(cudaMemGetInfo(&free, &total));
  CHECK_THROWS_AS((void)unlimited.allocate(2 * total, s), out_of_memory);
  CHECK_THROWS_AS((void)unlimited.allocate(std::size_t{1} << 63, s), out_of_memory);
  void* c = unlimited.allocate(1 * MiB, s);
  CHECK(c != nullptr);
  unlimited.deallocate(c, s);
  s.synchronize();
}

TEST_CASE("bad frees: foreign, interior and double frees throw invalid_argument and change nothing") {
  pool p;
  stream s(0);
  void* x = p.allocate(4096, s);
  void* foreign = nullptr;
  SA_CUDA_REQUIRE(cudaMalloc(&foreign, 4096));
  const auto before = p.statistics();
  CHECK_THROWS_AS(p.deallocate(foreign, s), std::invalid_argument);
  CHECK_THROWS_AS(p.deallocate(static_cast<char*>(x) + 256, s), std::invalid_argument);
  CHECK(p.statistics().live_allocations == before.live_allocations);
  p.deallocate(x, s);
  CHECK_THROWS_AS(p.deallocate(x, s), std::invalid_argument);
  CHECK(p.statistics().live_allocations == before.live_allocations - 1);
  CHECK_THROWS_AS(streamalloc::deallocate(foreign, s), std::invalid_argument);
  cudaFree(foreign);
}

TEST_CASE("closing a pool with live allocations reports them and gives the memory back") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t before = device_free();
  pool p;
  stream s(0);
  (void)p.allocate(256 * MiB, s);
  (void)p.allocate(1 * MiB, s);
  const pool_close_report r = p.close();
  CHECK(r.live_allocations == 2);
  CHECK(r.live_bytes == 257 * MiB);
  CHECK(device_free() + 96 * MiB >= before);
  CHECK_FALSE(p.owns(nullptr));
}

TEST_CASE("statistics follow what was allocated") {
  pool_properties props;
  props.release_threshold = SIZE_MAX;
  pool p(props);
  stream s(0);
  void* a = p.allocate(1000, s);
  void* b = p.allocate(3 * MiB, s);
  auto st = p.statistics();
  CHECK(st.used_current == 1024 + 3 * MiB);
  CHECK(st.live_allocations == 2);
  CHECK(st.reserved_current == 64 * MiB);  // one default chunk
  p.deallocate(b, s);
  st = p.statistics();
  CHECK(st.used_current == 1024);
  CHECK(st.used_high == 1024 + 3 * MiB);
  p.reset_high_water();
  CHECK(p.statistics().used_high == 1024);
  p.deallocate(a, s);
}

TEST_CASE("default and current pools; pointer to pool lookup") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  CHECK(default_pool(0) == default_pool(0));
  CHECK(current_pool(0) == default_pool(0));
  stream s(0);
  void* d = streamalloc::allocate(4096, s);
  CHECK(default_pool(0).owns(d));
  CHECK(find_pool(d) == default_pool(0));
  streamalloc::deallocate(d, s);
  s.synchronize();  // a synchronization point: the default pool (threshold 0) gives it back
  CHECK(default_pool(0).statistics().reserved_current == 0);

  pool mine;
  set_current_pool(0, mine);
  void* m = streamalloc::allocate(4096, s);
  CHECK(mine.owns(m));
  CHECK(find_pool(m) == pool_ref(mine));
  auto found = mine.find_allocation(static_cast<char*>(m) + 100);
  REQUIRE(found);
  CHECK(found->first == m);
  CHECK(found->second == 4096);
  streamalloc::deallocate(m, s);
  set_current_pool(0, default_pool(0));
  CHECK_FALSE(find_pool(reinterpret_cast<void*>(0x1000)));
  CHECK_THROWS_AS((void)default_pool(device_count()), std::invalid_argument);
}

TEST_CASE("raw CUDA streams and CCCL stream_refs work with the pool too") {
  pool p;
  cudaStream_t raw;
  SA_CUDA_REQUIRE(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  void* x = p.allocate(1 * MiB, stream_ref{raw});
  counter bad;
  fill_async(x, 1 * MiB, 5, raw);
  check_async(x, 1 * MiB, 5, bad.d, raw);
  p.deallocate(x, stream_ref{cuda::stream_ref{raw}});  // the same stream, through CCCL's type
  CHECK(p.allocate(1 * MiB, stream_ref{raw}) == x);
  stream_ref{raw}.synchronize();
  CHECK(bad.read() == 0);
  p.deallocate(x, stream_ref{raw});
  stream_ref{raw}.synchronize();
  SA_CUDA_REQUIRE(cudaStreamDestroy(raw));
}

TEST_CASE("a host NUMA pool: host code writes and reads, kernels too") {
  const auto caps = query_capabilities(0);
  if (!caps.host_numa_memory) {
    CHECK_THROWS_AS(pool(pool_properties{.location = memory_location::host_numa(0)}), not_supported);
    return;
  }
  pool p(pool_properties{.location = memory_location::host_numa(caps.host_numa_id < 0 ? 0 : caps.host_numa_id)});
  stream s(0);
  const std::size_t n = 1 << 20;
  auto* x = static_cast<std::uint32_t*>(p.allocate(n * 4, s));
  s.synchronize();  // stream order first: then the host may touch it
  for (std::size_t i = 0; i < n; ++i) x[i] = pattern(i, 77);
  increment_kernel<<<256, 256, 0, s.get()>>>(x, n);
  s.synchronize();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) bad += x[i] != pattern(i, 77) + 1;
  CHECK(bad == 0);
  p.deallocate(x, s);
}

TEST_CASE("stress: threads on their own and shared streams, handing blocks across with events") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  pool_properties props;
  props.release_threshold = 256 * MiB;
  pool p(props);
  // Fewer under the sanitizers (scripts/gpu-check.sh), which slow every launch down.
  const char* env = std::getenv("STREAMALLOC_STRESS_ITERATIONS");
  const int threads = 8, iterations = env != nullptr ? std::atoi(env) : 600;
  std::vector<stream> own;
  for (int t = 0; t < threads; ++t) own.emplace_back(0);
  stream shared(0);
  std::mutex shared_mutex;  // work on the shared stream is enqueued under this lock

  struct handoff {
    void* p;
    std::size_t bytes;
    std::uint32_t seed;
    std::shared_ptr<event> ready;
  };
  std::mutex q_mutex;
  std::deque<handoff> queue;
  counter bad;
  std::atomic<int> errors{0};
  std::atomic<std::size_t> allocations{0};

  auto work = [&](int t) {
    std::mt19937_64 rng(1234 + t);
    std::vector<handoff> mine;
    stream_ref s = own[t];
    try {
      for (int i = 0; i < iterations; ++i) {
        const double l = std::uniform_real_distribution<double>(8, 22)(rng);  // 256 B .. 4 MiB
        const std::size_t bytes = (static_cast<std::size_t>(std::exp2(l)) + 3) / 4 * 4;
        const std::uint32_t seed = static_cast<std::uint32_t>(rng());
        const bool use_shared = rng() % 8 == 0;
        void* x;
        if (use_shared) {
          std::lock_guard lock(shared_mutex);
          x = p.allocate(bytes, shared);
          fill_async(x, bytes, seed, shared.get());
          auto e = std::make_shared<event>();
          e->record(shared);
          mine.push_back({x, bytes, seed, e});
        } else {
          x = p.allocate(bytes, s);
          fill_async(x, bytes, seed, s.get());
          mine.push_back({x, bytes, seed, nullptr});
        }
        ++allocations;
        // Free some: check first, in stream order; sometimes hand the block to another thread.
        while (mine.size() > 16 || (rng() % 3 == 0 && !mine.empty())) {
          handoff h = mine.back();
          mine.pop_back();
          if (h.ready) s.wait(*h.ready);
          if (rng() % 4 == 0) {
            auto e = std::make_shared<event>();
            e->record(s);
            std::lock_guard lock(q_mutex);
            queue.push_back({h.p, h.bytes, h.seed, e});
          } else {
            check_async(h.p, h.bytes, h.seed, bad.d, s.get());
            p.deallocate(h.p, s);
          }
        }
        // Take a block another thread handed over: wait for its event, check, free here.
        handoff h{};
        {
          std::lock_guard lock(q_mutex);
          if (!queue.empty()) {
            h = queue.front();
            queue.pop_front();
          }
        }
        if (h.p != nullptr) {
          s.wait(*h.ready);
          check_async(h.p, h.bytes, h.seed, bad.d, s.get());
          p.deallocate(h.p, s);
        }
      }
      for (auto& h : mine) {
        if (h.ready) s.wait(*h.ready);
        check_async(h.p, h.bytes, h.seed, bad.d, s.get());
        p.deallocate(h.p, s);
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "thread %d: %s\n", t, e.what());
      ++errors;
    }
  };
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) ts.emplace_back(work, t);
  for (auto& t : ts) t.join();
  // What is still queued: free it from the main thread on the shared stream.
  for (auto& h : queue) {
    shared.wait(*h.ready);
    check_async(h.p, h.bytes, h.seed, bad.d, shared.get());
    p.deallocate(h.p, shared);
  }
  for (auto& s : own) s.synchronize();
  shared.synchronize();
  CHECK(errors == 0);
  CHECK(bad.read() == 0);
  const auto st = p.statistics();
  MESSAGE("stress: " << allocations.load() << " allocations; reserved high " << st.reserved_high / MiB
                     << " MiB, used high " << st.used_high / MiB << " MiB, remapped " << st.remapped_chunks);
  CHECK(st.live_allocations == 0);
  CHECK(st.used_current == 0);
  CHECK(allocations == threads * iterations);
}

TEST_CASE("observability on the GPU: a snapshot lists the blocks kernels use; the out-of-memory handler frees and retries") {
  pool_properties props;
  props.max_size = 64 * MiB;
  props.chunk_size = 32 * MiB;
  pool p(props);
  stream s;
  p.keep_history(64);
  void* a = p.allocate(32 * MiB, s.ref());
  void* b = p.allocate(32 * MiB, s.ref());
  fill(a, 32 * MiB, 71, s.get());
  fill(b, 32 * MiB, 72, s.get());
  const std::string doc = p.snapshot();
  const auto blocks = doc.find("\"blocks\": [");
  REQUIRE(blocks != std::string::npos);
  for (void* x : {a, b}) {
    const std::string entry = "{\"address\": " + std::to_string(reinterpret_cast<std::uintptr_t>(x)) +
                              ", \"bytes\": " + std::to_string(32 * MiB) + ", \"state\": \"live\", \"age_ms\": ";
    CHECK(doc.find(entry, blocks) != std::string::npos);
  }
  CHECK(doc.find("\"op\": \"grow\"") != std::string::npos);
  CHECK(doc.find("\"device_memory\": {\"free\": ") != std::string::npos);
  int calls = 0;
  p.set_out_of_memory_handler([&](const out_of_memory& e) {
    ++calls;
    CHECK(std::string(e.what()).find("of at most 67108864 (max_size), live 67108864") != std::string::npos);
    if (a == nullptr) return false;
    p.deallocate(a, s.ref());  // in s's order: the retry on s may take it at once
    a = nullptr;
    return true;
  });
  void* c = p.allocate(32 * MiB, s.ref());
  CHECK(calls == 1);
  fill(c, 32 * MiB, 73, s.get());
  CHECK(mismatches_on(c, 32 * MiB, 73, s.get()) == 0);
  CHECK(mismatches_on(b, 32 * MiB, 72, s.get()) == 0);
  CHECK_THROWS_AS((void)p.allocate(32 * MiB, s.ref()), out_of_memory);
  CHECK(calls == 2);
  p.deallocate(b, s.ref());
  p.deallocate(c, s.ref());
}
