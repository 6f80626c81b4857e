// Captures that never make a graph: the capturing stream destroyed in the middle of its capture,
// and captures invalidated by an illegal call and ended with an error. What the pool lent and
// took back in such a capture must come back once the driver lets go of the capture's graph,
// never earlier than the work before the capture allows, and no later pool call may fail for it.
// Against the fake driver's model (tests/fake_driver/fake_capture.cpp, fake_streams.cpp), which
// does as the driver does (H200, 580.159.04, measured 2026-11-29): destroying the stream that
// began a capture ends the capture and destroys its graph (its user objects' destructors run);
// a stream that joined a capture leaves it, and the capture's end then gives no graph. Ending
// an invalidated capture destroys its graph and the graph's user-object references.

#include <streamalloc/captured_graph.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/detail/pool/graph_reaper.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

using namespace streamalloc;
namespace cu = streamalloc::detail::cu;
using streamalloc_test::fake_graphs;
using streamalloc_test::fake_live;
using streamalloc_test::handle;
using streamalloc_test::MiB;
using streamalloc_test::reaper_idle;

namespace {

CUstreamCaptureStatus capture_status_of(CUstream s) {
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  REQUIRE(cu::cuStreamIsCapturing_nothrow(s, &status) == CUDA_SUCCESS);
  return status;
}

/// The CUresult of the cuda_error `f` throws; CUDA_SUCCESS if it throws none.
template <class F>
CUresult cuda_error_of(F f) {
  try {
    f();
  } catch (const cuda_error& e) {
    return e.code();
  }
  return CUDA_SUCCESS;
}

/// Do [a, a + n) and [b, b + m) overlap?
bool overlap(const void* a, std::size_t n, const void* b, std::size_t m) {
  const auto x = reinterpret_cast<std::uintptr_t>(a);
  const auto y = reinterpret_cast<std::uintptr_t>(b);
  return x < y + m && y < x + n;
}

}  // namespace

