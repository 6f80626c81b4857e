// Lifetimes and streams: memory freed on a stream behind a running kernel must not be handed to
// another stream while the kernel runs, whatever happens meanwhile to the streams: per-thread
// default streams shared by handle across threads, destroyed raw streams whose handles come
// back, moved and destroyed owners, many streams destroyed at once, threads, a free on another
// device's stream. event_ordered_reuse is the control: reuse that is ordered may happen.
//
// Each case is a child process (child_process.hpp) checked with lifetime_checks.cuh, whose
// opening comment describes the technique.

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "child_process.hpp"
#include "gpu_kernels.cuh"
#include "gpu_support.hpp"
#include "lifetime_checks.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {

constexpr std::size_t KiB = 1024;

// The per-thread default stream goes by one handle on every thread. Another thread's idle
// per-thread stream (queried, synchronized) must prove nothing about this thread's, in both
// directions: this thread frees while another allocates, and another thread frees, exits, and
// this one allocates.
void per_thread_default_in(const config& cfg) {
  note("pool: %s", cfg.name);
  const std::size_t bytes = 8 * MiB;
  pool p(cfg.props);
  device_counters c(2);
  std::vector<owner> owners;
  std::optional<stream> side;  // made by thread B, kept until the data is checked

  // This thread's kernel; thread B allocates.
  void* x = p.allocate(bytes, stream_ref::per_thread_default());
  const long_use a = start_long_use(x, bytes, 100, cudaStreamPerThread, c.slot(0));
  p.deallocate(x, stream_ref::per_thread_default());
  on_new_thread([&] {
    CHILD_CUDA(cudaSetDevice(0));
    const stream_ref mine = stream_ref::per_thread_default();
    // Thread B's per-thread stream is idle; the pool learns it has executed everything.
    (void)mine.query();
    mine.synchronize();
    void* y1 = p.allocate(bytes, mine);
    note("thread B, per-thread stream: %p (A freed %p)", y1, x);
    expect_not_reused_while_running(y1, bytes, a, 1, "thread B, its per-thread default stream");
    owners.push_back(fill_new(y1, bytes, 110, cudaStreamPerThread));
    side.emplace(0);
    void* y2 = p.allocate(bytes, *side);
    note("thread B, a new stream: %p", y2);
    expect_not_reused_while_running(y2, bytes, a, 2, "thread B, a new streamalloc::stream");
    owners.push_back(fill_new(y2, bytes, 111, side->get()));
  });
  expect_device_ok(3, "thread B allocated while thread A's kernel ran");
  expect_completed(a, 4, "thread A's kernel");  // 4, 5
  expect_all_intact(owners, 6, "thread B's allocations");
  free_all(p, owners, stream_ref::per_thread_default());

  // Thread B's kernel; B frees on its per-thread stream and exits; this thread allocates.
  std::optional<long_use> b;
  on_new_thread([&] {
    CHILD_CUDA(cudaSetDevice(0));
    void* z = p.allocate(bytes, stream_ref::per_thread_default());
    b.emplace(start_long_use(z, bytes, 200, cudaStreamPerThread, c.slot(1)));
    p.deallocate(z, stream_ref::per_thread_default());
  });
  // This thread's per-thread stream is idle, and goes by the handle B freed on.
  (void)stream_ref::per_thread_default().query();
  stream_ref::per_thread_default().synchronize();
  void* y3 = p.allocate(bytes, stream_ref::per_thread_default());
  note("thread A after B exited, per-thread stream: %p (B freed %p)", y3, b->p);
  expect_not_reused_while_running(y3, bytes, *b, 7, "thread A's per-thread default stream, after thread B exited");
  owners.push_back(fill_new(y3, bytes, 210, cudaStreamPerThread));
  stream t(0);
  void* y4 = p.allocate(bytes, t);
  expect_not_reused_while_running(y4, bytes, *b, 8, "a new stream, after thread B exited");
  owners.push_back(fill_new(y4, bytes, 211, t.get()));
  expect_device_ok(9, "thread A allocated while exited thread B's kernel ran");
  expect_completed(*b, 10, "thread B's kernel");  // 10, 11
  expect_all_intact(owners, 12, "thread A's allocations");
  free_all(p, owners, t);
  t.synchronize();
}

