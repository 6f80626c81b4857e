// stream_buffer<T> on a real GPU: contents written by kernels and read back, hand-offs between
// streams with ordering tokens (and the run-time checks of what tokens cannot prove), frees
// ordered after readers, growth in place and its fallback, host buffers, bad input.

#include <streamalloc/stream_buffer.hpp>

#include <doctest/doctest.h>

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <cuda_runtime.h>

#include <cstdint>
#include <memory_resource>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

static_assert(STREAMALLOC_CHECK_ORDERING == 1, "the GPU tests exercise the run-time ordering checks");

namespace {
std::uint32_t* words(stream_buffer<std::uint32_t>& b) { return b.data(); }

bool holds_pattern(const std::vector<std::uint32_t>& v, std::uint32_t seed, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (v[i] != pattern(i, seed)) return false;
  }
  return true;
}

std::string message_of(auto&& fn) {
  try {
    fn();
  } catch (const ordering_error& e) {
    return e.what();
  }
  return "no ordering_error";
}
}  // namespace

TEST_CASE("a buffer from the current pool: a kernel writes it on its stream, copy_to reads it back") {
  stream a(0);
  stream_buffer<std::uint32_t> buf(1000, a);
  CHECK(buf.size() == 1000);
  CHECK(buf.stream() == stream_ref(a));
  CHECK(current_pool(0).owns(buf.data()));
  fill_async(words(buf), buf.size_bytes(), 7, a.get());
  CHECK(holds_pattern(buf.to_host(), 7, 1000));
  // And the other way: host data in, a kernel checks it.
  std::vector<std::uint32_t> h(1000);
  for (std::size_t i = 0; i < h.size(); ++i) h[i] = pattern(i, 9);
  buf.copy_from(h);
  CHECK(mismatches_on(buf.data(), buf.size_bytes(), 9, a.get()) == 0);
}

TEST_CASE("set_stream with order_after: the new stream runs after the old one's kernel") {
  stream a(0), b(0);
  stream_buffer<std::uint32_t> buf(4 * MiB / 4, a);
  slow_fill_kernel<<<64, 256, 0, a.get()>>>(buf.data(), buf.size(), 3, busy_cycles);
  buf.set_stream(b, order_after(b, a));
  CHECK(buf.stream() == stream_ref(b));
  // On b, without a host synchronization: the slow fill must be visible.
  CHECK(mismatches_on(buf.data(), buf.size_bytes(), 3, b.get()) == 0);
  // An event recorded by the caller and waited on also proves it.
  event e;
  slow_fill_kernel<<<64, 256, 0, b.get()>>>(buf.data(), buf.size(), 4, busy_cycles);
  e.record(b);
  buf.set_stream(a, a.wait(e));
  CHECK(mismatches_on(buf.data(), buf.size_bytes(), 4, a.get()) == 0);
}

TEST_CASE("what tokens cannot prove is checked at run time, with a message that says what is wrong") {
  stream a(0), b(0), c(0);
  stream_buffer<std::uint32_t> buf(1024, a);

  // A token for another pair of streams.
  const stream_order c_after_a = order_after(c, a);
  CHECK(message_of([&] { buf.set_stream(b, c_after_a); }).find("the token orders stream #") != std::string::npos);
  CHECK(buf.stream() == stream_ref(a));  // unchanged

  // A token for the right streams, but made before the buffer's last use.
  const stream_order early = order_after(b, a);
  buf.fill_zero();  // a use on a after the token
  CHECK(message_of([&] { buf.set_stream(b, early); }).find("made before the memory's last use") != std::string::npos);

  // A host synchronization with another stream.
  const host_order c_done = c.synchronize();
  CHECK(message_of([&] { buf.set_stream(b, c_done); }).find("the host synchronized with stream #") != std::string::npos);

  // An event recorded with a raw CUDA call proves nothing streamalloc can check.
  cudaEvent_t raw{};
  SA_CUDA_REQUIRE(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming));
  SA_CUDA_REQUIRE(cudaEventRecord(raw, a.get()));
  const stream_order blind = b.wait(event_ref(raw));
  CHECK(message_of([&] { buf.set_stream(b, blind); }).find("raw CUDA call") != std::string::npos);
  cudaEventDestroy(raw);

  // Copying from a buffer on another stream without proof.
  stream_buffer<std::uint32_t> other(1024, b);
  CHECK(message_of([&] { buf.copy_from(other); }).find("source buffer is on another stream") != std::string::npos);

  // The right token works; so does a synchronization of the buffer's own stream.
  buf.set_stream(b, order_after(b, a));
  buf.set_stream(c, b.synchronize());
  CHECK(buf.stream() == stream_ref(c));
}

