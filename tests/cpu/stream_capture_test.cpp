// Events and waits through streamalloc while a stream is captured into a graph, against the fake
// driver's model of capture (tests/fake_driver). Recorded into a capture, an event marks a point
// of the graph being built; a stream that waits on it joins the capture. Neither orders any work
// in real time, so the pools must learn nothing from them: a claim that the waiting stream runs
// after the recording stream's earlier work would let a pool hand that stream memory still in
// use. tests/gpu/lifetime_capture_test.cu shows the same with kernels running on an H200.
// The second suite, event_waits, is about the other way an event's record can change under a
// host wait: another thread recording it again.

#include <streamalloc/error.hpp>
#include <streamalloc/stream.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <cstdint>
#include <string>
#include <thread>

using namespace streamalloc;
namespace cu = streamalloc::detail::cu;
using streamalloc_test::contains;
using streamalloc_test::handle;
using streamalloc_test::message_of;

namespace {
/// What stream `later`'s record says it runs after on stream `earlier` (0: nothing).
std::uint64_t known_order(const stream& later, const stream& earlier) {
  return later.ref().record().ordered_after(earlier.ref().record().id());
}

CUresult end_capture_of(CUstream s) {
  CUgraph g = nullptr;
  const CUresult r = cu::cuStreamEndCapture_nothrow(s, &g);
  if (g != nullptr) cu::cuGraphDestroy(g);
  return r;
}
}  // namespace