CHILD_CASE(per_thread_default) {
  for (const config& cfg : configs(8 * MiB)) per_thread_default_in(cfg);
}

// A raw stream destroyed with a free pending behind its kernel: CUDA often hands the same
// handle to the next stream made, which is idle. Nothing about the new stream may release the
// old stream's free.
void raw_stream_destroyed_in(const config& cfg) {
  note("pool: %s", cfg.name);
  const std::size_t bytes = 8 * MiB;
  pool p(cfg.props);
  device_counters c(1);
  std::vector<owner> owners;
  cudaStream_t s = nullptr;
  CHILD_CUDA(cudaStreamCreate(&s));
  void* x = p.allocate(bytes, stream_ref{s});
  const long_use u = start_long_use(x, bytes, 300, s, c.slot(0));
  p.deallocate(x, stream_ref{s});
  CHILD_CUDA(cudaStreamDestroy(s));  // legal with work queued: the kernel runs on
  cudaStream_t s2 = nullptr;
  CHILD_CUDA(cudaStreamCreate(&s2));
  note("cudaStreamCreate after the destroy returned %s handle (%p, was %p)", s2 == s ? "the SAME" : "a different",
       static_cast<void*>(s2), static_cast<void*>(s));
  // The new stream is idle: everything it says about itself is true, and says nothing of x.
  (void)stream_ref{s2}.query();
  void* y1 = p.allocate(bytes, stream_ref{s2});
  note("on the new raw stream: %p (freed %p)", y1, x);
  expect_not_reused_while_running(y1, bytes, u, 1, "the new raw stream");
  owners.push_back(fill_new(y1, bytes, 310, s2));
  stream_ref{s2}.synchronize();
  void* y2 = p.allocate(bytes, stream_ref{s2});
  expect_not_reused_while_running(y2, bytes, u, 2, "the new raw stream after synchronizing it");
  owners.push_back(fill_new(y2, bytes, 311, s2));
  stream t(0);
  void* y3 = p.allocate(bytes, t);
  expect_not_reused_while_running(y3, bytes, u, 3, "a new streamalloc::stream");
  owners.push_back(fill_new(y3, bytes, 312, t.get()));
  expect_device_ok(4, "allocating on a stream that reuses a destroyed stream's handle");
  expect_completed(u, 5, "the destroyed stream's kernel");  // 5, 6
  expect_all_intact(owners, 7, "allocations made after the raw stream was destroyed");
  free_all(p, owners, t);
  t.synchronize();
  CHILD_CUDA(cudaStreamDestroy(s2));
}

CHILD_CASE(raw_stream_destroyed) {
  for (const config& cfg : configs(8 * MiB)) raw_stream_destroyed_in(cfg);
}

