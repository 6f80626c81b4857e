// The default streams' handles across contexts, against the fake driver (two devices, peers):
// the legacy handle (0, CU_STREAM_LEGACY) and the per-thread handle name another stream in each
// context, so a thread that switches its current device between calls and passes the same handle
// again names another stream. What streamalloc identifies (by cuStreamGetId, asked in the context
// current at each use), what it caches per thread (by stream id), which device's legacy stream a
// pool asks about a free, and what a `stream_ref` resolved in one context proves when it is used
// with another context current.
//
// The fake models the primary contexts only (no cuCtxCreate, no cuDevicePrimaryCtxReset), and
// its legacy streams cannot be held (fake_hold_stream keys them all as one null stream and never
// holds it): which legacy stream a call reached is read from its per-device counters
// (fake_legacy_stream_calls: cuEventRecord, cuStreamQuery, cuStreamSynchronize).

#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <cstdint>
#include <thread>

namespace default_streams_contexts_test {

using namespace streamalloc;
using streamalloc_test::fake_legacy_stream_calls;
using streamalloc_test::MiB;

/// Makes device `d`'s primary context the thread's current one (cudaSetDevice(d) as the runtime
/// does it); the thread's context before the case is restored at the end of the case.
inline void set_device(int d) { detail::cu::cuCtxSetCurrent(detail::primary_context(d)); }

class context_restored {
 public:
  context_restored() { detail::cu::cuCtxGetCurrent(&saved_); }
  ~context_restored() { (void)detail::cu::cuCtxSetCurrent_nothrow(saved_); }
  context_restored(const context_restored&) = delete;
  context_restored& operator=(const context_restored&) = delete;

 private:
  CUcontext saved_ = nullptr;
};

/// A pool of device 0 that device 1's streams may use too, with chunks of one granule, nothing
/// released. Each allocation of the tests takes a whole chunk, so the next is served by a free
/// (at the same address) or by growth (at another).
inline pool_properties shared_pool() {
  pool_properties p;
  p.location = memory_location::device(0);
  p.chunk_size = 2 * MiB;
  p.release_threshold = SIZE_MAX;
  return p;
}

}  // namespace default_streams_contexts_test

