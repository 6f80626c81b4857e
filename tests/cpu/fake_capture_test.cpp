// The fake driver's model of stream capture, graphs and user objects (tests/fake_driver/): the
// CPU tests of streamalloc's graph support are only as good as this model, so it is checked here
// against the rules of the real driver: capture ids and statuses, fork and join through events,
// the errors that invalidate a capture, the capture-interaction modes, and the reference counts
// that decide when a user object's destructor runs, and on which thread.

#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <set>
#include <thread>
#include <utility>
#include <vector>

namespace cu = streamalloc::detail::cu;
using streamalloc_test::fake_exec_flags;
using streamalloc_test::fake_graphs;
using streamalloc_test::fake_quiesce;
using streamalloc_test::fake_user_object_refs;

namespace {

constexpr auto global = CU_STREAM_CAPTURE_MODE_GLOBAL;
constexpr auto thread_local_mode = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
constexpr auto relaxed = CU_STREAM_CAPTURE_MODE_RELAXED;
const CUstream legacy = nullptr;

void use_device_0() { streamalloc::detail::ensure_context(0); }

CUstream new_stream(unsigned flags = CU_STREAM_DEFAULT) {
  use_device_0();
  CUstream s = nullptr;
  cu::cuStreamCreateWithPriority(&s, flags, 0);
  return s;
}

CUevent new_event() {
  use_device_0();
  CUevent e = nullptr;
  cu::cuEventCreate(&e, CU_EVENT_DISABLE_TIMING);
  return e;
}

struct capture_info {
  CUresult result;
  CUstreamCaptureStatus status;
  cuuint64_t id;
  CUgraph graph;
};

capture_info info_of(CUstream s) {
  capture_info i{CUDA_SUCCESS, CU_STREAM_CAPTURE_STATUS_NONE, 0, nullptr};
  const CUgraphNode* dependencies = nullptr;
  std::size_t dependency_count = 99;
  i.result = cu::cuStreamGetCaptureInfo_nothrow(s, &i.status, &i.id, &i.graph, &dependencies,
                                                static_cast<const CUgraphEdgeData**>(nullptr), &dependency_count);
  if (i.result == CUDA_SUCCESS && i.status == CU_STREAM_CAPTURE_STATUS_ACTIVE) CHECK(dependency_count == 0);
  return i;
}

CUstreamCaptureStatus status_of(CUstream s) {
  const capture_info i = info_of(s);
  REQUIRE(i.result == CUDA_SUCCESS);
  return i.status;
}

CUresult begin(CUstream s, CUstreamCaptureMode mode) { return cu::cuStreamBeginCapture_nothrow(s, mode); }

// Ends the capture on `s`, expecting it valid; returns its graph.
CUgraph end(CUstream s) {
  CUgraph g = nullptr;
  REQUIRE(cu::cuStreamEndCapture_nothrow(s, &g) == CUDA_SUCCESS);
  REQUIRE(g != nullptr);
  return g;
}

// Ends the capture on `s`, expecting it invalidated: no graph comes back.
void end_invalidated(CUstream s) {
  CUgraph g = reinterpret_cast<CUgraph>(0x1);
  CHECK(cu::cuStreamEndCapture_nothrow(s, &g) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
  CHECK(g == nullptr);
  CHECK(status_of(s) == CU_STREAM_CAPTURE_STATUS_NONE);
}

using get_proc_address = CUresult (*)(const char*, void**, int, cuuint64_t, CUdriverProcAddressQueryResult*);

get_proc_address fake_get_proc_address() {
  void* sym = ::dlsym(streamalloc_test::fake_library(), "cuGetProcAddress_v2");
  REQUIRE(sym != nullptr);
  return reinterpret_cast<get_proc_address>(sym);
}

// cuStreamIsCapturing straight from the fake, past streamalloc's entry points (and their
// capture-mode scopes).
CUresult is_capturing(CUstream s, CUstreamCaptureStatus* status) {
  void* fn = nullptr;
  CUdriverProcAddressQueryResult found{};
  REQUIRE(fake_get_proc_address()("cuStreamIsCapturing", &fn, 13000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found) ==
          CUDA_SUCCESS);
  return reinterpret_cast<CUresult (*)(CUstream, CUstreamCaptureStatus*)>(fn)(s, status);
}

// Sets the calling thread's capture-interaction mode; returns the one before.
CUstreamCaptureMode exchange_mode(CUstreamCaptureMode mode) {
  REQUIRE(cu::cuThreadExchangeStreamCaptureMode_nothrow(&mode) == CUDA_SUCCESS);
  return mode;
}

// Runs `f` on a new thread that has device 0's context, and waits for it.
template <class F>
void on_another_thread(F f) {
  std::thread t([&] {
    use_device_0();
    f();
  });
  t.join();
}

// What a user object's destructor saw. Written on the driver thread, read after fake_quiesce(),
// which orders the two.
struct destructor_record {
  std::atomic<int> runs{0};
  std::thread::id ran_on;
  CUresult driver_call = CUDA_SUCCESS;
};

void record_destruction(void* p) {
  auto* r = static_cast<destructor_record*>(p);
  r->ran_on = std::this_thread::get_id();
  ++r->runs;
}

// A destructor breaking the rule that user-object destructors may not call CUDA.
void call_driver_from_destructor(void* p) {
  auto* r = static_cast<destructor_record*>(p);
  r->driver_call = cu::cuStreamQuery_nothrow(legacy);
  ++r->runs;
}

CUuserObject new_user_object(destructor_record& r, unsigned refs = 1, CUhostFn destroy = &record_destruction) {
  CUuserObject obj = nullptr;
  REQUIRE(cu::cuUserObjectCreate_nothrow(&obj, static_cast<void*>(&r), destroy, refs,
                                         static_cast<unsigned>(CU_USER_OBJECT_NO_DESTRUCTOR_SYNC)) == CUDA_SUCCESS);
  return obj;
}

}  // namespace

TEST_SUITE("fake_capture") {
  TEST_CASE("a capture has a process-unique id and a graph of its own, and ends on its stream") {
    CUstream a = new_stream(), b = new_stream();
    const auto before = fake_graphs();
    CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_NONE);

    REQUIRE(begin(a, global) == CUDA_SUCCESS);
    const capture_info ia = info_of(a);
    CHECK(ia.status == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CHECK(ia.id != 0);
    CHECK(ia.graph != nullptr);
    CHECK(begin(a, global) == CUDA_ERROR_ILLEGAL_STATE);
    CHECK(begin(legacy, global) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    CHECK(begin(b, static_cast<CUstreamCaptureMode>(7)) == CUDA_ERROR_INVALID_VALUE);

    REQUIRE(begin(b, relaxed) == CUDA_SUCCESS);
    const capture_info ib = info_of(b);
    CHECK(ib.id != ia.id);
    CHECK(ib.graph != ia.graph);
    CHECK(fake_graphs().active_captures == before.active_captures + 2);
    CHECK(fake_graphs().graphs == before.graphs + 2);

    CHECK(end(b) == ib.graph);
    CHECK(status_of(b) == CU_STREAM_CAPTURE_STATUS_NONE);
    CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CUgraph none = nullptr;
    CHECK(cu::cuStreamEndCapture_nothrow(b, &none) == CUDA_ERROR_ILLEGAL_STATE);
    CHECK(cu::cuStreamEndCapture_nothrow(legacy, &none) == CUDA_ERROR_ILLEGAL_STATE);
    CHECK(end(a) == ia.graph);
    CHECK(fake_graphs().active_captures == before.active_captures);
    CHECK(fake_graphs().graphs == before.graphs + 2);  // the graphs are the caller's now

    REQUIRE(begin(a, global) == CUDA_SUCCESS);
    const capture_info again = info_of(a);
    CHECK(again.id != ia.id);
    CHECK(again.id != ib.id);
    CHECK(again.graph != ia.graph);
    cu::cuGraphDestroy(end(a));

    cu::cuGraphDestroy(ia.graph);
    cu::cuGraphDestroy(ib.graph);
    CHECK(cu::cuGraphDestroy_nothrow(ib.graph) == CUDA_ERROR_INVALID_VALUE);
    CHECK(fake_graphs().graphs == before.graphs);
    cu::cuStreamDestroy(a);
    cu::cuStreamDestroy(b);
  }

  TEST_CASE("the status is required, and edge data only with dependencies") {
    CUstream a = new_stream();
    cuuint64_t id = 0;
    CHECK(cu::cuStreamGetCaptureInfo_nothrow(a, static_cast<CUstreamCaptureStatus*>(nullptr), &id,
                                             static_cast<CUgraph*>(nullptr), static_cast<const CUgraphNode**>(nullptr),
                                             static_cast<const CUgraphEdgeData**>(nullptr),
                                             static_cast<std::size_t*>(nullptr)) == CUDA_ERROR_INVALID_VALUE);
    CUstreamCaptureStatus st{};
    const CUgraphEdgeData* edges = nullptr;
    CHECK(cu::cuStreamGetCaptureInfo_nothrow(a, &st, &id, static_cast<CUgraph*>(nullptr),
                                             static_cast<const CUgraphNode**>(nullptr), &edges,
                                             static_cast<std::size_t*>(nullptr)) == CUDA_ERROR_INVALID_VALUE);
    cu::cuStreamDestroy(a);
  }

  TEST_CASE("the per-thread default stream is a stream of each thread") {
    use_device_0();
    REQUIRE(begin(CU_STREAM_PER_THREAD, global) == CUDA_SUCCESS);
    CHECK(status_of(CU_STREAM_PER_THREAD) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CUstreamCaptureStatus theirs = CU_STREAM_CAPTURE_STATUS_ACTIVE;
    on_another_thread([&] { theirs = status_of(CU_STREAM_PER_THREAD); });
    CHECK(theirs == CU_STREAM_CAPTURE_STATUS_NONE);
    cu::cuGraphDestroy(end(CU_STREAM_PER_THREAD));
  }

  TEST_CASE("the legacy stream cannot be used while a blocking stream of its context captures") {
    CUstream blocking = new_stream(), non_blocking = new_stream(CU_STREAM_NON_BLOCKING);

    REQUIRE(begin(non_blocking, relaxed) == CUDA_SUCCESS);
    CHECK(status_of(legacy) == CU_STREAM_CAPTURE_STATUS_NONE);  // no implicit dependency on it
    cu::cuGraphDestroy(end(non_blocking));

    REQUIRE(begin(blocking, relaxed) == CUDA_SUCCESS);
    // Asking is refused but harmless: the capture goes on (cuStreamIsCapturing says so).
    CHECK(info_of(legacy).result == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    CUstreamCaptureStatus st{};
    CHECK(is_capturing(legacy, &st) == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    CHECK(is_capturing(blocking, &st) == CUDA_SUCCESS);
    CHECK(st == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CHECK(status_of(blocking) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    // Using it would tie the capture to work outside it: the capture is invalidated.
    CHECK(cu::cuStreamSynchronize_nothrow(legacy) == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
    CHECK(status_of(blocking) == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    end_invalidated(blocking);
    CHECK(status_of(legacy) == CU_STREAM_CAPTURE_STATUS_NONE);
    cu::cuStreamDestroy(blocking);
    cu::cuStreamDestroy(non_blocking);
  }

  TEST_CASE("an event recorded in a capture forks another stream into it; ending it ends both") {
    CUstream a = new_stream(), b = new_stream(), c = new_stream();
    CUevent e = new_event();
    const auto before = fake_graphs();

    REQUIRE(begin(a, global) == CUDA_SUCCESS);
    const capture_info ia = info_of(a);
    CHECK(cu::cuEventRecord_nothrow(e, a) == CUDA_SUCCESS);
    CHECK(fake_graphs().captured_event_records == before.captured_event_records + 1);
    CHECK(status_of(b) == CU_STREAM_CAPTURE_STATUS_NONE);
    CHECK(cu::cuStreamWaitEvent_nothrow(b, e, 0u) == CUDA_SUCCESS);
    const capture_info ib = info_of(b);
    CHECK(ib.status == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    CHECK(ib.id == ia.id);
    CHECK(ib.graph == ia.graph);
    CHECK(fake_graphs().active_captures == before.active_captures + 1);  // one capture, two streams
    CHECK(begin(b, global) == CUDA_ERROR_ILLEGAL_STATE);

    CUevent back = new_event();  // the join: the origin waits on the forked stream's work
    CHECK(cu::cuEventRecord_nothrow(back, b) == CUDA_SUCCESS);
    CHECK(cu::cuStreamWaitEvent_nothrow(a, back, 0u) == CUDA_SUCCESS);
    CHECK(info_of(a).id == ia.id);

    CUgraph g = end(a);
    CHECK(g == ia.graph);
    CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_NONE);
    CHECK(status_of(b) == CU_STREAM_CAPTURE_STATUS_NONE);

    // The event stands for nodes of that graph now, nothing a stream or the host could wait for.
    CHECK(cu::cuEventQuery_nothrow(e) == CUDA_ERROR_CAPTURED_EVENT);
    CHECK(cu::cuEventSynchronize_nothrow(e) == CUDA_ERROR_CAPTURED_EVENT);
    CHECK(cu::cuStreamWaitEvent_nothrow(c, e, 0u) == CUDA_ERROR_CAPTURED_EVENT);
    CHECK(status_of(c) == CU_STREAM_CAPTURE_STATUS_NONE);
    CHECK(cu::cuEventRecord_nothrow(e, c) == CUDA_SUCCESS);  // a real record makes it usable again
    CHECK(cu::cuEventQuery_nothrow(e) == CUDA_SUCCESS);
    CHECK(cu::cuStreamWaitEvent_nothrow(b, e, 0u) == CUDA_SUCCESS);

    cu::cuGraphDestroy(g);
    cu::cuEventDestroy(e);
    cu::cuEventDestroy(back);
    for (CUstream s : {a, b, c}) cu::cuStreamDestroy(s);
  }

  TEST_CASE("a capture can be ended only on the stream that began it") {
    CUstream a = new_stream(), b = new_stream();
    CUevent e = new_event();
    REQUIRE(begin(a, global) == CUDA_SUCCESS);
    CHECK(cu::cuEventRecord_nothrow(e, a) == CUDA_SUCCESS);
    CHECK(cu::cuStreamWaitEvent_nothrow(b, e, 0u) == CUDA_SUCCESS);
    CUgraph g = nullptr;
    CHECK(cu::cuStreamEndCapture_nothrow(b, &g) == CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
    CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    CHECK(status_of(b) == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    end_invalidated(a);
    CHECK(status_of(b) == CU_STREAM_CAPTURE_STATUS_NONE);
    cu::cuEventDestroy(e);
    cu::cuStreamDestroy(a);
    cu::cuStreamDestroy(b);
  }

  TEST_CASE("a capture begun in global or thread-local mode is ended on the thread that began it") {
    CUstream a = new_stream();
    for (CUstreamCaptureMode mode : {global, thread_local_mode}) {
      REQUIRE(begin(a, mode) == CUDA_SUCCESS);
      CUresult elsewhere = CUDA_SUCCESS;
      on_another_thread([&] {
        CUgraph g = nullptr;
        elsewhere = cu::cuStreamEndCapture_nothrow(a, &g);
      });
      CHECK(elsewhere == CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
      CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
      cu::cuGraphDestroy(end(a));
    }
    REQUIRE(begin(a, relaxed) == CUDA_SUCCESS);
    CUgraph g = nullptr;
    on_another_thread([&] { g = end(a); });
    CHECK(g != nullptr);
    cu::cuGraphDestroy(g);
    cu::cuStreamDestroy(a);
  }

  TEST_CASE("a capturing stream may wait only on its own capture's events") {
    CUstream a = new_stream(), b = new_stream(), outside = new_stream();
    CUevent never = new_event(), e = new_event(), theirs = new_event();
    const auto before = fake_graphs();

    REQUIRE(begin(a, relaxed) == CUDA_SUCCESS);
    CHECK(cu::cuStreamWaitEvent_nothrow(a, never, 0u) == CUDA_SUCCESS);  // an empty set of work
    CHECK(cu::cuEventRecord_nothrow(e, outside) == CUDA_SUCCESS);
    CHECK(cu::cuStreamWaitEvent_nothrow(a, e, 0u) == CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
    CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
    CHECK(cu::cuEventRecord_nothrow(e, a) == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    end_invalidated(a);
    CHECK(fake_graphs().graphs == before.graphs);  // the invalidated capture's graph is gone

    // Two captures cannot be merged by an event: both are invalidated.
    REQUIRE(begin(a, relaxed) == CUDA_SUCCESS);
    REQUIRE(begin(b, relaxed) == CUDA_SUCCESS);
    CHECK(cu::cuEventRecord_nothrow(theirs, b) == CUDA_SUCCESS);
    CHECK(cu::cuStreamWaitEvent_nothrow(a, theirs, 0u) == CUDA_ERROR_STREAM_CAPTURE_MERGE);
    end_invalidated(a);
    end_invalidated(b);

    // An external wait does not depend on other work: allowed in a capture, and only there.
    CHECK(cu::cuStreamWaitEvent_nothrow(a, e, unsigned{CU_EVENT_WAIT_EXTERNAL}) == CUDA_ERROR_INVALID_VALUE);
    REQUIRE(begin(a, relaxed) == CUDA_SUCCESS);
    CHECK(cu::cuEventRecord_nothrow(e, outside) == CUDA_SUCCESS);
    CHECK(cu::cuStreamWaitEvent_nothrow(a, e, unsigned{CU_EVENT_WAIT_EXTERNAL}) == CUDA_SUCCESS);
    CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    cu::cuGraphDestroy(end(a));

    CHECK(fake_graphs().graphs == before.graphs);
    for (CUevent ev : {never, e, theirs}) cu::cuEventDestroy(ev);
    for (CUstream s : {a, b, outside}) cu::cuStreamDestroy(s);
  }

  TEST_CASE("the host cannot wait for a capturing stream, in any mode, and trying invalidates it") {
    CUstream a = new_stream();
    const CUstreamCaptureMode was = exchange_mode(relaxed);
    CHECK(was == global);  // every thread starts in global mode
    for (bool synchronize : {false, true}) {
      const auto before = fake_graphs();
      REQUIRE(begin(a, relaxed) == CUDA_SUCCESS);
      const CUresult r = synchronize ? cu::cuStreamSynchronize_nothrow(a) : cu::cuStreamQuery_nothrow(a);
      CHECK(r == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
      CHECK(fake_graphs().unsafe_call_refusals == before.unsafe_call_refusals + 1);
      CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
      end_invalidated(a);
    }
    CHECK(exchange_mode(was) == relaxed);
    cu::cuStreamDestroy(a);
  }

  TEST_CASE("an event recorded in a capture cannot be waited for by the host") {
    CUstream a = new_stream();
    CUevent e = new_event();
    // Refused as an unsafe call first, when the mode forbids those; that invalidates the capture.
    REQUIRE(begin(a, global) == CUDA_SUCCESS);
    CHECK(cu::cuEventRecord_nothrow(e, a) == CUDA_SUCCESS);
    CHECK(cu::cuEventQuery_nothrow(e) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    end_invalidated(a);
    // In a mode that allows unsafe calls, the event itself is what is refused; the capture goes on.
    REQUIRE(begin(a, relaxed) == CUDA_SUCCESS);
    CHECK(cu::cuEventRecord_nothrow(e, a) == CUDA_SUCCESS);
    CHECK(cu::cuEventSynchronize_nothrow(e) == CUDA_ERROR_CAPTURED_EVENT);
    CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
    cu::cuGraphDestroy(end(a));
    cu::cuEventDestroy(e);
    cu::cuStreamDestroy(a);
  }

  TEST_CASE("unsafe calls are refused while a capture forbids them, and allowed in relaxed mode") {
    CUstream a = new_stream(), b = new_stream();
    CUevent plain = new_event();
    CHECK(cu::cuEventRecord_nothrow(plain, b) == CUDA_SUCCESS);
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = {CU_MEM_LOCATION_TYPE_DEVICE, 0};
    constexpr std::size_t two_mib = 2u << 20;

    SUBCASE("the capturing thread, in global mode, during its own global capture") {
      const auto before = fake_graphs();
      REQUIRE(begin(a, global) == CUDA_SUCCESS);
      CUmemGenericAllocationHandle h = 0;
      CHECK(cu::cuMemCreate_nothrow(&h, two_mib, &prop, 0ull) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
      CHECK(fake_graphs().unsafe_call_refusals == before.unsafe_call_refusals + 1);
      CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
      CHECK(cu::cuCtxSynchronize_nothrow() == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);  // still forbidden
      end_invalidated(a);
      CHECK(cu::cuMemCreate_nothrow(&h, two_mib, &prop, 0ull) == CUDA_SUCCESS);  // no capture left
      cu::cuMemRelease(h);
    }
    SUBCASE("the capturing thread, switched to relaxed mode") {
      const auto before = fake_graphs();
      REQUIRE(begin(a, global) == CUDA_SUCCESS);
      const CUstreamCaptureMode was = exchange_mode(relaxed);
      CUmemGenericAllocationHandle h = 0;
      CHECK(cu::cuMemCreate_nothrow(&h, two_mib, &prop, 0ull) == CUDA_SUCCESS);
      CUdeviceptr va = 0;
      CHECK(cu::cuMemAddressReserve_nothrow(&va, two_mib, 0ull, CUdeviceptr{0}, 0ull) == CUDA_SUCCESS);
      CHECK(cu::cuMemMap_nothrow(va, two_mib, std::size_t{0}, h, 0ull) == CUDA_SUCCESS);
      CHECK(cu::cuStreamSynchronize_nothrow(b) == CUDA_SUCCESS);
      CHECK(cu::cuEventQuery_nothrow(plain) == CUDA_SUCCESS);
      CHECK(exchange_mode(was) == relaxed);
      CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
      CHECK(fake_graphs().unsafe_call_refusals == before.unsafe_call_refusals);
      // Back in global mode, the same calls are refused again.
      CHECK(cu::cuMemMap_nothrow(va, two_mib, std::size_t{0}, h, 0ull) == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
      end_invalidated(a);
      cu::cuMemUnmap(va, two_mib);
      cu::cuMemAddressFree(va, two_mib);
      cu::cuMemRelease(h);
    }
    SUBCASE("another thread in global mode, during a global capture") {
      REQUIRE(begin(a, global) == CUDA_SUCCESS);
      CUresult query = CUDA_SUCCESS, sync = CUDA_SUCCESS;
      on_another_thread([&] {
        query = cu::cuEventQuery_nothrow(plain);
        sync = cu::cuStreamSynchronize_nothrow(b);
      });
      CHECK(query == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
      CHECK(sync == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
      CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_INVALIDATED);
      end_invalidated(a);
    }
    SUBCASE("another thread in thread-local or relaxed mode ignores a global capture") {
      REQUIRE(begin(a, global) == CUDA_SUCCESS);
      for (CUstreamCaptureMode mode : {thread_local_mode, relaxed}) {
        CUresult query = CUDA_ERROR_UNKNOWN;
        on_another_thread([&] {
          exchange_mode(mode);
          query = cu::cuEventQuery_nothrow(plain);
        });
        CHECK(query == CUDA_SUCCESS);
      }
      CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
      cu::cuGraphDestroy(end(a));
    }
    SUBCASE("a thread-local capture forbids unsafe calls to its own thread only") {
      REQUIRE(begin(a, thread_local_mode) == CUDA_SUCCESS);
      CUresult reserve = CUDA_ERROR_UNKNOWN;
      on_another_thread([&] {
        CUdeviceptr va = 0;
        reserve = cu::cuMemAddressReserve_nothrow(&va, two_mib, 0ull, CUdeviceptr{0}, 0ull);
        if (reserve == CUDA_SUCCESS) cu::cuMemAddressFree(va, two_mib);
      });
      CHECK(reserve == CUDA_SUCCESS);
      CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
      CHECK(cu::cuCtxSynchronize_nothrow() == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
      end_invalidated(a);
    }
    SUBCASE("a relaxed capture forbids nothing, not even to its own thread") {
      REQUIRE(begin(a, relaxed) == CUDA_SUCCESS);
      CHECK(cu::cuStreamSynchronize_nothrow(b) == CUDA_SUCCESS);
      CHECK(cu::cuCtxSynchronize_nothrow() == CUDA_SUCCESS);
      CHECK(status_of(a) == CU_STREAM_CAPTURE_STATUS_ACTIVE);
      cu::cuGraphDestroy(end(a));
    }
    CHECK(fake_graphs().active_captures == 0);
    cu::cuEventDestroy(plain);
    cu::cuStreamDestroy(a);
    cu::cuStreamDestroy(b);
  }

  TEST_CASE("the capture mode is exchanged per thread, and only for a valid one") {
    CHECK(exchange_mode(thread_local_mode) == global);
    CUstreamCaptureMode other = relaxed;
    on_another_thread([&] { other = exchange_mode(relaxed); });
    CHECK(other == global);  // the other thread's mode was its own
    CUstreamCaptureMode bad = static_cast<CUstreamCaptureMode>(3);
    CHECK(cu::cuThreadExchangeStreamCaptureMode_nothrow(&bad) == CUDA_ERROR_INVALID_VALUE);
    CHECK(cu::cuThreadExchangeStreamCaptureMode_nothrow(static_cast<CUstreamCaptureMode*>(nullptr)) ==
          CUDA_ERROR_INVALID_VALUE);
    CHECK(exchange_mode(global) == thread_local_mode);
  }

  TEST_CASE("a user object lives until its graph and every exec are gone, and dies on the driver thread") {
    CUstream a = new_stream(), b = new_stream();
    const auto before = fake_graphs();
    destructor_record rec;
    CUuserObject obj = new_user_object(rec);
    CHECK(fake_user_object_refs(obj) == 1);
    CHECK(fake_graphs().user_objects == before.user_objects + 1);

    REQUIRE(begin(a, global) == CUDA_SUCCESS);
    const CUgraph capturing = info_of(a).graph;
    // The caller's one reference moves to the graph being captured.
    CHECK(cu::cuGraphRetainUserObject_nothrow(capturing, obj, 1u, unsigned{CU_GRAPH_USER_OBJECT_MOVE}) == CUDA_SUCCESS);
    CHECK(fake_user_object_refs(obj) == 1);
    CHECK(cu::cuUserObjectRelease_nothrow(obj, 1u) == CUDA_ERROR_INVALID_VALUE);  // the caller owns none now
    CUgraphExec too_early = nullptr;
    CHECK(cu::cuGraphInstantiateWithFlags_nothrow(&too_early, capturing, 0ull) == CUDA_ERROR_INVALID_VALUE);
    CHECK(cu::cuGraphDestroy_nothrow(capturing) == CUDA_ERROR_INVALID_VALUE);  // the capture owns it
    const CUgraph g = end(a);
    CHECK(g == capturing);

    CUgraphExec plain = nullptr, auto_free = nullptr;
    REQUIRE(cu::cuGraphInstantiateWithFlags_nothrow(&plain, g, 0ull) == CUDA_SUCCESS);
    REQUIRE(cu::cuGraphInstantiateWithFlags_nothrow(
                &auto_free, g, static_cast<unsigned long long>(CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)) ==
            CUDA_SUCCESS);
    CHECK(fake_exec_flags(plain) == 0);
    CHECK(fake_exec_flags(auto_free) == static_cast<long long>(CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH));
    CHECK(fake_user_object_refs(obj) == 3);  // the graph's and one per exec
    CHECK(fake_graphs().execs == before.execs + 2);

    CHECK(cu::cuGraphLaunch_nothrow(plain, b) == CUDA_SUCCESS);
    CHECK(cu::cuGraphUpload_nothrow(auto_free, b) == CUDA_SUCCESS);
    CHECK(cu::cuGraphLaunch_nothrow(auto_free, b) == CUDA_SUCCESS);
    CHECK(fake_graphs().launches == before.launches + 2);
    CHECK(fake_graphs().uploads == before.uploads + 1);
    REQUIRE(begin(a, global) == CUDA_SUCCESS);  // launched into a capture: captured, not run
    CHECK(cu::cuGraphLaunch_nothrow(plain, a) == CUDA_SUCCESS);
    CHECK(fake_graphs().launches == before.launches + 2);
    cu::cuGraphDestroy(end(a));

    cu::cuGraphDestroy(g);
    fake_quiesce();
    CHECK(rec.runs == 0);
    CHECK(fake_user_object_refs(obj) == 2);
    cu::cuGraphExecDestroy(plain);
    fake_quiesce();
    CHECK(rec.runs == 0);
    CHECK(fake_user_object_refs(obj) == 1);
    cu::cuGraphExecDestroy(auto_free);
    fake_quiesce();
    CHECK(rec.runs == 1);
    CHECK(rec.ran_on != std::this_thread::get_id());
    CHECK(fake_user_object_refs(obj) == -1);
    CHECK(fake_graphs().destructors_run == before.destructors_run + 1);
    CHECK(fake_graphs().user_objects == before.user_objects);
    CHECK(fake_graphs().execs == before.execs);
    CHECK(fake_graphs().graphs == before.graphs);

    CHECK(cu::cuGraphExecDestroy_nothrow(auto_free) == CUDA_ERROR_INVALID_VALUE);
    CHECK(cu::cuGraphLaunch_nothrow(plain, b) == CUDA_ERROR_INVALID_VALUE);
    cu::cuStreamDestroy(a);
    cu::cuStreamDestroy(b);
  }

  TEST_CASE("graph references: added, given back, and never more than are held") {
    CUstream a = new_stream();
    destructor_record rec;
    CUuserObject obj = new_user_object(rec, 2);
    REQUIRE(begin(a, relaxed) == CUDA_SUCCESS);
    const CUgraph g = end(a);  // an empty graph, captured

    CHECK(cu::cuGraphRetainUserObject_nothrow(g, obj, 3u, 0u) == CUDA_SUCCESS);  // three new ones
    CHECK(fake_user_object_refs(obj) == 5);
    CHECK(cu::cuGraphRetainUserObject_nothrow(g, obj, 3u, unsigned{CU_GRAPH_USER_OBJECT_MOVE}) ==
          CUDA_ERROR_INVALID_VALUE);  // the caller holds only two to move
    CHECK(cu::cuGraphReleaseUserObject_nothrow(g, obj, 4u) == CUDA_ERROR_INVALID_VALUE);
    CHECK(cu::cuGraphReleaseUserObject_nothrow(g, obj, 3u) == CUDA_SUCCESS);
    CHECK(cu::cuGraphReleaseUserObject_nothrow(g, obj, 1u) == CUDA_ERROR_INVALID_VALUE);
    CHECK(fake_user_object_refs(obj) == 2);
    CHECK(cu::cuUserObjectRetain_nothrow(obj, 1u) == CUDA_SUCCESS);
    CHECK(cu::cuUserObjectRetain_nothrow(obj, 0u) == CUDA_ERROR_INVALID_VALUE);
    CHECK(cu::cuUserObjectRelease_nothrow(obj, 4u) == CUDA_ERROR_INVALID_VALUE);  // below zero
    CHECK(cu::cuUserObjectRelease_nothrow(obj, 2u) == CUDA_SUCCESS);
    fake_quiesce();
    CHECK(rec.runs == 0);
    CHECK(cu::cuUserObjectRelease_nothrow(obj, 1u) == CUDA_SUCCESS);
    fake_quiesce();
    CHECK(rec.runs == 1);
    CHECK(cu::cuUserObjectRelease_nothrow(obj, 1u) == CUDA_ERROR_INVALID_VALUE);  // gone

    CUuserObject bad = nullptr;
    auto create = [&](unsigned refs, unsigned flags) {
      return cu::cuUserObjectCreate_nothrow(&bad, static_cast<void*>(&rec), &record_destruction, refs, flags);
    };
    CHECK(create(1u, 0u) == CUDA_ERROR_INVALID_VALUE);  // the flag is required
    CHECK(create(0u, unsigned{CU_USER_OBJECT_NO_DESTRUCTOR_SYNC}) == CUDA_ERROR_INVALID_VALUE);
    cu::cuGraphDestroy(g);
    cu::cuStreamDestroy(a);
  }

  TEST_CASE("an invalidated capture destroys its graph, and the graph's references with it") {
    CUstream a = new_stream(), outside = new_stream();
    CUevent e = new_event();
    const auto before = fake_graphs();
    destructor_record rec;
    CUuserObject obj = new_user_object(rec);
    REQUIRE(begin(a, global) == CUDA_SUCCESS);
    CHECK(cu::cuGraphRetainUserObject_nothrow(info_of(a).graph, obj, 1u, unsigned{CU_GRAPH_USER_OBJECT_MOVE}) ==
          CUDA_SUCCESS);
    CHECK(cu::cuEventRecord_nothrow(e, outside) == CUDA_SUCCESS);
    CHECK(cu::cuStreamWaitEvent_nothrow(a, e, 0u) == CUDA_ERROR_STREAM_CAPTURE_ISOLATION);
    fake_quiesce();
    CHECK(rec.runs == 0);  // the capture holds the graph until it is ended
    end_invalidated(a);
    fake_quiesce();
    CHECK(rec.runs == 1);
    CHECK(rec.ran_on != std::this_thread::get_id());
    CHECK(fake_graphs().graphs == before.graphs);
    CHECK(fake_graphs().user_objects == before.user_objects);
    cu::cuEventDestroy(e);
    cu::cuStreamDestroy(a);
    cu::cuStreamDestroy(outside);
  }

  TEST_CASE("a destructor that calls the driver is refused and counted") {
    CHECK(cu::cuStreamQuery_nothrow(legacy) == CUDA_SUCCESS);  // looked up here, not on the driver thread
    const auto before = fake_graphs();
    destructor_record rec;
    CUuserObject obj = new_user_object(rec, 1, &call_driver_from_destructor);
    cu::cuUserObjectRelease(obj, 1u);
    fake_quiesce();
    CHECK(rec.runs == 1);
    CHECK(rec.driver_call == CUDA_ERROR_NOT_PERMITTED);
    CHECK(fake_graphs().destructor_thread_violations == before.destructor_thread_violations + 1);
  }

  TEST_CASE("threads capturing at once get distinct ids, and their streams join only their own capture") {
    constexpr int threads = 8, rounds = 50;
    std::vector<std::vector<cuuint64_t>> ids(threads);
    std::vector<std::thread> pool;
    std::atomic<int> wrong{0};
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        CUstream origin = new_stream(), fork = new_stream(), idle = new_stream();
        CUevent e = new_event();
        for (int i = 0; i < rounds; ++i) {
          if (begin(origin, thread_local_mode) != CUDA_SUCCESS) ++wrong;
          const capture_info info = info_of(origin);
          ids[t].push_back(info.id);
          if (cu::cuEventRecord_nothrow(e, origin) != CUDA_SUCCESS) ++wrong;
          if (cu::cuStreamWaitEvent_nothrow(fork, e, 0u) != CUDA_SUCCESS) ++wrong;
          if (info_of(fork).id != info.id || status_of(idle) != CU_STREAM_CAPTURE_STATUS_NONE) ++wrong;
          CUgraph g = nullptr;
          if (cu::cuStreamEndCapture_nothrow(origin, &g) != CUDA_SUCCESS || g != info.graph) ++wrong;
          if (cu::cuGraphDestroy_nothrow(g) != CUDA_SUCCESS) ++wrong;
        }
        cu::cuEventDestroy(e);
        for (CUstream s : {origin, fork, idle}) cu::cuStreamDestroy(s);
      });
    }
    for (auto& th : pool) th.join();
    CHECK(wrong == 0);
    std::set<cuuint64_t> distinct;
    for (const auto& v : ids) distinct.insert(v.begin(), v.end());
    CHECK(distinct.size() == static_cast<std::size_t>(threads * rounds));
    CHECK(distinct.count(0) == 0);
    CHECK(fake_graphs().active_captures == 0);
  }

  TEST_CASE("the loader's names are served at the versions it asks for, and older ABIs are not") {
    const get_proc_address lookup = fake_get_proc_address();
    namespace d = streamalloc::detail::cu;
    const std::pair<const char*, int> entries[] = {
        {d::cuStreamGetCaptureInfo_entry::name, d::cuStreamGetCaptureInfo_entry::version},
        {d::cuThreadExchangeStreamCaptureMode_entry::name, d::cuThreadExchangeStreamCaptureMode_entry::version},
        {d::cuStreamBeginCapture_entry::name, d::cuStreamBeginCapture_entry::version},
        {d::cuStreamEndCapture_entry::name, d::cuStreamEndCapture_entry::version},
        {d::cuGraphInstantiateWithFlags_entry::name, d::cuGraphInstantiateWithFlags_entry::version},
        {d::cuGraphLaunch_entry::name, d::cuGraphLaunch_entry::version},
        {d::cuGraphUpload_entry::name, d::cuGraphUpload_entry::version},
        {d::cuGraphExecDestroy_entry::name, d::cuGraphExecDestroy_entry::version},
        {d::cuGraphDestroy_entry::name, d::cuGraphDestroy_entry::version},
        {d::cuUserObjectCreate_entry::name, d::cuUserObjectCreate_entry::version},
        {d::cuUserObjectRetain_entry::name, d::cuUserObjectRetain_entry::version},
        {d::cuUserObjectRelease_entry::name, d::cuUserObjectRelease_entry::version},
        {d::cuGraphRetainUserObject_entry::name, d::cuGraphRetainUserObject_entry::version},
        {d::cuGraphReleaseUserObject_entry::name, d::cuGraphReleaseUserObject_entry::version},
    };
    for (const auto& [name, version] : entries) {
      CAPTURE(name);
      void* fn = nullptr;
      CUdriverProcAddressQueryResult found{};
      CHECK(lookup(name, &fn, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found) == CUDA_SUCCESS);
      CHECK(found == CU_GET_PROC_ADDRESS_SUCCESS);
      CHECK(fn != nullptr);
    }
    // Asked for 12.2, the driver would hand out cuStreamGetCaptureInfo_v2, without edge data.
    void* served = nullptr;
    void* older = nullptr;
    CUdriverProcAddressQueryResult found{};
    REQUIRE(lookup("cuStreamGetCaptureInfo", &served, 13000, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found) == CUDA_SUCCESS);
    REQUIRE(lookup("cuStreamGetCaptureInfo", &older, 12020, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found) == CUDA_SUCCESS);
    CHECK(older != served);
    CHECK(reinterpret_cast<CUresult (*)()>(older)() == CUDA_ERROR_NOT_SUPPORTED);
  }
}