TEST_CASE("a free waits for the streams that read the buffer, even when the memory is reused at once") {
  pool p;
  stream a(0), b(0);
  const device_resource mr(p);
  auto src = std::make_unique<stream_buffer<std::uint32_t>>(2 * MiB / 4, a, mr);
  fill_async(src->data(), src->size_bytes(), 1, a.get());
  stream_buffer<std::uint32_t> dst(2 * MiB / 4, b, mr);
  // b is busy, then copies from src: a reader of src on another stream.
  slow_fill_kernel<<<1, 32, 0, b.get()>>>(dst.data(), 1, 0, busy_cycles);
  dst.copy_from(*src, order_after(b, a));
  void* const old = src->data();
  src.reset();  // freed on a: the buffer makes a wait for b's copy first
  stream_buffer<std::uint32_t> reuse(2 * MiB / 4, a, mr);
  CHECK(static_cast<void*>(reuse.data()) == old);  // same-stream reuse of the freed memory
  fill_async(reuse.data(), reuse.size_bytes(), 2, a.get());
  // Had the free not waited for b, a's fill would have overwritten the source before the copy.
  CHECK(mismatches_on(dst.data(), dst.size_bytes(), 1, b.get()) == 0);
}

TEST_CASE("a reader's stream destroyed before the free: the free waits for its work, and happens") {
  pool p;
  stream a(0), c(0);
  const device_resource mr(p);
  auto src = std::make_unique<stream_buffer<std::uint32_t>>(2 * MiB / 4, a, mr);
  fill_async(src->data(), src->size_bytes(), 12, a.get());
  std::unique_ptr<stream_buffer<std::uint32_t>> dst;
  {
    stream b(0);
    dst = std::make_unique<stream_buffer<std::uint32_t>>(2 * MiB / 4, b, mr);
    slow_fill_kernel<<<1, 32, 0, b.get()>>>(dst->data(), 1, 0, busy_cycles);
    dst->copy_from(*src, order_after(b, a));  // b reads src, behind a slow kernel
    dst->set_stream(c, order_after(c, b));
  }  // b destroyed with its copy still queued: src's reader is gone, a knows nothing of it
  src.reset();  // must not record on b's dead handle: waits for the device instead
  stream_buffer<std::uint32_t> reuse(2 * MiB / 4, a, mr);
  fill_async(reuse.data(), reuse.size_bytes(), 13, a.get());
  CHECK(mismatches_on(dst->data(), dst->size_bytes(), 12, c.get()) == 0);
  dst.reset();
  (void)a.synchronize();
  (void)c.synchronize();
  CHECK(p.statistics().live_allocations == 1);  // only `reuse`
}

TEST_CASE("free_on another stream with proof; the pool sees the free on that stream") {
  pool p;
  stream a(0), b(0);
  stream_buffer<std::uint32_t> buf(1024, a, device_resource(p));
  CHECK(p.statistics().live_allocations == 1);
  std::move(buf).free_on(b, order_after(b, a));
  CHECK(buf.data() == nullptr);
  CHECK(p.statistics().live_allocations == 0);
  // A stale proof is refused and frees nothing.
  stream_buffer<std::uint32_t> buf2(1024, a, device_resource(p));
  const stream_order early = order_after(b, a);
  buf2.fill_zero();
  CHECK_THROWS_AS(std::move(buf2).free_on(b, early), ordering_error);
  CHECK(p.statistics().live_allocations == 1);
}

TEST_CASE("reserve grows in place: same address, contents kept, nothing copied") {
  pool p;
  stream s(0);
  stream_buffer<std::uint32_t> buf(1 * MiB / 4, s, device_resource(p));
  fill_async(buf.data(), buf.size_bytes(), 5, s.get());
  const std::uint32_t* const at = buf.data();
  // 1 MiB -> 32 MiB inside the first chunk, then -> 1 GiB by mapping memory behind it.
  CHECK(buf.reserve(32 * MiB / 4) == growth::in_place);
  CHECK(buf.reserve(1024 * MiB / 4) == growth::in_place);
  CHECK(buf.data() == at);
  CHECK(buf.capacity() >= 1024 * MiB / 4);
  CHECK(p.statistics().used_current >= 1024 * MiB);
  CHECK(mismatches_on(buf.data(), 1 * MiB, 5, s.get()) == 0);
  // The whole grown range is usable by kernels.
  CHECK(buf.resize(1024 * MiB / 4) == growth::unchanged);
  fill_async(buf.data(), buf.size_bytes(), 6, s.get());
  CHECK(mismatches_on(buf.data(), buf.size_bytes(), 6, s.get()) == 0);
  CHECK(buf.reserve(10) == growth::unchanged);
}