// Raw streams made, used and destroyed one after another (a server's per-request streams,
// CuPy's), and threads that each use their per-thread default stream and end, all while a
// destroyed stream's kernel still runs over memory freed behind it. CUDA never tells the pool
// that these streams are gone: none of them may be handed the running kernel's memory, the pool
// may not grow with every stream made (each stream's last frees used to wait in its cache for
// good), and what the library holds for them returns after a device-wide synchronization.
void stream_churn_in(const config& cfg) {
  note("pool: %s", cfg.name);
  const std::size_t bytes = 8 * MiB;
  pool p(cfg.props);
  device_counters c(1);
  constexpr int streams = 1000, sampled = streams / 100;
  // Sampled allocations are checked on their own streams into these counters, read at the end:
  // no call in the loop may wait for the device (or for the legacy stream, which waits for
  // the running kernel's blocking stream).
  unsigned long long* bad = nullptr;
  CHILD_CUDA(cudaMalloc(&bad, sampled * sizeof *bad));
  CHILD_CUDA(cudaMemset(bad, 0, sampled * sizeof *bad));
  const auto held_before = detail::ordering().census();
  cudaStream_t s0 = nullptr;
  CHILD_CUDA(cudaStreamCreate(&s0));
  void* x = p.allocate(bytes, stream_ref{s0});
  const long_use u = start_long_use(x, bytes, 2000, s0, c.slot(0), 4 * long_ns);
  p.deallocate(x, stream_ref{s0});
  CHILD_CUDA(cudaStreamDestroy(s0));  // legal with work queued: the kernel runs on

  // Part 1, what each stream does: 8 MiB and a small block, the 8 MiB filled by a kernel.
  int same_handle = 0, while_running = 0;
  for (int i = 0; i < streams; ++i) {
    cudaStream_t s = nullptr;
    CHILD_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    same_handle += s == s0 ? 1 : 0;
    const std::size_t small = 64 * KiB * static_cast<std::size_t>(1 + i % 4);
    void* y = p.allocate(bytes, stream_ref{s});
    void* z = p.allocate(small, stream_ref{s});
    while_running += u.running() ? 1 : 0;
    expect_not_reused_while_running(y, bytes, u, 1, strf("raw stream %d", i));
    expect_not_reused_while_running(z, small, u, 1, strf("raw stream %d, small", i));
    fill_async(y, bytes, 3000 + static_cast<std::uint32_t>(i), s);
    CHILD_LAUNCHED("fill_async");
    if (i % 100 == 0) check_async(y, bytes, 3000 + static_cast<std::uint32_t>(i), bad + i / 100, s);
    p.deallocate(z, stream_ref{s});
    p.deallocate(y, stream_ref{s});
    CHILD_CUDA(cudaStreamDestroy(s));
  }
  const std::size_t reserved_part1 = p.statistics().reserved_current;
  note("%d raw streams made and destroyed (%d got the first one's handle), %d of them while the long kernel ran; "
       "reserved %zu MiB",
       streams, same_handle, while_running, reserved_part1 / MiB);
  // Under compute-sanitizer kernels run one at a time and the long one is over before the
  // loop starts (0 streams); in a plain run 400 to 900 of them came while it ran.
  // Memory freed behind work that has not run cannot be reused (on the H100 the fills queued
  // behind the long kernel), so the pool grows with the work in flight, as any stream-ordered
  // pool must: about 8 MiB per stream that came while the kernel ran, not per stream made,
  // and not a whole chunk per stream (a raw stream's frees used to absorb the free rest of
  // their chunk, which then waited for their event too: 28 GiB here).
  CHILD_EXPECT(reserved_part1 <= (static_cast<std::size_t>(while_running) + 64) * 9 * MiB + 256 * MiB, 2,
               "the pool grew by more than the work in flight");

  // Part 2, the allocator alone (nothing queued on the streams): the pool may not grow with
  // every stream made (each stream's last frees used to wait in its cache for good, 8 GiB
  // here), and what the library holds for the streams stays bounded.
  std::size_t reserved_high = 0;
  const std::size_t reserved_start = p.statistics().reserved_current;
  for (int i = 0; i < streams; ++i) {
    cudaStream_t s = nullptr;
    CHILD_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    void* y = p.allocate(bytes, stream_ref{s});
    void* z = p.allocate(64 * KiB, stream_ref{s});
    expect_not_reused_while_running(y, bytes, u, 3, strf("raw stream %d of part 2", i));
    p.deallocate(z, stream_ref{s});
    p.deallocate(y, stream_ref{s});
    CHILD_CUDA(cudaStreamDestroy(s));
    reserved_high = std::max(reserved_high, p.statistics().reserved_current);
  }
  note("part 2: reserved %zu MiB before, at most %zu MiB during", reserved_start / MiB, reserved_high / MiB);
  CHILD_EXPECT(reserved_high <= reserved_start + 128 * MiB, 3, "the pool grew with every raw stream made and destroyed");

  // Threads that each use their per-thread default stream once, and end.
  for (int t = 0; t < 32; ++t) {
    on_new_thread([&] {
      CHILD_CUDA(cudaSetDevice(0));
      const stream_ref mine = stream_ref::per_thread_default();
      void* y = p.allocate(MiB, mine);
      expect_not_reused_while_running(y, MiB, u, 4, strf("thread %d's per-thread default stream", t));
      fill_async(y, MiB, 4000 + static_cast<std::uint32_t>(t), cudaStreamPerThread);
      CHILD_LAUNCHED("fill_async");
      p.deallocate(y, mine);
    });
  }
  expect_device_ok(5, "raw streams and threads coming and going while a destroyed stream's kernel ran");
  expect_completed(u, 6, "the destroyed stream's kernel");  // 6, 7
  unsigned long long h[sampled] = {};
  CHILD_CUDA(cudaMemcpy(h, bad, sizeof h, cudaMemcpyDeviceToHost));
  for (int k = 0; k < sampled; ++k) {
    CHILD_EXPECT(h[k] == 0, 11, strf("raw stream %d's allocation lost its data before its own free", 100 * k).c_str());
  }
  CHILD_CUDA(cudaFree(bad));
  p.synchronize();  // device-wide: what only it could prove complete returns
  const auto held_after = detail::ordering().census();
  note("ordering records %zu before, %zu after; raw handles known %zu before, %zu after", held_before.records,
       held_after.records, held_before.handles, held_after.handles);
  // CUDA hands out a few handle values over and over (6 for 1,000 streams on the H100): the
  // last stream met under each is known destroyed only when its handle comes back, so one
  // record per handle value stays, beside the thread's recent few.
  CHILD_EXPECT(held_after.handles <= held_before.handles + 64, 9, "every destroyed raw stream's handle stayed known");
  CHILD_EXPECT(held_after.records <= held_before.records + (held_after.handles - held_before.handles) +
                                         detail::recent_streams::size + 1,
               8, "the records of destroyed raw streams and ended threads stayed");
  CHILD_EXPECT(p.statistics().used_current == 0, 10, "live bytes left after every stream freed its own");
}

