// device_arena on a real GPU: many blocks allocate at once (ranges disjoint and aligned, checked
// with a bitmap of the region; contents written by the kernels and read back), exhaustion under
// contention with the failure count the arithmetic predicts and an offset that stops growing,
// reset and reuse in stream order, two streams with arenas of their own, hand-offs between
// streams with proof, the memory going back to the pool, and blocks' sub-arenas.

#include <streamalloc/device_arena.hpp>

#include <doctest/doctest.h>

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

static_assert(STREAMALLOC_CHECK_ORDERING == 1, "the GPU tests exercise the run-time ordering checks");

// Names at file scope must differ from the other GPU test files' (one translation unit): all
// of this file, test cases included, is in this namespace, and so are its using-directives.
namespace device_arena_tests {

using namespace streamalloc;
using namespace streamalloc_test;

static_assert(std::is_trivially_copyable_v<device_arena_view>);
static_assert(!std::is_copy_constructible_v<device_arena> && !std::is_copy_assignable_v<device_arena>);
static_assert(std::is_nothrow_move_constructible_v<device_arena>);

/// What each allocation got: the pointer (0 for nullptr), the size and alignment asked.
struct record {
  std::uint64_t pointer;
  std::uint32_t bytes;
  std::uint32_t alignment;
};

__host__ __device__ inline std::uint32_t mix(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

__device__ inline unsigned thread_index() { return blockIdx.x * blockDim.x + threadIdx.x; }

/// The byte an allocation holds at `i`: derived from the record's index, so overlapping
/// allocations, or one written by the wrong thread, show up as mismatches.
__host__ __device__ inline unsigned char content(std::size_t record_index, std::size_t i) {
  return static_cast<unsigned char>(mix(static_cast<std::uint32_t>(record_index * 2654435761U + i)) >> 24);
}

__device__ inline void fill_record(record& r, std::size_t index) {
  auto* p = reinterpret_cast<unsigned char*>(r.pointer);
  for (std::uint32_t i = 0; i < r.bytes; ++i) p[i] = content(index, i);
}

/// Every thread makes `per_thread` requests. Odd rounds mix sizes (1..700 bytes) and
/// alignments (1..256) across the lanes; even rounds give a warp one size; some lanes sit a
/// round out, some ask for zero bytes, so the lanes asking at once are any subset of a warp.
__global__ void mixed_kernel(device_arena_view arena, record* out, int per_thread, std::uint32_t seed) {
  const unsigned t = thread_index();
  for (int k = 0; k < per_thread; ++k) {
    const std::size_t index = std::size_t{t} * per_thread + k;
    record r{0, 0, 0};
    const std::uint32_t h = mix(t * 977U + static_cast<std::uint32_t>(k) * 131U + seed);
    if (h % 5 != 0) {
      if (k % 2 == 0) {
        r.bytes = 16U << ((t / 32 + k) % 5);
        r.alignment = 16;
      } else {
        r.bytes = h % 11 == 0 ? 0 : 1 + (h >> 8) % 700;
        r.alignment = 1U << ((h >> 20) % 9);
      }
      r.pointer = reinterpret_cast<std::uint64_t>(arena.allocate(r.bytes, r.alignment));
      if (r.pointer != 0) fill_record(r, index);
    }
    out[index] = r;
  }
}

/// Every thread makes `per_thread` requests of `bytes` at 16.
__global__ void uniform_kernel(device_arena_view arena, record* out, int per_thread, std::uint32_t bytes) {
  const unsigned t = thread_index();
  for (int k = 0; k < per_thread; ++k) {
    const std::size_t index = std::size_t{t} * per_thread + k;
    record r{0, bytes, 16};
    r.pointer = reinterpret_cast<std::uint64_t>(arena.allocate(bytes, 16));
    if (r.pointer != 0) fill_record(r, index);
    out[index] = r;
  }
}

/// As uniform_kernel, after spinning for `spin_ns` (holds the stream, so what is enqueued
/// behind it on the host side has to wait for it).
__global__ void slow_uniform_kernel(device_arena_view arena, record* out, int per_thread, std::uint32_t bytes,
                                    unsigned long long spin_ns) {
  const unsigned long long start = global_ns();
  while (global_ns() - start < spin_ns) __nanosleep(1000);
  const unsigned t = thread_index();
  for (int k = 0; k < per_thread; ++k) {
    const std::size_t index = std::size_t{t} * per_thread + k;
    record r{0, bytes, 16};
    r.pointer = reinterpret_cast<std::uint64_t>(arena.allocate(bytes, 16));
    if (r.pointer != 0) fill_record(r, index);
    out[index] = r;
  }
}

/// Requests that can never be served, whatever the arena holds, and ones that fit no more.
__global__ void failing_kernel(device_arena_view arena, unsigned long long* non_null) {
  const unsigned t = thread_index();
  const std::size_t sizes[4] = {arena.capacity(), std::size_t{1} << 39, ~std::size_t{0}, 64};
  void* p = arena.allocate(sizes[t % 4], 16);
  if (p != nullptr) atomicAdd(non_null, 1ULL);
}

/// Requests the arena refuses alone, whatever its state: one thread.
__global__ void bad_requests_kernel(device_arena_view arena, unsigned long long* non_null) {
  void* got[5] = {arena.allocate(0),                      // zero bytes: nullptr, not a failure
                  arena.allocate(16, 3),                  // not a power of two
                  arena.allocate(16, 0),                  // nor is 0
                  arena.allocate(arena.capacity() + 1),   // more than the region
                  arena.allocate(16, arena.capacity() * 2)};  // an alignment larger than the region
  for (void* p : got) {
    if (p != nullptr) atomicAdd(non_null, 1ULL);
  }
}

/// What kernels read of the counters: [0] used, [1] failures.
__global__ void read_counters_kernel(device_arena_view arena, unsigned long long* out) {
  out[0] = arena.used();
  out[1] = arena.failures();
}

/// Every thread of every block takes `per_thread` allocations of `bytes` from its block's
/// sub-arena of `block_bytes`.
__global__ void block_kernel(device_arena_view arena, record* out, int per_thread, std::uint32_t bytes,
                             std::size_t block_bytes, unsigned long long* block_capacity) {
  __shared__ device_block_arena_state st;
  const device_block_arena block = arena.for_block(st, block_bytes);
  if (threadIdx.x == 0) block_capacity[blockIdx.x] = block.capacity();
  const unsigned t = thread_index();
  for (int k = 0; k < per_thread; ++k) {
    const std::size_t index = std::size_t{t} * per_thread + k;
    record r{0, bytes, 16};
    r.pointer = reinterpret_cast<std::uint64_t>(block.allocate(bytes, 16));
    if (r.pointer != 0) fill_record(r, index);
    out[index] = r;
  }
}

/// Counts the bytes of the allocations not holding what fill_record wrote.
__global__ void verify_kernel(const record* records, std::size_t n, unsigned long long* bad) {
  for (std::size_t i = thread_index(); i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    const record r = records[i];
    if (r.pointer == 0) continue;
    const auto* p = reinterpret_cast<const unsigned char*>(r.pointer);
    unsigned long long wrong = 0;
    for (std::uint32_t j = 0; j < r.bytes; ++j) wrong += p[j] != content(i, j) ? 1 : 0;
    if (wrong != 0) atomicAdd(bad, wrong);
  }
}

/// What the arena charges for a request (detail/core/arena_bump.hpp).
inline std::uint64_t need_of(std::uint32_t bytes, std::uint32_t alignment) {
  return ((std::uint64_t{bytes} + 15) & ~std::uint64_t{15}) + (alignment > 16 ? alignment - 16 : 0);
}

/// One bit per byte of the region: each successful allocation must lie inside it, start at its
/// alignment, and cover bytes no other one covers.
struct bitmap_result {
  std::size_t successes = 0;
  std::size_t nulls = 0;
  std::size_t outside = 0;
  std::size_t misaligned = 0;
  std::size_t overlapping = 0;
  std::size_t bytes_marked = 0;
  std::uint64_t needed = 0;  ///< sum of what the successful requests were charged
};

inline bitmap_result check_ranges(const std::vector<record>& records, const device_arena_view& v) {
  bitmap_result out;
  std::vector<std::uint64_t> bits((v.capacity() + 63) / 64, 0);
  const auto base = reinterpret_cast<std::uint64_t>(v.base());
  for (const record& r : records) {
    if (r.pointer == 0) {
      ++out.nulls;
      continue;
    }
    ++out.successes;
    out.needed += need_of(r.bytes, r.alignment);
    if (r.alignment != 0 && r.pointer % r.alignment != 0) ++out.misaligned;
    if (r.pointer < base || r.pointer + r.bytes > base + v.capacity()) {
      ++out.outside;
      continue;
    }
    bool overlap = false;
    for (std::uint64_t b = r.pointer - base; b < r.pointer - base + r.bytes; ++b) {
      std::uint64_t& word = bits[b / 64];
      const std::uint64_t bit = std::uint64_t{1} << (b % 64);
      overlap = overlap || (word & bit) != 0;
      word |= bit;
    }
    out.overlapping += overlap ? 1 : 0;
    out.bytes_marked += r.bytes;
  }
  return out;
}

/// Runs verify_kernel over the records on `s`; returns the bytes that did not match.
inline unsigned long long wrong_bytes(const stream_buffer<record>& records, stream_ref s) {
  stream_buffer<unsigned long long> bad(1, s);
  bad.fill_zero();
  verify_kernel<<<256, 256, 0, s.get()>>>(records.data(), records.size(), bad.data());
  return bad.to_host()[0];
}

/// The raw offset (which may lie past the capacity), read on `s`.
inline std::uint64_t raw_offset(const device_arena_view& v, stream_ref s) {
  std::uint64_t o = 0;
  SA_CUDA_REQUIRE(cudaMemcpyAsync(&o, v.offset(), sizeof o, cudaMemcpyDeviceToHost, s.get()));
  s.synchronize();
  return o;
}

constexpr unsigned blocks = 128;
constexpr unsigned threads = 256;

TEST_CASE("device_arena: 128 blocks allocate at once: ranges disjoint and aligned, contents read back") {
  stream s(0);
  device_arena arena(128 * MiB, s);
  CHECK(arena.capacity() == 128 * MiB);
  CHECK(arena.stream() == stream_ref(s));
  const device_arena_view v = arena.view();
  CHECK(reinterpret_cast<std::uintptr_t>(v.base()) % 256 == 0);
  CHECK(arena.pool().owns(v.base()));

  constexpr int per_thread = 4;
  stream_buffer<record> out(std::size_t{blocks} * threads * per_thread, s);
  mixed_kernel<<<blocks, threads, 0, s.get()>>>(v, out.data(), per_thread, 12345);
  SA_CUDA_REQUIRE(cudaGetLastError());
  CHECK(wrong_bytes(out, s) == 0);

  const std::vector<record> h = out.to_host();
  const bitmap_result r = check_ranges(h, v);
  std::size_t asked = 0, zero = 0;
  for (const record& x : h) {
    asked += x.alignment != 0 && x.bytes != 0 ? 1 : 0;
    zero += x.alignment != 0 && x.bytes == 0 ? 1 : 0;
  }
  INFO("successes " << r.successes << " of " << asked << " requests");
  CHECK(asked > h.size() / 2);
  CHECK(zero > 0);
  CHECK(r.successes == asked);  // the region holds them all
  CHECK(r.outside == 0);
  CHECK(r.misaligned == 0);
  CHECK(r.overlapping == 0);

  const device_arena_usage u = arena.usage();
  CHECK(u.failures == 0);  // zero-byte requests are not failures
  CHECK(u.capacity == 128 * MiB);
  CHECK(u.used == r.needed);  // exactly what was charged: nothing lost between groups
}

TEST_CASE("device_arena: exhaustion under contention: failures as predicted, and the offset stops growing") {
  stream s(0);
  constexpr std::size_t capacity = 1 * MiB;
  constexpr std::uint32_t bytes = 64;
  constexpr int per_thread = 4;
  device_arena arena(capacity, s);
  const device_arena_view v = arena.view();
  const std::size_t requests = std::size_t{blocks} * threads * per_thread;  // 131,072: 8 MiB asked of 1 MiB
  stream_buffer<record> out(requests, s);
  uniform_kernel<<<blocks, threads, 0, s.get()>>>(v, out.data(), per_thread, bytes);
  SA_CUDA_REQUIRE(cudaGetLastError());
  CHECK(wrong_bytes(out, s) == 0);

  // Equal requests that divide the capacity: the group that crosses the end fills it up to the
  // last byte, so exactly capacity / 64 succeed, however the warps interleave.
  const std::vector<record> h = out.to_host();
  const bitmap_result r = check_ranges(h, v);
  CHECK(r.successes == capacity / bytes);
  CHECK(r.nulls == requests - capacity / bytes);
  CHECK(r.overlapping == 0);
  CHECK(r.outside == 0);
  CHECK(r.bytes_marked == capacity);  // every byte handed out once

  device_arena_usage u = arena.usage();
  CHECK(u.used == capacity);
  CHECK(u.failures == requests - capacity / bytes);

  // Kernels read the same counters.
  stream_buffer<unsigned long long> seen(2, s);
  read_counters_kernel<<<1, 1, 0, s.get()>>>(v, seen.data());
  const std::vector<unsigned long long> counters = seen.to_host();
  CHECK(counters[0] == capacity);
  CHECK(counters[1] == u.failures);

  // The group that crossed the end clamped the offset to capacity + 1, and so did every group
  // after it: once the kernels are done it is there, and any number of failing callers leave it
  // there, however large their requests (spec/002's sketch would add each of them).
  const std::uint64_t offset = raw_offset(v, s);
  CHECK(offset == capacity + 1);
  stream_buffer<unsigned long long> non_null(1, s);
  non_null.fill_zero();
  constexpr int rounds = 20;
  for (int i = 0; i < rounds; ++i) failing_kernel<<<blocks, threads, 0, s.get()>>>(v, non_null.data());
  SA_CUDA_REQUIRE(cudaGetLastError());
  CHECK(non_null.to_host()[0] == 0);
  CHECK(raw_offset(v, s) == offset);
  u = arena.usage();
  CHECK(u.failures == requests - capacity / bytes + std::uint64_t{rounds} * blocks * threads);
  CHECK(u.used == capacity);
}

TEST_CASE("device_arena: requests refused alone: nullptr, counted (but zero bytes), the offset untouched") {
  stream s(0);
  device_arena arena(4096, s);
  stream_buffer<unsigned long long> non_null(1, s);
  non_null.fill_zero();
  bad_requests_kernel<<<1, 1, 0, s.get()>>>(arena.view(), non_null.data());
  SA_CUDA_REQUIRE(cudaGetLastError());
  CHECK(non_null.to_host()[0] == 0);
  const device_arena_usage u = arena.usage();
  CHECK(u.failures == 4);
  CHECK(u.used == 0);
  CHECK(raw_offset(arena.view(), s) == 0);

  CHECK_THROWS_AS(device_arena(0, s), std::invalid_argument);
  CHECK_THROWS_AS(device_arena((std::size_t{1} << 40) + 1, s), std::invalid_argument);
}

TEST_CASE("device_arena: reset in stream order: after the kernels before it, before the ones after") {
  stream s(0);
  constexpr std::uint32_t bytes = 64;
  constexpr int per_thread = 2;
  const std::size_t requests = std::size_t{blocks} * threads * per_thread;
  device_arena arena(requests * bytes, s);  // exactly one kernel's requests
  const device_arena_view v = arena.view();
  stream_buffer<record> first(requests, s), second(requests, s), third(requests, s);

  // Enqueued without a host synchronization: the first kernel spins before it allocates, so a
  // reset that did not wait for it would run first and leave its allocations counted.
  slow_uniform_kernel<<<blocks, threads, 0, s.get()>>>(v, first.data(), per_thread, bytes, 20'000'000);
  uniform_kernel<<<blocks, threads, 0, s.get()>>>(v, second.data(), per_thread, bytes);  // finds it full
  SA_CUDA_REQUIRE(cudaGetLastError());
  device_arena_usage u = arena.usage();
  CHECK(u.used == requests * bytes);
  CHECK(u.failures == requests);
  CHECK(check_ranges(first.to_host(), v).successes == requests);
  CHECK(check_ranges(second.to_host(), v).successes == 0);

  slow_uniform_kernel<<<blocks, threads, 0, s.get()>>>(v, first.data(), per_thread, bytes, 20'000'000);
  arena.reset();  // behind the slow kernel, on the arena's stream
  uniform_kernel<<<blocks, threads, 0, s.get()>>>(v, third.data(), per_thread, bytes);
  SA_CUDA_REQUIRE(cudaGetLastError());
  u = arena.usage();
  CHECK(u.failures == 0);  // the reset cleared the count, and the third kernel had the whole region
  CHECK(u.used == requests * bytes);
  const bitmap_result r = check_ranges(third.to_host(), v);
  CHECK(r.successes == requests);
  CHECK(r.overlapping == 0);
  CHECK(r.bytes_marked == requests * bytes);
  CHECK(wrong_bytes(third, s) == 0);  // reused memory, rewritten by the third kernel
}

TEST_CASE("device_arena: two streams, an arena each, allocating at the same time") {
  pool p;
  stream a(0), b(0);
  const device_resource mr(p);
  constexpr std::uint32_t bytes = 48;
  constexpr int per_thread = 3;
  const std::size_t requests = std::size_t{blocks} * threads * per_thread;
  device_arena on_a(requests * 48, a, mr);
  device_arena on_b(requests * 48, b, p);
  CHECK(!overlaps(on_a.view().base(), on_a.capacity(), on_b.view().base(), on_b.capacity()));
  stream_buffer<record> out_a(requests, a, mr), out_b(requests, b, mr);
  slow_uniform_kernel<<<blocks, threads, 0, a.get()>>>(on_a.view(), out_a.data(), per_thread, bytes, 5'000'000);
  slow_uniform_kernel<<<blocks, threads, 0, b.get()>>>(on_b.view(), out_b.data(), per_thread, bytes, 5'000'000);
  SA_CUDA_REQUIRE(cudaGetLastError());
  for (auto* x : {&on_a, &on_b}) {
    const device_arena_usage u = x->usage();
    CHECK(u.failures == 0);
    CHECK(u.used == requests * 48);
  }
  const bitmap_result ra = check_ranges(out_a.to_host(), on_a.view());
  const bitmap_result rb = check_ranges(out_b.to_host(), on_b.view());
  CHECK(ra.successes == requests);
  CHECK(rb.successes == requests);
  CHECK(ra.outside + rb.outside + ra.overlapping + rb.overlapping == 0);
  CHECK(wrong_bytes(out_a, a) == 0);
  CHECK(wrong_bytes(out_b, b) == 0);
}

TEST_CASE("device_arena: moved to another stream with proof; what proofs cannot show is checked at run time") {
  stream a(0), b(0), c(0);
  constexpr std::uint32_t bytes = 32;
  const std::size_t requests = std::size_t{blocks} * threads;
  device_arena arena(requests * bytes, a);
  stream_buffer<record> out(requests, a);

  const stream_order early = order_after(b, a);
  slow_uniform_kernel<<<blocks, threads, 0, a.get()>>>(arena.view(), out.data(), 1, bytes, 20'000'000);
  // A proof made before the arena's last use (view() for that kernel) does not cover it.
  try {
    arena.set_stream(b, early);
    FAIL("no ordering_error");
  } catch (const ordering_error& e) {
    CHECK(std::string(e.what()).find("made before the memory's last use") != std::string::npos);
  }
  CHECK(arena.stream() == stream_ref(a));
  CHECK_THROWS_AS(arena.reset(b, order_after(c, a)), ordering_error);  // a proof for another stream

  // reset(b, proof): b runs after the slow kernel, then empties the arena.
  arena.reset(b, order_after(b, a));
  CHECK(arena.stream() == stream_ref(b));
  stream_buffer<record> again(requests, b);
  uniform_kernel<<<blocks, threads, 0, b.get()>>>(arena.view(), again.data(), 1, bytes);
  SA_CUDA_REQUIRE(cudaGetLastError());
  const device_arena_usage u = arena.usage();
  CHECK(u.failures == 0);
  CHECK(u.used == requests * bytes);  // only the second kernel's: the reset came after the first
  CHECK(check_ranges(again.to_host(), arena.view()).successes == requests);
  CHECK(wrong_bytes(again, b) == 0);

  // The usage's synchronization is a proof too; free_on another stream with one.
  const host_order done = arena.usage().synchronized;
  arena.set_stream(c, done);
  CHECK(arena.stream() == stream_ref(c));
  std::move(arena).free_on(a, order_after(a, c));
  CHECK(arena.capacity() == 0);
  CHECK(!arena.view());
}

TEST_CASE("device_arena: the whole arena goes back to its pool; a moved-from arena's view is empty") {
  pool p;
  stream s(0);
  const std::size_t before = p.statistics().used_current;
  {
    device_arena arena(3 * MiB, s, p);
    CHECK(p.statistics().used_current >= before + 3 * MiB + 256);
    CHECK(p.statistics().live_allocations == 1);
    device_arena moved(std::move(arena));
    CHECK(moved.capacity() == 3 * MiB);
    CHECK(arena.capacity() == 0);
    CHECK(!arena.view());
    CHECK(arena.usage().used == 0);

    // An empty view allocates nothing and counts nothing.
    stream_buffer<unsigned long long> non_null(1, s, p), counters(2, s, p);
    non_null.fill_zero();
    failing_kernel<<<1, 32, 0, s.get()>>>(arena.view(), non_null.data());
    read_counters_kernel<<<1, 1, 0, s.get()>>>(arena.view(), counters.data());
    SA_CUDA_REQUIRE(cudaGetLastError());
    CHECK(non_null.to_host()[0] == 0);
    CHECK(counters.to_host() == std::vector<unsigned long long>{0, 0});
    CHECK(p.statistics().live_allocations == 3);
  }
  CHECK(p.statistics().used_current == before);
  CHECK(p.statistics().live_allocations == 0);
}

TEST_CASE("device_arena: blocks' sub-arenas: each block allocates from its own memory, then from the arena") {
  stream s(0);
  constexpr std::uint32_t bytes = 64;
  constexpr std::size_t block_bytes = std::size_t{threads} * bytes;  // one allocation per thread
  device_arena arena(blocks * block_bytes, s);                       // one sub-arena per block, exactly
  const device_arena_view v = arena.view();
  const std::size_t requests = std::size_t{blocks} * threads;
  stream_buffer<record> out(requests, s);
  stream_buffer<unsigned long long> block_capacity(blocks, s);

  // Each block's sub-arena holds its threads' requests: all succeed, inside the block's memory.
  block_kernel<<<blocks, threads, 0, s.get()>>>(v, out.data(), 1, bytes, block_bytes, block_capacity.data());
  SA_CUDA_REQUIRE(cudaGetLastError());
  CHECK(wrong_bytes(out, s) == 0);
  std::vector<record> h = out.to_host();
  bitmap_result r = check_ranges(h, v);
  CHECK(r.successes == requests);
  CHECK(r.overlapping == 0);
  CHECK(r.bytes_marked == blocks * block_bytes);
  for (unsigned blk = 0; blk < blocks; ++blk) {
    std::uint64_t lo = ~std::uint64_t{0}, hi = 0;
    for (unsigned t = 0; t < threads; ++t) {
      const record& x = h[std::size_t{blk} * threads + t];
      lo = std::min(lo, x.pointer);
      hi = std::max(hi, x.pointer + x.bytes);
    }
    CHECK(hi - lo == block_bytes);  // one contiguous piece of the arena per block
  }
  for (unsigned long long c : block_capacity.to_host()) CHECK(c == block_bytes);
  device_arena_usage u = arena.usage();
  CHECK(u.used == blocks * block_bytes);
  CHECK(u.failures == 0);

  // The arena is full: the sub-arenas are empty, every request goes to the arena and fails
  // there, and is counted once.
  block_kernel<<<blocks, threads, 0, s.get()>>>(v, out.data(), 1, bytes, block_bytes, block_capacity.data());
  SA_CUDA_REQUIRE(cudaGetLastError());
  CHECK(check_ranges(out.to_host(), v).successes == 0);
  for (unsigned long long c : block_capacity.to_host()) CHECK(c == 0);
  CHECK(arena.usage().failures == requests);

  // Half of each block's requests fit its sub-arena, the rest come from the arena (room for all).
  device_arena big(4 * blocks * block_bytes, s);
  const device_arena_view bv = big.view();
  stream_buffer<record> out2(requests * 2, s);
  block_kernel<<<blocks, threads, 0, s.get()>>>(bv, out2.data(), 2, bytes, block_bytes / 2, block_capacity.data());
  SA_CUDA_REQUIRE(cudaGetLastError());
  CHECK(wrong_bytes(out2, s) == 0);
  r = check_ranges(out2.to_host(), bv);
  CHECK(r.successes == requests * 2);
  CHECK(r.overlapping == 0);
  CHECK(r.outside == 0);
  u = big.usage();
  CHECK(u.failures == 0);
  // Each sub-arena was used to its last byte (equal requests that divide it), the rest came from
  // the arena: exactly what was asked, nothing lost.
  CHECK(u.used == requests * 2 * bytes);
}

}  // namespace device_arena_tests