TEST_SUITE("default_streams_contexts") {

using namespace default_streams_contexts_test;

TEST_CASE("the default streams' handles name another stream in each device's context, and the thread's caches keep them apart") {
  const context_restored restore;
  set_device(0);
  detail::stream_record& legacy0 = stream_ref::legacy_default().record();
  detail::stream_record& per_thread0 = stream_ref::per_thread_default().record();
  set_device(1);
  // The same handles, looked up again: the thread's recent streams hold device 0's records now,
  // so a cache keyed by handle would hand them back here.
  detail::stream_record& legacy1 = stream_ref::legacy_default().record();
  detail::stream_record& per_thread1 = stream_ref::per_thread_default().record();
  CHECK(&legacy1 != &legacy0);
  CHECK(legacy1.id() != legacy0.id());
  CHECK(&per_thread1 != &per_thread0);
  CHECK(legacy0.device() == 0);
  CHECK(legacy1.device() == 1);
  CHECK(per_thread0.device() == 0);
  CHECK(per_thread1.device() == 1);
  CHECK(stream_ref::legacy_default().device() == 1);
  CHECK(legacy0.legacy());
  CHECK(legacy1.legacy());
  CHECK(legacy0.context() == detail::primary_context(0));
  CHECK(legacy1.context() == detail::primary_context(1));
  set_device(0);  // and back: device 0's records again, not the last ones met
  CHECK(&stream_ref::legacy_default().record() == &legacy0);
  CHECK(&stream_ref::per_thread_default().record() == &per_thread0);
  // Another thread's per-thread default stream is another stream; its legacy stream is not.
  std::uint64_t other_per_thread = 0, other_legacy = 0;
  std::thread([&] {
    set_device(0);
    other_per_thread = stream_ref::per_thread_default().id();
    other_legacy = stream_ref::legacy_default().id();
  }).join();
  CHECK(other_per_thread != per_thread0.id());
  CHECK(other_legacy == legacy0.id());
}

TEST_CASE("a free on device 0's legacy stream, then an allocation on the same handle with device 1 current: device 0's legacy stream is asked") {
  const context_restored restore;
  pool p(shared_pool());
  p.set_access(memory_location::device(1), access_flags::read_write);
  set_device(0);
  void* x = p.allocate(2 * MiB, stream_ref::legacy_default());
  p.deallocate(x, stream_ref::legacy_default());
  set_device(1);
  const long long on0 = fake_legacy_stream_calls(0), on1 = fake_legacy_stream_calls(1);
  // Handle 0 now names device 1's legacy stream, which is ordered after nothing on device 0's:
  // x may go to it only once device 0's legacy stream is known to have run the free. Taking the
  // handle for one stream would reuse x with no question; asking the handle with device 1
  // current would take device 1's legacy stream's idleness for device 0's.
  void* y = p.allocate(2 * MiB, stream_ref::legacy_default());
  INFO("calls reaching device 0's legacy stream: ", fake_legacy_stream_calls(0) - on0, ", device 1's: ",
       fake_legacy_stream_calls(1) - on1);
  CHECK(y == x);  // the fake's device has run the free (its legacy streams are never held)
  CHECK(fake_legacy_stream_calls(0) > on0);
  CHECK(p.statistics().live_allocations == 1);
  p.deallocate(y, stream_ref::legacy_default());
  set_device(0);
  CHECK(p.close().live_allocations == 0);
}

TEST_CASE("a pool settles device 1's legacy frees on device 1's legacy stream from a call of device 0's stream on another thread") {
  const context_restored restore;
  pool p(shared_pool());
  p.set_access(memory_location::device(1), access_flags::read_write);
  void* x = nullptr;
  std::thread([&] {
    set_device(1);
    x = p.allocate(2 * MiB, stream_ref::legacy_default());
    p.deallocate(x, stream_ref::legacy_default());
  }).join();
  set_device(0);
  stream b(0);
  const long long on0 = fake_legacy_stream_calls(0), on1 = fake_legacy_stream_calls(1);
  void* y = p.allocate(2 * MiB, b);
  INFO("calls reaching device 0's legacy stream: ", fake_legacy_stream_calls(0) - on0, ", device 1's: ",
       fake_legacy_stream_calls(1) - on1);
  CHECK(y == x);
  CHECK(fake_legacy_stream_calls(1) > on1);
  CHECK(fake_legacy_stream_calls(0) == on0);
  p.deallocate(y, b);
  CHECK(p.close().live_allocations == 0);
}

// stream_ref::synchronize() of a reference resolved in device 0's context (record: device 0's
// legacy stream) with device 1 current: it waited with cuStreamSynchronize(handle) in the calling
// thread's context, device 1's, then marked device 0's legacy stream complete, and memory freed on
// device 0's legacy stream went to another stream although nothing had waited for that stream. It
// now reaches the stream its record is of (record_context_scope, stream_lookup.hpp).
TEST_CASE("a legacy stream_ref resolved on device 0 and synchronized with device 1 current proves nothing of device 0's legacy stream") {
  const context_restored restore;
  pool p(shared_pool());
  set_device(0);
  const stream_ref legacy0 = stream_ref::legacy_default().resolved();  // as a stream_buffer keeps it
  REQUIRE(legacy0.known_record() != nullptr);
  REQUIRE(legacy0.device() == 0);
  void* x = p.allocate(2 * MiB, legacy0);
  p.deallocate(x, legacy0);
  stream b(0);
  const long long on0 = fake_legacy_stream_calls(0), on1 = fake_legacy_stream_calls(1);
  set_device(1);
  (void)legacy0.synchronize();
  set_device(0);
  void* y = p.allocate(2 * MiB, b);
  INFO("calls reaching device 0's legacy stream: ", fake_legacy_stream_calls(0) - on0, ", device 1's: ",
       fake_legacy_stream_calls(1) - on1);
  // x may be b's only if something reached device 0's legacy stream since the free (the
  // synchronize itself, in device 0's context, or the pool's own question).
  CHECK((y != x || fake_legacy_stream_calls(0) > on0));
  p.deallocate(y, b);
  CHECK(p.close().live_allocations == 0);
}

// As above, through stream_ref::query() (cuStreamQuery of the calling context's legacy stream).
TEST_CASE("a legacy stream_ref resolved on device 0 and queried with device 1 current proves nothing of device 0's legacy stream") {
  const context_restored restore;
  pool p(shared_pool());
  set_device(0);
  const stream_ref legacy0 = stream_ref::legacy_default().resolved();
  void* x = p.allocate(2 * MiB, legacy0);
  p.deallocate(x, legacy0);
  stream b(0);
  const long long on0 = fake_legacy_stream_calls(0);
  set_device(1);
  const bool idle = legacy0.query();
  set_device(0);
  void* y = p.allocate(2 * MiB, b);
  INFO("idle: ", idle, "; calls reaching device 0's legacy stream: ", fake_legacy_stream_calls(0) - on0);
  CHECK((y != x || fake_legacy_stream_calls(0) > on0));
  p.deallocate(y, b);
  CHECK(p.close().live_allocations == 0);
}

// event_ref::record(s) of a legacy reference resolved on device 0, with device 1 current and an
// event of device 1's context: the driver recorded on device 1's legacy stream (the handle names
// the current context's) while the event's point was device 0's legacy stream's; the host's wait
// for the event then marked device 0's legacy stream complete. Now the record is made in device
// 0's context, where the driver refuses an event of another context.
TEST_CASE("an event recorded on a legacy stream_ref resolved on device 0, with device 1 current, proves nothing of device 0's legacy stream") {
  const context_restored restore;
  pool p(shared_pool());
  set_device(0);
  const stream_ref legacy0 = stream_ref::legacy_default().resolved();
  void* x = p.allocate(2 * MiB, legacy0);
  p.deallocate(x, legacy0);
  stream b(0);
  set_device(1);
  event e;  // device 1's context's
  const long long on0 = fake_legacy_stream_calls(0);
  bool refused = false;
  try {
    e.record(legacy0);  // refusing it (an event of another context than the stream's) is fine too
    (void)e.synchronize();
  } catch (const cuda_error&) {
    refused = true;
  }
  set_device(0);
  void* y = p.allocate(2 * MiB, b);
  INFO("refused: ", refused, "; calls reaching device 0's legacy stream: ", fake_legacy_stream_calls(0) - on0);
  CHECK((refused || y != x || fake_legacy_stream_calls(0) > on0));
  p.deallocate(y, b);
  CHECK(p.close().live_allocations == 0);
}

TEST_CASE("order_after with a legacy stream_ref resolved on device 0 and device 1 current: refused, or ordered after device 0's legacy stream") {
  const context_restored restore;
  set_device(0);
  const stream_ref legacy0 = stream_ref::legacy_default().resolved();
  stream b(0);
  set_device(1);
  const long long on0 = fake_legacy_stream_calls(0);
  // The scratch event is device 0's (the earlier stream's record says device 0). Recorded on the
  // handle with device 1 current, it would land on device 1's legacy stream: the driver refuses
  // that pair. Either that refusal, or a record that reached device 0's legacy stream.
  bool refused = false;
  try {
    (void)order_after(b, legacy0);
  } catch (const cuda_error&) {
    refused = true;
  }
  INFO("refused: ", refused, "; calls reaching device 0's legacy stream: ", fake_legacy_stream_calls(0) - on0);
  if (refused) {
    CHECK(b.ref().record().ordered_after(legacy0.id()) == 0);
  } else {
    CHECK(fake_legacy_stream_calls(0) > on0);
    CHECK(b.ref().record().ordered_after(legacy0.id()) > 0);
  }
}

}  // TEST_SUITE