CHILD_CASE(stream_churn) {
  for (const config& cfg : configs(8 * MiB)) stream_churn_in(cfg);
}

// A moved-from stream: device() throws instead of reading freed state; the stream lives on in
// the object it moved to, also with a free pending behind its kernel.
CHILD_CASE(moved_from_stream) {
  const std::size_t bytes = 4 * MiB;
  stream a(0);
  stream b = std::move(a);
  expect_throws<std::logic_error>(1, "device() of a moved-from stream", [&] { (void)a.device(); });
  CHILD_EXPECT(a.get() == nullptr, 2, "a moved-from stream still has a handle");
  CHILD_EXPECT(b.device() == 0, 3, "the moved-to stream lost its device");
  pool p;
  void* x = p.allocate(bytes, b);
  fill_async(x, bytes, 600, b.get());
  CHILD_LAUNCHED("fill_async");
  CHILD_EXPECT(mismatches_on(x, bytes, 600, b.get()) == 0, 4, "the moved-to stream does not run work");
  p.deallocate(x, b);
  b.synchronize();
  a = std::move(b);
  CHILD_EXPECT(a.device() == 0, 5, "a stream moved back lost its device");
  expect_throws<std::logic_error>(6, "device() of a stream moved from again", [&] { (void)b.device(); });
  stream& alias = a;
  a = std::move(alias);  // self-move: keeps the stream
  CHILD_EXPECT(a.device() == 0, 7, "a self-moved stream lost its device");
  b = stream(0);
  CHILD_EXPECT(b.device() == 0, 8, "a moved-from stream given a new stream");

  // A free pending behind a kernel, the stream moved, then the new owner destroyed.
  device_counters c(1);
  stream t(0);
  std::vector<owner> owners;
  std::optional<long_use> u;
  {
    stream k(0);
    void* z = p.allocate(bytes, k);
    u.emplace(start_long_use(z, bytes, 610, k.get(), c.slot(0)));
    p.deallocate(z, k);
    stream moved = std::move(k);
    void* y = p.allocate(bytes, t);
    expect_not_reused_while_running(y, bytes, *u, 9, "after the kernel's stream was moved");
    owners.push_back(fill_new(y, bytes, 620, t.get()));
  }  // the stream is destroyed (once, through the object it moved to) while its kernel runs
  void* y2 = p.allocate(bytes, t);
  expect_not_reused_while_running(y2, bytes, *u, 10, "after the moved stream was destroyed");
  owners.push_back(fill_new(y2, bytes, 630, t.get()));
  expect_device_ok(11, "moving and destroying a stream with a free pending");
  expect_completed(*u, 12, "the moved stream's kernel");  // 12, 13
  expect_all_intact(owners, 14, "allocations after the move");
  free_all(p, owners, t);
  t.synchronize();
}