TEST_SUITE("stream_capture") {

TEST_CASE("a fork and join in a capture through streamalloc events proves no order and leaves the capture whole") {
  stream s1, s2;
  event fork, join;
  REQUIRE(cu::cuStreamBeginCapture_nothrow(handle(s1), CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS);
  fork.record(s1);
  const stream_order joined = s2.wait(fork);  // s2 joins the capture
  CHECK(joined.earlier_stream() == 0);        // proves nothing
  CHECK(joined.later_stream() == s2.ref().record().id());
  CHECK(known_order(s2, s1) == 0);
  join.record(s2);
  const stream_order back = s1.wait(join);  // a wait by the capturing stream itself
  CHECK(back.earlier_stream() == 0);
  CHECK(known_order(s1, s2) == 0);
  CHECK(end_capture_of(handle(s1)) == CUDA_SUCCESS);
  // The events stand for nodes of a graph: the host cannot wait for them.
  CHECK_THROWS_AS((void)fork.synchronize(), cuda_error);
  CHECK_THROWS_AS((void)join.query(), cuda_error);

  // The control: the same record and wait outside a capture do order s2 after s1.
  fork.record(s1);
  const stream_order real = s2.wait(fork);
  CHECK(real.earlier_stream() == s1.ref().record().id());
  CHECK(known_order(s2, s1) > 0);
}

TEST_CASE("an event recorded before a capture and recorded again in it no longer proves its old point") {
  stream s1, s2, s3;
  event e;
  e.record(s1);  // a real point of s1
  REQUIRE(cu::cuStreamBeginCapture_nothrow(handle(s1), CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS);
  e.record(s1);  // now a node of the capture
  (void)s2.wait(e);
  CHECK(known_order(s2, s1) == 0);
  event back;
  back.record(s2);
  (void)s1.wait(back);
  CHECK(end_capture_of(handle(s1)) == CUDA_SUCCESS);
  // Outside the capture, waiting on it is refused (the capture that recorded it has ended),
  // and nothing is learnt.
  CHECK_THROWS_AS((void)s3.wait(e), cuda_error);
  CHECK(known_order(s3, s1) == 0);
}

TEST_CASE("raw handles under capture: events and waits work without identifying the capturing stream") {
  CUstream a = nullptr, b = nullptr;
  cu::cuStreamCreateWithPriority(&a, CU_STREAM_NON_BLOCKING, 0);
  cu::cuStreamCreateWithPriority(&b, CU_STREAM_NON_BLOCKING, 0);
  const stream_ref ra{reinterpret_cast<cudaStream_t>(a)}, rb{reinterpret_cast<cudaStream_t>(b)};
  const std::uint64_t b_id = rb.record().id();  // b is met before the capture
  REQUIRE(cu::cuStreamBeginCapture_nothrow(a, CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS);
  event fork, join;
  fork.record(ra);                         // CUDA would refuse a's id: it is not asked
  const stream_order w = rb.wait(fork);    // b joins
  CHECK(w.earlier_stream() == 0);
  CHECK(w.later_stream() == b_id);
  join.record(rb);
  const stream_order w2 = ra.wait(join);   // a raw capturing waiter: its id is not asked either
  CHECK(w2.later_stream() == 0);
  CHECK(ra.resolved().known_record() == nullptr);  // looked up after the capture, not now
  // What needs a capturing raw stream's identity says why it cannot have it, and the capture
  // goes on.
  const std::string why = message_of([&] { (void)order_after(rb, ra); });
  CHECK(contains(why, "being captured"));
  CHECK(contains(why, "resolved()"));
  CHECK_THROWS_WITH_AS(stream_buffer<int>(16, ra), doctest::Contains("being captured"), cuda_error);
  CHECK(end_capture_of(a) == CUDA_SUCCESS);
  CHECK(ra.resolved().known_record() != nullptr);
  cu::cuStreamDestroy(a);
  cu::cuStreamDestroy(b);
}

TEST_CASE("the per-thread default stream under capture: events work, what needs its id says why it cannot") {
  const stream_ref pt = stream_ref::per_thread_default();
  stream other;
  const std::uint64_t pt_id = pt.record().id();  // met before the capture
  REQUIRE(cu::cuStreamBeginCapture_nothrow(CU_STREAM_PER_THREAD, CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS);
  event fork, join;
  fork.record(pt);
  (void)other.wait(fork);  // other joins
  CHECK(other.ref().record().ordered_after(pt_id) == 0);
  join.record(other);
  const stream_order w = pt.wait(join);
  CHECK(w.earlier_stream() == 0);
  // resolved() cannot bind the per-thread handle to one thread's stream, before or during it.
  const std::string why = message_of([&] { (void)order_after(other.ref(), pt); });
  CHECK(contains(why, "being captured"));
  CHECK(contains(why, "per-thread default stream"));
  CHECK(end_capture_of(CU_STREAM_PER_THREAD) == CUDA_SUCCESS);
}

TEST_CASE("the legacy stream while a blocking stream captures: event records and waits are refused before CUDA sees them") {
  stream blocking(0, stream_flags::blocking);
  const stream_ref legacy = stream_ref::legacy_default();
  const stream_ref resolved = legacy.resolved();  // carries its record: asked all the same
  REQUIRE(resolved.known_record() != nullptr);
  event e;
  REQUIRE(cu::cuStreamBeginCapture_nothrow(handle(blocking), CU_STREAM_CAPTURE_MODE_GLOBAL) == CUDA_SUCCESS);
  // Recorded or waited there, the work would join the capture implicitly; CUDA would refuse it
  // and invalidate the capture.
  for (const stream_ref on : {legacy, resolved}) {
    CHECK_THROWS_WITH_AS(e.record(on), doctest::Contains("legacy default stream was used"), cuda_error);
    CHECK_THROWS_WITH_AS((void)on.wait(e), doctest::Contains("legacy default stream was used"), cuda_error);
  }
  CHECK(end_capture_of(handle(blocking)) == CUDA_SUCCESS);  // still whole
}

TEST_CASE("the legacy stream identified while a blocking stream captures: refused, and the capture stays whole") {
  // CUDA refuses the legacy stream's id then, and that question (unlike the capture question)
  // invalidates the capture, in every mode (the fake does as the H200 did): streamalloc asks
  // the capture question first and refuses on its answer.
  for (const CUstreamCaptureMode mode :
       {CU_STREAM_CAPTURE_MODE_GLOBAL, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL, CU_STREAM_CAPTURE_MODE_RELAXED}) {
    CAPTURE(static_cast<int>(mode));
    stream blocking(0, stream_flags::blocking);
    REQUIRE(cu::cuStreamBeginCapture_nothrow(handle(blocking), mode) == CUDA_SUCCESS);
    const stream_ref legacy = stream_ref::legacy_default();
    CHECK_THROWS_WITH_AS((void)legacy.resolved(), doctest::Contains("legacy default stream was used"), cuda_error);
    CHECK_THROWS_WITH_AS((void)legacy.id(), doctest::Contains("legacy default stream was used"), cuda_error);
    CHECK_THROWS_WITH_AS(stream_buffer<int>(16, legacy), doctest::Contains("legacy default stream was used"),
                         cuda_error);
    // From a thread with no context yet: asked in the context the id question would use.
    std::string from_new_thread;
    std::thread([&] { from_new_thread = message_of([&] { (void)legacy.resolved(); }); }).join();
    CHECK(contains(from_new_thread, "legacy default stream was used"));
    CHECK(end_capture_of(handle(blocking)) == CUDA_SUCCESS);
    // Once the capture is over, the same calls are served.
    CHECK(legacy.resolved().known_record() != nullptr);
    stream_buffer<int> after(16, legacy);
    CHECK(after.size() == 16);
  }
}

}  // TEST_SUITE

// A host wait on an event proves the record it waited for. The driver waits for the record
// current when it is asked, so one made by another thread between streamalloc reading the
// event's point and the wait (perhaps on another stream) must not let the old point pass for
// complete.
TEST_SUITE("event_waits") {

namespace {
struct re_record {
  event* e;
  stream* on;
};
void record_again(void* p) {
  auto* r = static_cast<re_record*>(p);
  r->e->record(*r->on);
}
}  // namespace

TEST_CASE("a host wait on an event recorded again meanwhile proves nothing of the record it read") {
  stream a, b;
  event e;
  for (const bool synchronize : {true, false}) {
    CAPTURE(synchronize);
    e.record(a);
    const std::uint64_t read = a.ref().record().current_epoch();
    const std::uint64_t before = a.ref().record().completed();
    re_record again{&e, &b};
    streamalloc_test::fake_before_next_event_wait(&record_again, &again);
    if (synchronize) {
      const host_order h = e.synchronize();
      CHECK(h.point() == 0);
    } else {
      CHECK(e.query());
    }
    CHECK(a.ref().record().completed() == before);  // a's record is not known done
    CHECK(a.ref().record().completed() < read);
    // The control: waited for without a record between, it is.
    e.record(a);
    const host_order h = e.synchronize();
    CHECK(h.stream() == a.ref().record().id());
    CHECK(a.ref().record().completed() >= h.point());
    CHECK(h.point() > before);
  }
}

}  // TEST_SUITE
