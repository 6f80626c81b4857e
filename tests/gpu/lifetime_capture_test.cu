// Lifetimes and stream capture: work captured into a graph runs when the graph is launched, in
// no order with the streams it was captured from. An event recorded, or a wait made, through
// streamalloc while a stream is captured therefore proves nothing about real work: memory freed
// on a stream behind a running kernel must not be handed to another stream merely because that
// stream joined a capture forked from the freeing stream after the free. (The control, an
// ordered hand-off outside any capture that may reuse the memory, is lifetime_streams'
// event_ordered_reuse.)
//
// Each case is a child process (child_process.hpp) checked with lifetime_checks.cuh, whose
// opening comment describes the technique.

#include <streamalloc/captured_graph.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "child_process.hpp"
#include "gpu_kernels.cuh"
#include "gpu_support.hpp"
#include "lifetime_checks.cuh"

#include <cuda_runtime.h>

#include <chrono>
#include <cstddef>
#include <optional>
#include <thread>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

namespace {

/// Ends the capture of `s`, which must succeed (streamalloc's calls must not have invalidated
/// it), and destroys the graph: it is never launched.
void end_and_discard(cudaStream_t s) {
  cudaGraph_t g = nullptr;
  CHILD_CUDA(cudaStreamEndCapture(s, &g));
  CHILD_CUDA(cudaGraphDestroy(g));
}

// Freed on `s` behind a long kernel; then `s` is captured in global mode, and the capture forks
// to `t` and joins back through streamalloc events (owned streams) or order_after (raw streams
// resolved before the capture). `t` is idle and ordered after nothing of `s` in real time.
void captured_fork_join_in(const config& cfg) {
  note("pool: %s", cfg.name);
  const std::size_t bytes = 8 * MiB;
  pool p(cfg.props);
  device_counters c(2);
  std::vector<owner> owners;

  stream s(0), t(0);
  void* x = p.allocate(bytes, s);
  const long_use a = start_long_use(x, bytes, 1700, s.get(), c.slot(0));
  p.deallocate(x, s);
  event fork, join;
  CHILD_CUDA(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  fork.record(s);
  (void)t.wait(fork);  // t joins the capture
  join.record(t);
  (void)s.wait(join);
  end_and_discard(s.get());
  void* y1 = p.allocate(bytes, t);
  note("after a captured fork and join through events, the joined stream got %p (freed %p)", y1, x);
  expect_not_reused_while_running(y1, bytes, a, 1, "a stream that joined a capture through a streamalloc event");
  owners.push_back(fill_new(y1, bytes, 1710, t.get()));

  cudaStream_t raw_s = nullptr, raw_t = nullptr;
  CHILD_CUDA(cudaStreamCreateWithFlags(&raw_s, cudaStreamNonBlocking));
  CHILD_CUDA(cudaStreamCreateWithFlags(&raw_t, cudaStreamNonBlocking));
  const stream_ref rs = stream_ref{raw_s}.resolved(), rt = stream_ref{raw_t}.resolved();
  void* z = p.allocate(bytes, rs);
  const long_use b = start_long_use(z, bytes, 1800, raw_s, c.slot(1));
  p.deallocate(z, rs);
  CHILD_CUDA(cudaStreamBeginCapture(raw_s, cudaStreamCaptureModeGlobal));
  (void)order_after(rt, rs);  // the fork: raw_t joins
  (void)order_after(rs, rt);  // the join
  end_and_discard(raw_s);
  void* y2 = p.allocate(bytes, rt);
  note("after a captured fork and join through order_after, the joined stream got %p (freed %p)", y2, z);
  expect_not_reused_while_running(y2, bytes, b, 2, "a raw stream that joined a capture through order_after");
  owners.push_back(fill_new(y2, bytes, 1810, raw_t));

  expect_device_ok(3, "allocating on streams that joined captures forked after a free");
  expect_completed(a, 4, "the kernel before the free on the owned stream");  // 4, 5
  expect_completed(b, 6, "the kernel before the free on the raw stream");    // 6, 7
  expect_all_intact(owners, 8, "the joined streams' allocations");
  free_all(p, owners, t);
  t.synchronize();
  CHILD_CUDA(cudaStreamDestroy(raw_s));
  CHILD_CUDA(cudaStreamDestroy(raw_t));
}

CHILD_CASE(captured_fork_join) {
  for (const config& cfg : configs(8 * MiB)) captured_fork_join_in(cfg);
}

/// The code of the cuda_error `f` throws; fails `code` when it throws none or another kind.
template <class F>
CUresult cuda_error_code(int code, const char* call, F&& f) {
  try {
    f();
  } catch (const cuda_error& e) {
    note("%s threw: %s", call, e.what());
    return e.code();
  } catch (const std::exception& e) {
    fail(code, strf("%s threw \"%s\", not a streamalloc::cuda_error", call, e.what()));
  }
  fail(code, strf("%s did not throw", call));
}

// Captures that end without a graph, with kernels still running on memory the capture freed:
// a `stream` and a raw stream destroyed in the middle of their captures (the driver ends the
// capture and destroys its graph), a capture invalidated and ended by end_capture, and a
// capture a joined stream left by being destroyed. The memory allocated outside and freed
// inside each capture is under a long kernel enqueued before the capture began: no other
// stream may get it while that kernel runs; the graph's own memory comes back; the
// allocations a capture left live become ordinary ones.
void destroyed_while_captured_in(const config& cfg) {
  note("pool: %s", cfg.name);
  const std::size_t bytes = 8 * MiB;
  pool p(cfg.props);
  device_counters c(3);
  std::vector<owner> owners;
  stream t(0);
  const auto lend_and_check = [&](const long_use& u, int code, const char* where) {
    for (int i = 0; i < 3; ++i) {
      void* q = p.allocate(bytes, t);
      expect_not_reused_while_running(q, bytes, u, code, where);
      owners.push_back(fill_new(q, bytes, 2000 + static_cast<std::uint32_t>(owners.size()), t.get()));
    }
  };

  // A `stream` destroyed in the middle of its capture.
  std::optional<stream> s(std::in_place, 0);
  void* x = p.allocate(bytes, *s);
  const long_use a = start_long_use(x, bytes, 1900, s->get(), c.slot(0));
  CHILD_CUDA(cudaStreamBeginCapture(s->get(), cudaStreamCaptureModeGlobal));
  void* kept_s = p.allocate(bytes, *s);  // left live by the capture
  p.deallocate(p.allocate(bytes, *s), *s);
  p.deallocate(x, *s);  // allocated outside, freed inside
  s.reset();  // the driver ends the capture and destroys its graph
  lend_and_check(a, 2, "after a stream was destroyed while captured");

  // A raw stream destroyed likewise.
  cudaStream_t raw = nullptr;
  CHILD_CUDA(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  void* z = p.allocate(bytes, stream_ref{raw});
  const long_use b = start_long_use(z, bytes, 1920, raw, c.slot(1));
  CHILD_CUDA(cudaStreamBeginCapture(raw, cudaStreamCaptureModeGlobal));
  void* kept_raw = p.allocate(bytes, stream_ref{raw});
  p.deallocate(z, stream_ref{raw});
  CHILD_CUDA(cudaStreamDestroy(raw));
  lend_and_check(b, 3, "after a raw stream was destroyed while captured");

  // A capture invalidated by an illegal call, ended by end_capture: the stream is usable again.
  stream u(0);
  void* w = p.allocate(bytes, u);
  const long_use d = start_long_use(w, bytes, 1940, u.get(), c.slot(2));
  CHILD_CUDA(cudaStreamBeginCapture(u.get(), cudaStreamCaptureModeGlobal));
  void* kept_u = p.allocate(bytes, u);
  p.deallocate(w, u);
  CHILD_EXPECT(cudaStreamQuery(u.get()) != cudaSuccess, 4, "a query of a capturing stream is refused");
  (void)cudaGetLastError();
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  CHILD_CUDA(cudaStreamIsCapturing(u.get(), &status));
  CHILD_EXPECT(status == cudaStreamCaptureStatusInvalidated, 24, "the query invalidated the capture");
  CHILD_EXPECT(cuda_error_code(5, "end_capture of an invalidated capture", [&] { (void)end_capture(u); }) ==
                   CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
               6, "end_capture reports the invalidation");
  CHILD_CUDA(cudaStreamIsCapturing(u.get(), &status));
  CHILD_EXPECT(status == cudaStreamCaptureStatusNone, 7, "end_capture ended the invalidated capture");
  lend_and_check(d, 8, "after end_capture of an invalidated capture");
  void* again = p.allocate(bytes, u);  // the stream is usable again
  owners.push_back(fill_new(again, bytes, 2100, u.get()));

  // A stream that joined a capture destroyed before it ended: no graph, and end_capture says so.
  // (Relaxed mode, as measured on an H200: the destroy succeeds and the capture goes on.)
  stream origin(0);
  std::optional<stream> joined(std::in_place, 0);
  CHILD_CUDA(cudaStreamBeginCapture(origin.get(), cudaStreamCaptureModeRelaxed));
  event fork;
  fork.record(origin);
  (void)joined->wait(fork);
  void* kept_origin = p.allocate(bytes, origin);
  p.deallocate(p.allocate(bytes, *joined), *joined);
  joined.reset();
  CHILD_CUDA(cudaStreamIsCapturing(origin.get(), &status));
  CHILD_EXPECT(status == cudaStreamCaptureStatusActive, 25, "the capture goes on after a joined stream was destroyed");
  CHILD_EXPECT(cuda_error_code(9, "end_capture after a joined stream was destroyed", [&] { (void)end_capture(origin); }) ==
                   CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
               10, "end_capture reports the capture ended without a graph");
  CHILD_CUDA(cudaStreamIsCapturing(origin.get(), &status));
  CHILD_EXPECT(status == cudaStreamCaptureStatusNone, 11, "the capture ended");

  expect_device_ok(12, "captures ended without a graph");
  expect_completed(a, 13, "the kernel under the memory the destroyed stream's capture freed");  // 13, 14
  expect_completed(b, 15, "the kernel under the memory the raw stream's capture freed");        // 15, 16
  expect_completed(d, 17, "the kernel under the memory the invalidated capture freed");         // 17, 18
  expect_all_intact(owners, 19, "the allocations made meanwhile");
  free_all(p, owners, t);
  // What the captures left live is live: freed as any allocation; then nothing is left.
  for (void* k : {kept_s, kept_raw, kept_u, kept_origin}) p.deallocate(k, t);
  t.synchronize();
  p.synchronize();
  for (int i = 0; i < 50 && p.statistics().graphs != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const pool_statistics end = p.statistics();
  CHILD_EXPECT(end.graphs == 0, 20, strf("no graph left (%zu)", static_cast<std::size_t>(end.graphs)));
  CHILD_EXPECT(end.graph_reserved_current == 0, 21, "no graph memory left");
  CHILD_EXPECT(end.live_allocations == 0, 22, strf("nothing live (%zu)", static_cast<std::size_t>(end.live_allocations)));
  CHILD_EXPECT(end.used_current == 0, 23, "no bytes in use");
  CHILD_EXPECT(end.free_pending == 0, 26, strf("nothing awaiting proof (%zu bytes)", static_cast<std::size_t>(end.free_pending)));
}

CHILD_CASE(destroyed_while_captured) {
  for (const config& cfg : configs(8 * MiB)) destroyed_while_captured_in(cfg);
}

}  // namespace

TEST_CASE("lifetime: destroyed_while_captured: captures that end without a graph give back their memory, none early") {
  expect_child_passes("destroyed_while_captured");
}

TEST_CASE("lifetime: captured_fork_join: a fork and join captured after a free proves no order to the pools") {
  expect_child_passes("captured_fork_join");
}