// A free on a stream of another device (ordered after the kernel, through an event): either
// refused with std::invalid_argument (the pointer stays live and frees on its own device), or
// accepted; either way the memory is not reused on device 0 while the kernel runs.
CHILD_CASE(other_device_free) {
  if (device_count() < 2) {
    note("skipped: one device, no stream of another device to free on");
    return;
  }
  const std::size_t bytes = 8 * MiB;
  pool p;
  stream s0(0), t0(0), s1(1);
  device_counters c(1);
  expect_throws<std::invalid_argument>(1, "allocate from device 0's pool on a device 1 stream",
                                       [&] { (void)p.allocate(bytes, s1); });
  void* x = p.allocate(bytes, s0);
  const long_use u = start_long_use(x, bytes, 700, s0.get(), c.slot(0));
  (void)order_after(s1, s0);  // s1 now runs after the kernel: freeing there is ordered correctly
  try {
    p.deallocate(x, s1);
    note("deallocate on a device 1 stream was accepted");
  } catch (const std::invalid_argument& e) {
    note("deallocate on a device 1 stream was refused: %s", e.what());
    p.deallocate(x, s0);
  } catch (const std::exception& e) {
    fail(2, strf("deallocate on a device 1 stream threw \"%s\", not std::invalid_argument", e.what()));
  }
  void* y = p.allocate(bytes, t0);
  expect_not_reused_while_running(y, bytes, u, 3, "device 0, after a free on device 1");
  const owner o = fill_new(y, bytes, 710, t0.get());
  CHILD_CUDA(cudaSetDevice(1));
  expect_device_ok(4, "freeing on another device's stream (device 1)");
  CHILD_CUDA(cudaSetDevice(0));
  expect_device_ok(5, "freeing on another device's stream (device 0)");
  expect_completed(u, 6, "the kernel on device 0");  // 6, 7
  expect_intact(o, 8, "the allocation after the cross-device free");
  p.deallocate(y, t0);
  t0.synchronize();
}