TEST_CASE("several large buffers of one pool grow in turn, each in place") {
  pool p;
  stream s(0);
  std::vector<stream_buffer<std::uint32_t>> bufs;
  std::vector<const std::uint32_t*> at;
  for (int i = 0; i < 4; ++i) {
    bufs.emplace_back(64 * MiB / 4, s, device_resource(p));
    at.push_back(bufs.back().data());
    fill_async(bufs.back().data(), bufs.back().size_bytes(), 40 + i, s.get());
  }
  for (std::size_t size = 128 * MiB; size <= 1024 * MiB; size *= 2) {
    for (auto& b : bufs) CHECK(b.resize(size / 4) == growth::in_place);
  }
  for (int i = 0; i < 4; ++i) {
    CHECK(bufs[i].data() == at[i]);
    CHECK(mismatches_on(bufs[i].data(), 64 * MiB, 40 + i, s.get()) == 0);
  }
}

TEST_CASE("shrink_to_fit gives the rest back without moving; the buffer grows back in place") {
  pool p;
  stream s(0);
  stream_buffer<std::uint32_t> buf(256 * MiB / 4, s, device_resource(p));
  fill_async(buf.data(), buf.size_bytes(), 50, s.get());
  const auto* at = buf.data();
  const auto used = p.statistics().used_current;
  buf.resize(1 * MiB / 4);
  buf.shrink_to_fit();
  CHECK(buf.capacity() == 1 * MiB / 4);
  CHECK(buf.data() == at);
  CHECK(p.statistics().used_current == used - 255 * MiB);
  CHECK(mismatches_on(buf.data(), buf.size_bytes(), 50, s.get()) == 0);
  CHECK(buf.resize(256 * MiB / 4) == growth::in_place);
  CHECK(buf.data() == at);
  buf.resize(0);
  buf.shrink_to_fit();
  CHECK(buf.data() == nullptr);
  CHECK(p.statistics().live_allocations == 0);
}

TEST_CASE("reserve falls back to allocate-and-copy when the memory behind the buffer is taken") {
  pool p;
  stream s(0);
  const device_resource mr(p);
  stream_buffer<std::uint32_t> buf(1 * MiB / 4, s, mr);
  stream_buffer<std::uint32_t> neighbour(1 * MiB / 4, s, mr);  // right behind buf
  REQUIRE(reinterpret_cast<char*>(neighbour.data()) == reinterpret_cast<char*>(buf.data()) + 1 * MiB);
  fill_async(buf.data(), buf.size_bytes(), 8, s.get());
  CHECK_FALSE(buf.try_reserve_in_place(4 * MiB / 4));
  const std::uint32_t* const at = buf.data();
  CHECK(buf.reserve(4 * MiB / 4) == growth::moved);
  CHECK(buf.data() != at);
  CHECK(buf.size() == 1 * MiB / 4);
  CHECK(mismatches_on(buf.data(), buf.size_bytes(), 8, s.get()) == 0);
  s.synchronize();
  CHECK(p.statistics().live_allocations == 2);  // the old memory went back
}

TEST_CASE("host_stream_buffer: host code writes after a synchronization, kernels read and write it") {
  pool hp(pool_properties{.location = memory_location::host_numa(0)});
  stream s(0);
  host_stream_buffer<std::uint32_t> buf(4096, s, host_device_resource(hp));
  // Host access before the host is ordered after the allocation is refused.
  CHECK_THROWS_AS((void)buf[0], ordering_error);
  (void)s.synchronize();
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = pattern(i, 11);
  CHECK(mismatches_on(buf.data(), buf.size_bytes(), 11, s.get()) == 0);
  increment_kernel<<<16, 256, 0, s.get()>>>(buf.data(), buf.size());
  (void)s.synchronize();
  std::size_t good = 0;
  std::size_t i = 0;
  for (std::uint32_t v : buf) good += v == pattern(i++, 11) + 1 ? 1 : 0;
  CHECK(good == buf.size());
  // Growth in place works for host pools too.
  const auto* at = buf.data();
  CHECK(buf.resize(64 * MiB / 4) == growth::in_place);
  CHECK(buf.data() == at);
}

