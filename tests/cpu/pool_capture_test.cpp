// The pool under stream capture against the fake driver's model of capture, graphs and user
// objects (tests/fake_driver): detection, the tie of a graph's memory to its user object, the
// release through streamalloc's reaper thread, and the relaxed mode of the pool's own calls
// while another thread captures in global mode. The GPU test (tests/gpu/graph_capture_test.cu)
// checks the same on real graphs and memory.

#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/detail/pool/graph_reaper.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>

using namespace streamalloc;
namespace cu = streamalloc::detail::cu;
using streamalloc_test::fake_graphs;
using streamalloc_test::fake_quiesce;
using streamalloc_test::handle;
using streamalloc_test::MiB;
using streamalloc_test::reaper_idle;

TEST_SUITE("pool_capture") {

TEST_CASE("an allocation under capture is the graph's until the graph and its executable are gone") {
  pool p;
  stream s;
  const auto before = fake_graphs();
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_GLOBAL);
  void* x = p.allocate(MiB, s.ref());
  void* y = p.allocate(MiB, s.ref());
  p.deallocate(x, s.ref());
  void* z = p.allocate(MiB, s.ref());  // reuses x inside the capture
  CHECK(z == x);
  p.deallocate(z, s.ref());
  CUgraph g = nullptr;
  cu::cuStreamEndCapture(handle(s), &g);
  CHECK(fake_graphs().user_objects == before.user_objects + 1);  // one tie per capture
  CUgraphExec e = nullptr;
  cu::cuGraphInstantiateWithFlags(&e, g, 0);
  CHECK(p.statistics().graphs == 1);
  CHECK(p.statistics().graph_allocations == 2);
  CHECK(p.statistics().live_allocations == 0);
  cu::cuGraphDestroy(g);
  fake_quiesce();
  CHECK(p.statistics().graphs == 1);  // the executable still holds it
  cu::cuGraphExecDestroy(e);
  REQUIRE(reaper_idle());
  CHECK(p.statistics().graphs == 0);
  // y was never freed: an ordinary live allocation now; x (and z) were freed in the graph.
  CHECK(p.statistics().live_allocations == 1);
  p.deallocate(y, s.ref());
  CHECK_THROWS_AS(p.deallocate(x, s.ref()), std::invalid_argument);
  CHECK(fake_graphs().destructor_thread_violations == 0);
}

TEST_CASE("a raw stream under capture is never looked up (CUDA refuses to identify it)") {
  pool p;
  CUstream raw = nullptr;
  cu::cuStreamCreateWithPriority(&raw, CU_STREAM_NON_BLOCKING, 0);
  cu::cuStreamBeginCapture(raw, CU_STREAM_CAPTURE_MODE_GLOBAL);
  const stream_ref s{reinterpret_cast<cudaStream_t>(raw)};
  void* x = p.allocate(MiB, s);
  p.deallocate(x, s);
  CHECK(p.allocate(MiB, s) == x);  // reused in the capture, on the same handle
  CHECK(p.grow_in_place(x, 2 * MiB, s) == 0);
  CHECK(p.shrink_in_place(x, 256, s) == MiB);
  CUgraph g = nullptr;
  CHECK(cu::cuStreamEndCapture_nothrow(raw, &g) == CUDA_SUCCESS);
  cu::cuGraphDestroy(g);
  REQUIRE(reaper_idle());
  CHECK(p.statistics().live_allocations == 1);  // x was left unfreed by the capture
  p.deallocate(x, s);                           // looked up now: the capture is over
  cu::cuStreamDestroy(raw);
}