// Many streams, each with a kernel and a free pending behind it, destroyed at once; new
// streams (whose handles are often the old ones) allocate, synchronize, allocate again.
void many_streams_in(const config& cfg) {
  note("pool: %s", cfg.name);
  constexpr int count = 64;
  const std::size_t bytes = 2 * MiB;
  pool p(cfg.props);
  device_counters c(count);
  std::vector<long_use> uses;
  uses.reserve(count);
  std::vector<cudaStream_t> old_handles;
  {
    std::vector<stream> old;
    old.reserve(count);
    for (int i = 0; i < count; ++i) old.emplace_back(0);
    for (int i = 0; i < count; ++i) {
      void* x = p.allocate(bytes, old[i]);
      // Few blocks each: all 64 kernels fit on the device at once.
      uses.push_back(start_long_use(x, bytes, 1000 + 10 * i, old[i].get(), c.slot(i), long_ns, 4));
      p.deallocate(x, old[i]);
      old_handles.push_back(old[i].get());
    }
  }  // all destroyed, their kernels running and their frees pending
  std::vector<stream> fresh;
  fresh.reserve(count);
  int reused_handles = 0;
  for (int j = 0; j < count; ++j) {
    fresh.emplace_back(0);
    for (cudaStream_t h : old_handles) reused_handles += fresh.back().get() == h ? 1 : 0;
  }
  note("%d of %d new streams got a destroyed stream's handle", reused_handles, count);
  std::vector<owner> owners;
  const auto allocate_round = [&](int round, int code) {
    for (int j = 0; j < count; ++j) {
      void* y = p.allocate(bytes, fresh[j]);
      for (const long_use& u : uses) {
        expect_not_reused_while_running(y, bytes, u, code, strf("round %d, new stream %d", round, j));
      }
      owners.push_back(fill_new(y, bytes, 5000 + 100 * round + j, fresh[j].get()));
    }
  };
  allocate_round(0, 1);
  // Synchronization points while the old frees are pending: the pool settles and releases.
  for (stream& t : fresh) t.synchronize();
  int running = 0;
  for (const long_use& u : uses) running += u.running() ? 1 : 0;
  note("%d of %d old kernels still running before the second round", running, count);
  allocate_round(1, 2);
  expect_device_ok(3, "destroying 64 streams with frees pending behind running kernels");
  for (const long_use& u : uses) expect_completed(u, 4, "a destroyed stream's kernel");  // 4, 5
  expect_all_intact(owners, 6, "allocations on new streams");
  free_all(p, owners, fresh[0]);
  fresh[0].synchronize();
}

CHILD_CASE(many_streams) {
  for (const config& cfg : configs(2 * MiB)) many_streams_in(cfg);
}

// Eight threads, each with long kernels on its own per-thread default stream, freeing there
// and allocating again on that stream (which may reuse at once) and on a side stream (which may
// not while the kernel runs); no thread may get memory another thread's running kernel uses.
void threads_in(const config& cfg) {
  note("pool: %s", cfg.name);
  constexpr int n_threads = 8, rounds = 2, per_round = 3;
  constexpr unsigned long long spin_ns = 100'000'000;  // three in a row per stream and round
  const std::size_t bytes = 2 * MiB;
  pool p(cfg.props);
  device_counters c(n_threads * rounds * per_round);

  struct in_flight {
    const void* p;
    cudaEvent_t done;
    int thread;
  };
  std::mutex registry_mutex;
  std::vector<in_flight> registry;
  std::vector<std::vector<long_use>> uses(n_threads);
  std::vector<std::vector<owner>> owned(n_threads);
  std::vector<int> codes(n_threads, 0);

  // New memory `q` of thread `me`, on a stream not ordered after any kernel of another thread
  // (nor after its own, when `own_too`), must not overlap a buffer whose kernel still runs.
  const auto check = [&](const void* q, int me, bool own_too, int code, const char* where) {
    std::vector<in_flight> now;
    {
      std::lock_guard lock(registry_mutex);
      now = registry;
    }
    for (const in_flight& e : now) {
      if (e.thread == me && !own_too) continue;
      if (overlaps(q, bytes, e.p, bytes) && still_running(e.done)) {
        fail(code, strf("thread %d, %s: got %p, overlapping %p freed by thread %d behind a kernel still running", me,
                        where, q, e.p, e.thread));
      }
    }
  };

  std::vector<std::thread> threads;
  for (int i = 0; i < n_threads; ++i) {
    threads.emplace_back([&, i] {
      codes[i] = guarded([&] {
        CHILD_CUDA(cudaSetDevice(0));
        const stream_ref mine = stream_ref::per_thread_default();
        stream side(0);
        uses[i].reserve(rounds * per_round);
        for (int r = 0; r < rounds; ++r) {
          for (int k = 0; k < per_round; ++k) {
            const int idx = (i * rounds + r) * per_round + k;
            const auto seed = static_cast<std::uint32_t>(20000 + 10 * idx);
            void* x = p.allocate(bytes, mine);
            uses[i].push_back(start_long_use(x, bytes, seed, cudaStreamPerThread, c.slot(idx), spin_ns, 4));
            {
              std::lock_guard lock(registry_mutex);
              registry.push_back({x, uses[i].back().done.get(), i});
            }
            p.deallocate(x, mine);
            // The same stream may take x's memory at once: stream order puts its fill after the kernel.
            void* z = p.allocate(bytes, mine);
            check(z, i, false, 1, "its per-thread default stream");
            owned[i].push_back(fill_new(z, bytes, seed + 3, cudaStreamPerThread));
            void* y = p.allocate(bytes, side);
            check(y, i, true, 2, "its side stream");
            owned[i].push_back(fill_new(y, bytes, seed + 5, side.get()));
          }
          // The host waits for this thread's streams: its frees become reusable by every stream,
          // the other threads' stay pending.
          mine.synchronize();
          side.synchronize();
        }
      });
    });
  }
  for (std::thread& t : threads) t.join();
  for (int code : codes) {
    if (code != 0) throw check_failed{code};
  }
  expect_device_ok(3, "eight threads allocating while each other's kernels ran");
  for (const auto& list : uses) {
    for (const long_use& u : list) expect_completed(u, 4, "a thread's kernel");  // 4, 5
  }
  stream fin(0);
  for (auto& list : owned) {
    expect_all_intact(list, 6, "a thread's allocations");
    free_all(p, list, fin);
  }
  fin.synchronize();
}