TEST_CASE("bad input: empty buffers, absurd sizes, copies that do not fit") {
  stream s(0);
  // A moved-from buffer is empty and usable again.
  stream_buffer<int> moved_from(16, s);
  stream_buffer<int> taker = std::move(moved_from);
  CHECK(moved_from.data() == nullptr);  // NOLINT(bugprone-use-after-move): the point of the check
  CHECK(moved_from.size() == 0);
  CHECK(moved_from.resize(8) == growth::moved);
  CHECK(moved_from.data() != nullptr);
  CHECK(taker.size() == 16);
  stream_buffer<int> empty(0, s);
  CHECK(empty.data() == nullptr);
  CHECK(empty.empty());
  CHECK(empty.resize(10) == growth::moved);  // nothing to copy, but new memory
  CHECK(empty.data() != nullptr);
  CHECK_THROWS_AS(stream_buffer<int>(std::size_t{1} << 61, s), std::length_error);
  CHECK_THROWS_AS(stream_buffer<int>(std::size_t{1} << 50, s), out_of_memory);
  stream_buffer<int> small(4, s);
  std::vector<int> big(5);
  CHECK_THROWS_AS(small.copy_from(big), std::invalid_argument);
  CHECK_THROWS_AS(small.copy_to(big), std::invalid_argument);
  // A pool named directly must provide the buffer's access, checked when called.
  pool device_pool;
  CHECK_THROWS_AS(host_stream_buffer<int>(4, s, device_pool), std::invalid_argument);
  stream_buffer<int> from_pool(4, s, device_pool);
  CHECK(device_pool.owns(from_pool.data()));
  // A buffer that failed to grow is unchanged.
  pool limited(pool_properties{.max_size = 64 * MiB});
  stream_buffer<char> b(1 * MiB, s, device_resource(limited));
  const char* at = b.data();
  CHECK_THROWS_AS(b.reserve(128 * MiB), out_of_memory);
  CHECK(b.data() == at);
  CHECK(b.capacity() == 1 * MiB);
}

// Each compile-fail case (tests/compile_fail/) holds a misuse and its correct form; the correct
// forms compile there, and run here.
namespace {
struct point {
  float x, y;
};
}  // namespace

TEST_CASE("the correct forms of the compile-fail cases run") {
  pool device_pool;
  pool host_pool(pool_properties{.location = memory_location::host_numa(0)});
  stream a(0), b(0);
  pool_ref ref(device_pool);  // pool_copy
  CHECK(ref == pool_ref(device_pool));
  cudaEvent_t raw{};
  SA_CUDA_REQUIRE(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming));
  const event_ref er(raw);  // event_ref_from_int
  CHECK(er.get() == raw);
  cudaEventDestroy(raw);

  stream_buffer<point> points(10, a);  // stream_buffer_non_trivial, stream_buffer_without_stream
  CHECK(points.size() == 10);
  stream_buffer<int> buf(256, a, device_resource(device_pool));  // stream_buffer_foreign_resource
  std::vector<int> h(256);
  std::iota(h.begin(), h.end(), 0);
  buf.copy_from(h);
  stream_buffer<int> copy(buf.size(), buf.stream());  // stream_buffer_copy
  copy.copy_from(buf);
  buf.set_stream(b, order_after(b, buf.stream()));  // set_stream_without_proof
  copy.set_stream(b, a.synchronize());              // set_stream_proof_is_a_stream
  event e;                                          // copy_from_with_event
  stream_buffer<int> dst(256, a, device_resource(device_pool));
  e.record(copy.stream());
  dst.copy_from(copy, dst.stream().wait(e));
  std::vector<int> back(256);  // host_access_to_device_buffer, copy_to_wrong_element_type
  dst.copy_to(back);
  (void)dst.stream().synchronize();
  CHECK(back == h);
  std::move(buf).free_on(a, order_after(a, buf.stream()));  // free_on_without_proof

  host_stream_buffer<int> hb(16, a, host_device_resource(host_pool));  // host_buffer_from_*
  stream_buffer<int> db(16, a, host_device_resource(host_pool));        // device_buffer_from_host_only_resource
  (void)a.synchronize();
  hb[3] = 42;
  db.copy_from(hb);
  std::vector<int> h16(16);
  db.copy_to(h16);
  (void)a.synchronize();
  CHECK(h16[3] == 42);
  pmr_resource mr{host_resource{host_pool}};  // pmr_over_device_resource
  std::pmr::vector<int> v({1, 2, 3}, &mr);
  CHECK(v[2] == 3);
  const pool_resource<device_accessible> r(device_pool);  // resource_without_access
  void* q = r.pool().allocate(1, a);
  r.pool().deallocate(q, a);
}