TEST_CASE("a global-mode capture on another thread does not make the pool's own calls fail or break it") {
  pool p;
  stream s, mine;
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_GLOBAL);
  void* g = p.allocate(MiB, s.ref());
  const auto refusals = fake_graphs().unsafe_call_refusals;
  std::thread other([&] {
    // New memory (cuMemCreate, cuMemMap) and event queries: unsafe calls under a global capture.
    for (int i = 0; i < 3; ++i) {
      void* big = p.allocate(200 * MiB, mine.ref());
      p.deallocate(big, mine.ref());
      p.trim_to(0);
    }
  });
  other.join();
  CHECK(fake_graphs().unsafe_call_refusals == refusals);
  p.deallocate(g, s.ref());
  CUgraph graph = nullptr;
  CHECK(cu::cuStreamEndCapture_nothrow(handle(s), &graph) == CUDA_SUCCESS);  // not invalidated
  cu::cuGraphDestroy(graph);
  REQUIRE(reaper_idle());
  CHECK(p.statistics().graphs == 0);
}

TEST_CASE("a pool made, used and destroyed while another thread captures in global mode leaves that capture whole") {
  stream s;
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_GLOBAL);
  const auto refusals = fake_graphs().unsafe_call_refusals;
  std::string error;  // what the other thread met, if anything
  std::thread other([&error] {
    // Its properties' test allocation, its first reservation and chunk, and at its end the
    // unmapping and the addresses given back: calls a global-mode capture forbids.
    try {
      pool p;
      stream mine;
      void* x = p.allocate(MiB, mine.ref());
      p.deallocate(x, mine.ref());
      pool q;
      void* kept = q.allocate(MiB, mine.ref());  // closed with a live allocation: it synchronizes
      (void)kept;
      q.close();
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  other.join();
  CHECK(error == "");
  CHECK(fake_graphs().unsafe_call_refusals == refusals);
  CUgraph graph = nullptr;
  CHECK(cu::cuStreamEndCapture_nothrow(handle(s), &graph) == CUDA_SUCCESS);  // not invalidated
  if (graph != nullptr) cu::cuGraphDestroy(graph);
}

namespace {
/// The calling thread's capture mode, asked of the driver (two exchanges, leaving it as it was).
CUstreamCaptureMode capture_mode_now() {
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
  cu::cuThreadExchangeStreamCaptureMode(&mode);
  CUstreamCaptureMode back = mode;
  cu::cuThreadExchangeStreamCaptureMode(&back);
  return mode;
}
}  // namespace

TEST_CASE("capture-mode scopes: a deferred one relaxes at its first driver call, nested ones restore the mode once") {
  using streamalloc::detail::deferred_relaxed_capture_mode;
  using streamalloc::detail::relaxed_capture_mode;
  stream s;
  CUstreamCaptureMode mode = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;  // not the default: its return is seen
  cu::cuThreadExchangeStreamCaptureMode(&mode);
  {
    const deferred_relaxed_capture_mode deferred;
    CHECK(capture_mode_now() == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);  // no driver call yet
    CHECK(cu::cuStreamQuery_nothrow(handle(s)) == CUDA_SUCCESS);
    CHECK(capture_mode_now() == CU_STREAM_CAPTURE_MODE_RELAXED);
    {
      const relaxed_capture_mode eager;
      CHECK(capture_mode_now() == CU_STREAM_CAPTURE_MODE_RELAXED);
    }
    CHECK(capture_mode_now() == CU_STREAM_CAPTURE_MODE_RELAXED);  // the outer scope still lives
  }
  CHECK(capture_mode_now() == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  {
    const relaxed_capture_mode eager;
    CHECK(capture_mode_now() == CU_STREAM_CAPTURE_MODE_RELAXED);  // at once, before any call
    {
      const deferred_relaxed_capture_mode deferred;
      CHECK(cu::cuStreamQuery_nothrow(handle(s)) == CUDA_SUCCESS);
    }
    CHECK(capture_mode_now() == CU_STREAM_CAPTURE_MODE_RELAXED);
  }
  CHECK(capture_mode_now() == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  {
    const deferred_relaxed_capture_mode deferred;  // no driver call at all: no switch either
    const long long before = streamalloc_test::fake_mode_exchanges();
    { const deferred_relaxed_capture_mode inner; }
    CHECK(streamalloc_test::fake_mode_exchanges() == before);
  }
  cu::cuThreadExchangeStreamCaptureMode(&mode);  // back to global
  CHECK(mode == CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
}

TEST_CASE("the pool's slow path switches the capture mode only when it calls the driver") {
  pool p;
  stream s;
  long long before = streamalloc_test::fake_mode_exchanges();
  void* first = p.allocate(MiB, s.ref());  // the pool maps its first chunk: driver calls, relaxed
  CHECK(streamalloc_test::fake_mode_exchanges() - before == 2);  // relaxed once, restored once
  p.deallocate(first, s.ref());
  const std::size_t grows = p.statistics().grows;
  // Sizes the stream's cache has never held: each request takes the slow path, and finds its
  // memory in the pool's free blocks, so it calls the driver not at all.
  before = streamalloc_test::fake_mode_exchanges();
  for (std::size_t i = 1; i <= 64; ++i) {
    void* x = p.allocate(i * 4096 + 256, s.ref());
    REQUIRE(x != nullptr);
    p.deallocate(x, s.ref());
  }
  CHECK(streamalloc_test::fake_mode_exchanges() == before);
  CHECK(p.statistics().grows == grows);
  CHECK(p.statistics().live_allocations == 0);
}

TEST_CASE("the legacy stream while a blocking stream captures: refused, naming it, and the capture goes on") {
  pool p;
  stream blocking(0, stream_flags::blocking);
  cu::cuStreamBeginCapture(handle(blocking), CU_STREAM_CAPTURE_MODE_GLOBAL);
  // Its work would join the capture implicitly: the driver will not even say whether it is
  // captured (cuStreamIsCapturing fails), and the pool hands out nothing.
  CHECK_THROWS_WITH_AS((void)p.allocate(MiB, stream_ref::legacy_default()),
                       doctest::Contains("legacy default stream was used"), cuda_error);
  CHECK(p.statistics().live_allocations == 0);
  CUgraph g = nullptr;
  CHECK(cu::cuStreamEndCapture_nothrow(handle(blocking), &g) == CUDA_SUCCESS);  // the queries broke nothing
  if (g != nullptr) cu::cuGraphDestroy(g);
  void* x = p.allocate(MiB, stream_ref::legacy_default());  // and once it is over, it is served
  p.deallocate(x, stream_ref::legacy_default());
}

namespace {
void begin_relaxed_capture(void* stream) {
  // Not the throwing call: on code that invalidated the capture first, beginning it again
  // would throw inside the driver call the pool is making.
  (void)cu::cuStreamBeginCapture_nothrow(static_cast<CUstream>(stream), CU_STREAM_CAPTURE_MODE_RELAXED);
}
}  // namespace

TEST_CASE("a capture begun on a stream while the pool records its event there: the event covers nothing") {
  // One chunk, never released, and no room to grow: x's memory is the only memory there is, so
  // a request on b must wait on a's free (an internal dependency: an event on a, waited for).
  pool p(pool_properties{.max_size = 2 * MiB, .release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  stream a, b;
  void* x = p.allocate(2 * MiB, a.ref());
  streamalloc_test::fake_hold_stream(handle(a), true);  // a's work has not run: its free waits
  p.deallocate(x, a.ref());
  // Another thread begins capturing a just as the pool records the event that would cover x's
  // free (between the pool's question and its cuEventRecord): the record goes into the capture.
  streamalloc_test::fake_before_next_event_record(&begin_relaxed_capture, handle(a));
  const auto captured_before = fake_graphs().captured_event_records;
  // The event is lost to the capture: b is not made to wait on it (and so join the capture and
  // be taken to run after a's free); with nothing else to serve it, the request fails.
  CHECK_THROWS_AS((void)p.allocate(2 * MiB, b.ref()), out_of_memory);
  CHECK(fake_graphs().captured_event_records == captured_before + 1);  // the race did happen
  CHECK(b.ref().record().ordered_after(a.ref().record().id()) == 0);
  CUgraph g = nullptr;
  CHECK(cu::cuStreamEndCapture_nothrow(handle(a), &g) == CUDA_SUCCESS);  // b never joined it
  if (g != nullptr) cu::cuGraphDestroy(g);
  // Once the capture is over, a's free is covered by a new event, and b waits on it.
  void* y = p.allocate(2 * MiB, b.ref());
  CHECK(y == x);
  CHECK(b.ref().record().ordered_after(a.ref().record().id()) > 0);
  streamalloc_test::fake_hold_stream(handle(a), false);
  p.deallocate(y, b.ref());
  b.synchronize();
  CHECK(p.statistics().live_allocations == 0);
}

namespace {
bool stream_queried = false;
void note_stream_query(void*) { stream_queried = true; }
}  // namespace

TEST_CASE("another thread's stream is never asked whether it is idle: a capture begun on it then stays whole") {
  // cuStreamQuery invalidates a capture of the stream it asks about, in every capture mode: the
  // pool must not ask it of a `stream` that is not the one its call was given, since its owner
  // may begin capturing it between the pool's question "is it capturing?" and the query.
  pool p(pool_properties{.max_size = 4 * MiB, .release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  stream a, b;
  void* x = p.allocate(2 * MiB, a.ref());
  p.deallocate(x, a.ref());
  // Whichever call the pool makes on a during b's request, a capture of a begins right then.
  streamalloc_test::fake_before_next_stream_query(&begin_relaxed_capture, handle(a));
  streamalloc_test::fake_before_next_event_record(&begin_relaxed_capture, handle(a));
  void* y = p.allocate(2 * MiB, b.ref());
  streamalloc_test::fake_before_next_stream_query(nullptr, nullptr);
  streamalloc_test::fake_before_next_event_record(nullptr, nullptr);
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  REQUIRE(cu::cuStreamIsCapturing_nothrow(handle(a), &status) == CUDA_SUCCESS);
  CHECK(status == CU_STREAM_CAPTURE_STATUS_ACTIVE);  // the race did happen, and left it whole
  CHECK(y != x);  // a's free is not known to have run: b gets new memory
  CUgraph g = nullptr;
  CHECK(cu::cuStreamEndCapture_nothrow(handle(a), &g) == CUDA_SUCCESS);  // not invalidated
  if (g != nullptr) cu::cuGraphDestroy(g);
  a.synchronize();  // now it is
  void* z = p.allocate(2 * MiB, b.ref());
  CHECK(z == x);
  p.deallocate(y, b.ref());
  p.deallocate(z, b.ref());
  b.synchronize();
  CHECK(p.statistics().live_allocations == 0);
}

namespace {
// Inside the pool's second cuEventQuery from now: lets stream `arg` run, so the event the pool
// recorded on it completes while the pool polls it (the first query finds it not done).
int event_queries_seen = 0;
void release_on_second_query(void* s) {
  if (++event_queries_seen < 2) {
    streamalloc_test::fake_before_next_event_wait(&release_on_second_query, s);
    return;
  }
  streamalloc_test::fake_hold_stream(static_cast<CUstream>(s), false);
}
}  // namespace

TEST_CASE("another stream's frees, covered by an event instead of a query: a request polls it before growing") {
  pool p(pool_properties{.max_size = 4 * MiB, .release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  stream a, b;
  void* x = p.allocate(2 * MiB, a.ref());
  streamalloc_test::fake_hold_stream(handle(a), true);  // a's free has not run yet
  p.deallocate(x, a.ref());
  const auto grows = p.statistics().grows;
  stream_queried = false;
  streamalloc_test::fake_before_next_stream_query(&note_stream_query, nullptr);
  event_queries_seen = 0;
  streamalloc_test::fake_before_next_event_wait(&release_on_second_query, handle(a));
  // b's look records an event on a (not asking whether a is idle); a runs while b's request
  // polls that event, before it would grow the pool: b gets x.
  void* y = p.allocate(2 * MiB, b.ref());
  streamalloc_test::fake_before_next_stream_query(nullptr, nullptr);
  CHECK_FALSE(stream_queried);
  CHECK(event_queries_seen >= 2);
  CHECK(y == x);
  CHECK(p.statistics().grows == grows);
  p.deallocate(y, b.ref());
  b.synchronize();
  CHECK(p.statistics().live_allocations == 0);
}

TEST_CASE("trim_to polls the event it records on another thread's stream, and releases what completes") {
  pool p(pool_properties{.release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  stream a;
  void* x = p.allocate(2 * MiB, a.ref());
  streamalloc_test::fake_hold_stream(handle(a), true);  // a's free has not run yet
  p.deallocate(x, a.ref());
  CHECK(p.statistics().reserved_current == 2 * MiB);
  stream_queried = false;
  streamalloc_test::fake_before_next_stream_query(&note_stream_query, nullptr);
  event_queries_seen = 0;
  streamalloc_test::fake_before_next_event_wait(&release_on_second_query, handle(a));
  // The host's trim is no call on a: a is covered by an event, which a passes while the trim
  // polls it; x's chunk is then free, known complete, and goes back.
  p.trim_to(0);
  streamalloc_test::fake_before_next_stream_query(nullptr, nullptr);
  CHECK_FALSE(stream_queried);
  CHECK(event_queries_seen >= 2);
  CHECK(p.statistics().reserved_current == 0);
}

TEST_CASE("grow_in_place polls the event it records on the stream that freed the memory after the buffer") {
  pool p(pool_properties{.max_size = 4 * MiB, .release_threshold = SIZE_MAX, .chunk_size = 4 * MiB});
  stream a, b;
  void* y = p.allocate(MiB, b.ref());
  void* x = p.allocate(MiB, a.ref());
  REQUIRE(x == static_cast<char*>(y) + MiB);  // x lies right after y
  streamalloc_test::fake_hold_stream(handle(a), true);  // a's free has not run yet
  p.deallocate(x, a.ref());
  stream_queried = false;
  streamalloc_test::fake_before_next_stream_query(&note_stream_query, nullptr);
  event_queries_seen = 0;
  streamalloc_test::fake_before_next_event_wait(&release_on_second_query, handle(a));
  // y grows over x only once a's free is known to have run: learned from the event the call
  // records on a and polls, not from asking a whether it is idle.
  CHECK(p.grow_in_place(y, 3 * MiB, b.ref()) >= 3 * MiB);
  streamalloc_test::fake_before_next_stream_query(nullptr, nullptr);
  CHECK_FALSE(stream_queried);
  CHECK(event_queries_seen >= 2);
  p.deallocate(y, b.ref());
  b.synchronize();
  CHECK(p.statistics().live_allocations == 0);
}

TEST_CASE("an invalidated capture and a closed pool") {
  stream s;
  {
    pool p;
    cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_GLOBAL);
    void* x = p.allocate(MiB, s.ref());
    (void)x;
    CHECK(cu::cuStreamSynchronize_nothrow(handle(s)) != CUDA_SUCCESS);  // invalidates the capture
    CHECK_THROWS_WITH_AS((void)p.allocate(MiB, s.ref()), doctest::Contains("invalidated"), cuda_error);
    CUgraph broken = nullptr;
    CHECK(cu::cuStreamEndCapture_nothrow(handle(s), &broken) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    REQUIRE(reaper_idle());  // the failed capture's graph is gone: so is its hold
    CHECK(p.statistics().graphs == 0);
  }
  // A pool closed while its graph lives: the graph's memory stays mapped until it goes.
  const auto mapped_before = streamalloc_test::fake_live().mappings;
  CUgraph g = nullptr;
  {
    pool p;
    cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_GLOBAL);
    void* x = p.allocate(MiB, s.ref());
    p.deallocate(x, s.ref());
    cu::cuStreamEndCapture(handle(s), &g);
  }
  CHECK(streamalloc_test::fake_live().mappings > mapped_before);
  CHECK(detail::graph_reaper::instance().outstanding() == 1);
  cu::cuGraphDestroy(g);
  REQUIRE(reaper_idle());
  CHECK(streamalloc_test::fake_live().mappings == mapped_before);
}

}  // TEST_SUITE