CHILD_CASE(threads) {
  for (const config& cfg : configs(2 * MiB)) threads_in(cfg);
}

// The control: reuse that IS ordered (the other stream waited for an event recorded after the
// free) may take the memory while the kernel runs, and everyone's data stays right. Shows that
// the checks of the other cases flag only what is wrong.
CHILD_CASE(event_ordered_reuse) {
  const std::size_t bytes = 8 * MiB;
  for (const config& cfg : configs(bytes)) {
    note("pool: %s", cfg.name);
    pool p(cfg.props);
    stream s(0), t(0);
    device_counters c(1);
    void* x = p.allocate(bytes, s);
    const long_use u = start_long_use(x, bytes, 1600, s.get(), c.slot(0));
    p.deallocate(x, s);
    event e;
    e.record(s);
    (void)t.wait(e);
    void* y = p.allocate(bytes, t);
    const bool running = u.running();
    note("after waiting for the free, another stream got %p (freed %p)%s", y, x,
         overlaps(y, bytes, x, bytes) && running ? ": reused while the kernel runs, as ordered" : "");
    const owner o = fill_new(y, bytes, 1610, t.get());
    expect_device_ok(1, "ordered reuse");
    expect_completed(u, 2, "the kernel before the free");  // 2, 3
    expect_intact(o, 4, "the allocation ordered after the free");
    p.deallocate(y, t);
    t.synchronize();
  }
}

}  // namespace

TEST_CASE("lifetime: per_thread_default: another thread's idle per-thread stream proves nothing") {
  expect_child_passes("per_thread_default");
}
TEST_CASE("lifetime: raw_stream_destroyed: a new stream with the destroyed stream's handle proves nothing") {
  expect_child_passes("raw_stream_destroyed");
}
TEST_CASE("lifetime: stream_churn: raw streams and threads come and go behind a running kernel, at bounded cost") {
  expect_child_passes("stream_churn");
}
TEST_CASE("lifetime: moved_from_stream: device() throws, the moved stream keeps its frees ordered") {
  expect_child_passes("moved_from_stream");
}
TEST_CASE("lifetime: other_device_free: a free on another device's stream (two GPUs)") {
  expect_child_passes("other_device_free");
}
TEST_CASE("lifetime: many_streams: 64 streams destroyed with frees pending behind running kernels") {
  expect_child_passes("many_streams");
}
TEST_CASE("lifetime: threads: eight threads on their per-thread streams never share running memory") {
  expect_child_passes("threads");
}
TEST_CASE("lifetime: event_ordered_reuse (control): ordered reuse keeps every buffer's data") {
  expect_child_passes("event_ordered_reuse");
}
