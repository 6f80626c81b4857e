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

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "child_process.hpp"
#include "gpu_kernels.cuh"
#include "gpu_support.hpp"
#include "lifetime_checks.cuh"

#include <cuda_runtime.h>

#include <cstddef>
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

}  // namespace

TEST_CASE("lifetime: captured_fork_join: a fork and join captured after a free proves no order to the pools") {
  expect_child_passes("captured_fork_join");
}