TEST_SUITE("capture_destroyed") {

TEST_CASE("a raw stream destroyed while captured: its graph's memory comes back, outside memory only once the device idles") {
  // Two chunks and no more: one for the memory allocated before the capture, one for the
  // graph's own. What is free afterwards can then be counted.
  pool p(pool_properties{.max_size = 4 * MiB, .release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  CUstream raw = nullptr;
  cu::cuStreamCreateWithPriority(&raw, CU_STREAM_NON_BLOCKING, 0);
  const stream_ref s{reinterpret_cast<cudaStream_t>(raw)};
  stream other;
  void* before = p.allocate(MiB, s);
  // Work enqueued on the stream before the capture, using `before`, has not run yet.
  streamalloc_test::fake_hold_stream(raw, true);
  const int streams = fake_live().streams;
  cu::cuStreamBeginCapture(raw, CU_STREAM_CAPTURE_MODE_GLOBAL);
  void* kept = p.allocate(MiB, s);  // left live by the capture
  void* temp = p.allocate(MiB, s);  // freed in it
  p.deallocate(temp, s);
  p.deallocate(before, s);  // allocated outside, freed inside: the graph's now
  CHECK(p.statistics().graphs == 1);
  CHECK(p.statistics().live_allocations == 0);

  // Destroyed in the middle of its capture: the capture ends and its graph is destroyed,
  // releasing its user objects.
  CHECK(cu::cuStreamDestroy_nothrow(raw) == CUDA_SUCCESS);
  CHECK(fake_live().streams == streams - 1);
  CHECK(fake_graphs().active_captures == 0);
  REQUIRE(reaper_idle());
  const pool_statistics after = p.statistics();
  CHECK(after.graphs == 0);
  CHECK(after.graph_allocations == 0);
  CHECK(after.graph_reserved_current == 0);
  // The allocation the capture left live is an ordinary live allocation now: it may be freed.
  CHECK(after.live_allocations == 1);
  CHECK(after.used_current == MiB);
  CHECK(after.reserved_current == 4 * MiB);

  // `before` may still be used by the stream's work from before the capture: not lent to
  // another stream until a device-wide synchronization proves that work done (CUDA cannot
  // identify a capturing raw stream, so the pool has no stream order to wait in). The rest of
  // the 4 MiB is free: 2 MiB, in two pieces of 1 MiB.
  void* a = p.allocate(MiB, other.ref());
  void* b = p.allocate(MiB, other.ref());
  for (void* q : {a, b}) CHECK_FALSE(overlap(q, MiB, before, MiB));
  CHECK_THROWS_AS((void)p.allocate(MiB, other.ref()), out_of_memory);
  p.synchronize();  // the device is idle: the stream's work has run
  void* c = p.allocate(MiB, other.ref());
  CHECK(c == before);

  // Nothing is left over: the live allocation frees as any other, and the pool's counts
  // return to zero.
  p.deallocate(kept, other.ref());
  for (void* q : {a, b, c}) p.deallocate(q, other.ref());
  other.synchronize();
  const pool_statistics end = p.statistics();
  CHECK(end.live_allocations == 0);
  CHECK(end.used_current == 0);
  CHECK(end.free_pending == 0);
  CHECK(end.free_clear == 4 * MiB);
}

TEST_CASE("a capture invalidated by an illegal call: its frees of outside memory wait in the stream's order") {
  // No internal dependencies: memory pending on s is lent to another stream only once s's
  // frees are known to have run, not by making that stream wait (next test).
  pool p(pool_properties{.max_size = 4 * MiB,
                         .release_threshold = SIZE_MAX,
                         .reuse = {.internal_dependencies = false},
                         .chunk_size = 2 * MiB});
  stream s, other;
  void* before = p.allocate(MiB, s.ref());
  streamalloc_test::fake_hold_stream(handle(s), true);  // its work from before the capture has not run
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_RELAXED);
  void* kept = p.allocate(MiB, s.ref());
  p.deallocate(before, s.ref());  // a `stream` carries its record: adopted in its order
  CHECK(cu::cuStreamQuery_nothrow(handle(s)) != CUDA_SUCCESS);  // illegal in a capture: invalidates it
  CHECK(capture_status_of(handle(s)) == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
  // The pool says so, by type and code, until the capture is ended, and changes nothing.
  CHECK(cuda_error_of([&] { (void)p.allocate(MiB, s.ref()); }) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  CHECK(cuda_error_of([&] { p.deallocate(kept, s.ref()); }) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  CHECK(p.statistics().graphs == 1);
  CHECK(p.statistics().graph_allocations == 2);  // kept, and `before` adopted
  CUgraph g = nullptr;
  CHECK(cu::cuStreamEndCapture_nothrow(handle(s), &g) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  CHECK(g == nullptr);
  REQUIRE(reaper_idle());
  CHECK(p.statistics().graphs == 0);
  CHECK(p.statistics().graph_reserved_current == 0);
  CHECK(p.statistics().live_allocations == 1);  // kept

  // `before` is freed in s's order: pending there, not lent to another stream while s's work
  // from before the capture has not run. Free and lendable now: the graph's spare 1 MiB.
  void* a = p.allocate(MiB, other.ref());
  CHECK_FALSE(overlap(a, MiB, before, MiB));
  CHECK_THROWS_AS((void)p.allocate(MiB, other.ref()), out_of_memory);
  s.synchronize();  // now it has: s's frees are known complete
  void* b = p.allocate(MiB, other.ref());
  void* c = p.allocate(MiB, other.ref());
  CHECK((b == before || c == before));
  for (void* q : {kept, a, b, c}) p.deallocate(q, other.ref());
  other.synchronize();
  CHECK(p.statistics().live_allocations == 0);
  CHECK(p.statistics().used_current == 0);
  CHECK(p.statistics().free_clear == 4 * MiB);
}

TEST_CASE("after an invalidated capture, a stream lent memory it freed there is made to wait for the stream") {
  // Internal dependencies on (the default): out of room, the request on `other` may take the
  // memory s freed in its failed capture, but only by waiting for s's work.
  pool p(pool_properties{.max_size = 4 * MiB, .release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  stream s, other;
  void* before = p.allocate(MiB, s.ref());
  streamalloc_test::fake_hold_stream(handle(s), true);
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_RELAXED);
  void* kept = p.allocate(MiB, s.ref());
  p.deallocate(before, s.ref());
  CHECK(cu::cuStreamQuery_nothrow(handle(s)) != CUDA_SUCCESS);  // invalidates the capture
  CUgraph g = nullptr;
  CHECK(cu::cuStreamEndCapture_nothrow(handle(s), &g) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  REQUIRE(reaper_idle());
  CHECK(other.ref().record().ordered_after(s.ref().record().id()) == 0);
  void* a = p.allocate(MiB, other.ref());
  void* b = p.allocate(MiB, other.ref());
  const bool lent = overlap(a, MiB, before, MiB) || overlap(b, MiB, before, MiB);
  CHECK(lent);
  CHECK(other.ref().record().ordered_after(s.ref().record().id()) > 0);  // ... after s's work
  streamalloc_test::fake_hold_stream(handle(s), false);
  for (void* q : {kept, a, b}) p.deallocate(q, other.ref());
  other.synchronize();
  CHECK(p.statistics().live_allocations == 0);
  CHECK(p.statistics().used_current == 0);
}

TEST_CASE("a streamalloc::stream destroyed while captured: nothing lent early, everything back after the device idles") {
  static_assert(std::is_nothrow_destructible_v<stream>);
  const int streams = fake_live().streams;
  pool p(pool_properties{.max_size = 6 * MiB,
                         .release_threshold = SIZE_MAX,
                         .reuse = {.internal_dependencies = false},
                         .chunk_size = 2 * MiB});
  std::optional<stream> s(std::in_place);
  const CUstream h = handle(*s);
  stream other;
  void* before = p.allocate(MiB, s->ref());
  void* early = p.allocate(MiB, s->ref());
  streamalloc_test::fake_hold_stream(h, true);  // s's work from here on has not run
  p.deallocate(early, s->ref());                // pending on s
  cu::cuStreamBeginCapture(h, CU_STREAM_CAPTURE_MODE_GLOBAL);
  void* kept = p.allocate(MiB, s->ref());  // left live by the capture
  void* temp = p.allocate(MiB, s->ref());  // freed in it
  p.deallocate(temp, s->ref());
  p.deallocate(before, s->ref());  // allocated outside, freed inside: adopted in s's order
  const auto captured_records = fake_graphs().captured_event_records;
  s.reset();  // the owner goes in the middle of the capture
  // Its last look at the stream (the pool retiring it) recorded nothing into the capture.
  CHECK(fake_graphs().captured_event_records == captured_records);
  // The stream is gone, and with it the capture and its graph, releasing its user objects.
  CHECK(fake_live().streams == streams + 1);  // `other`
  REQUIRE(reaper_idle());
  CHECK(fake_graphs().active_captures == 0);
  const pool_statistics after = p.statistics();
  CHECK(after.graphs == 0);
  CHECK(after.graph_allocations == 0);
  CHECK(after.graph_reserved_current == 0);
  CHECK(after.live_allocations == 1);  // kept: an ordinary live allocation now
  CHECK(after.used_current == MiB);

  // `before` and `early` may still be used by s's work from before the capture, and no event
  // on s covers them (s was capturing when it went): another stream gets neither until a
  // device-wide synchronization.
  std::vector<void*> lent;
  const auto lend_all = [&] {
    for (int i = 0; i < 6; ++i) {
      try {
        lent.push_back(p.allocate(MiB, other.ref()));
      } catch (const out_of_memory&) {
        return;
      }
    }
  };
  lend_all();
  CHECK(lent.size() == 3);  // 6 MiB, less kept, before and early
  for (void* q : lent) {
    CHECK_FALSE(overlap(q, MiB, before, MiB));
    CHECK_FALSE(overlap(q, MiB, early, MiB));
  }
  p.synchronize();  // the device is idle: s's work has run
  lend_all();
  CHECK(lent.size() == 5);
  CHECK(std::find(lent.begin(), lent.end(), before) != lent.end());
  CHECK(std::find(lent.begin(), lent.end(), early) != lent.end());
  p.deallocate(kept, other.ref());
  for (void* q : lent) p.deallocate(q, other.ref());
  other.synchronize();
  const pool_statistics end = p.statistics();
  CHECK(end.live_allocations == 0);
  CHECK(end.used_current == 0);
  CHECK(end.free_pending == 0);
  CHECK(end.free_clear == 6 * MiB);
}

// end_capture asked the capture's id first, which refuses an invalidated capture, so it threw
// before ending it: the capture stayed open, every pool call on the stream kept throwing "end
// the capture", and the graph's memory stayed held until a raw cudaStreamEndCapture.
TEST_CASE("end_capture on an invalidated capture ends it, reports the error, and gives the memory back") {
  pool p;
  stream s;
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_RELAXED);
  void* kept = p.allocate(MiB, s.ref());
  CHECK(cu::cuStreamQuery_nothrow(handle(s)) != CUDA_SUCCESS);  // invalidates the capture
  CHECK(cuda_error_of([&] { (void)end_capture(s.ref()); }) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  // Ended, as captured_graph.hpp documents: the stream is usable again, and the capture's
  // graph is gone with its hold.
  REQUIRE(capture_status_of(handle(s)) == CU_STREAM_CAPTURE_STATUS_NONE);
  REQUIRE(reaper_idle());
  CHECK(p.statistics().graphs == 0);
  CHECK(p.statistics().graph_reserved_current == 0);
  CHECK(p.statistics().live_allocations == 1);  // kept, live since the graph went
  p.deallocate(kept, s.ref());
  s.synchronize();
  CHECK(p.statistics().live_allocations == 0);
  CHECK(p.statistics().used_current == 0);
}

// The driver ends such a capture without a graph and without an error; end_capture says so
// rather than hand back an empty graph.
TEST_CASE("end_capture after a stream that joined the capture was destroyed: no graph, an error naming it, the memory back") {
  pool p;
  stream s;
  std::optional<stream> joined(std::in_place);
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_RELAXED);
  event fork;
  fork.record(s);
  (void)joined->wait(fork);  // joins the capture
  REQUIRE(capture_status_of(handle(*joined)) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
  void* kept = p.allocate(MiB, s.ref());  // left live by the capture
  void* temp = p.allocate(MiB, joined->ref());
  p.deallocate(temp, joined->ref());
  CHECK(p.statistics().graphs == 1);
  joined.reset();  // leaves the capture, which goes on
  CHECK(capture_status_of(handle(s)) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
  CHECK(cuda_error_of([&] { (void)end_capture(s.ref()); }) == CUDA_ERROR_STREAM_CAPTURE_UNJOINED);
  CHECK(capture_status_of(handle(s)) == CU_STREAM_CAPTURE_STATUS_NONE);
  REQUIRE(reaper_idle());
  CHECK(p.statistics().graphs == 0);
  CHECK(p.statistics().graph_allocations == 0);
  CHECK(p.statistics().graph_reserved_current == 0);
  CHECK(p.statistics().live_allocations == 1);  // kept, live since the graph went
  p.deallocate(kept, s.ref());
  s.synchronize();
  CHECK(p.statistics().live_allocations == 0);
  CHECK(p.statistics().used_current == 0);
}

}  // TEST_SUITE
