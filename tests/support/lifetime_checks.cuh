#pragma once

// Checks for the lifetime tests: memory must never be reused, remapped or unmapped while a
// kernel ordered before its free still runs, whatever the program does meanwhile.
//
// The technique: a kernel holds its stream for a few hundred milliseconds, then checks that its
// buffer still holds the pattern written before it and writes a new one (slow_check_fill_kernel,
// started by start_long_use). While it runs, the host frees the buffer on that kernel's stream,
// does the hostile thing, then allocates the same size on streams that are NOT ordered after the
// kernel and fills what it got (fill_new). Afterwards:
//   - an allocation overlapping the freed buffer while the kernel's "done" event is still not
//     complete is the bug itself (the event is queried after the allocation returned, so "still
//     running" then means it was running when the pool handed the memory out);
//     expect_not_reused_while_running;
//   - the kernel must have seen its own pattern and visited every word (nobody wrote over it):
//     expect_completed;
//   - each new owner must still hold its own pattern (the old kernel did not write over it):
//     expect_intact;
//   - the device must synchronize without an error (nothing was unmapped under the kernel):
//     expect_device_ok.
//
// The checks fail through child_process.hpp's `fail`: each case runs in a child process.

#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include "child_process.hpp"
#include "gpu_kernels.cuh"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

static_assert(STREAMALLOC_CHECK_ORDERING == 1, "the GPU tests exercise the run-time ordering checks");

namespace streamalloc_test {

// How long a "long" kernel holds its stream: long enough that everything the host does in the
// window (frees, destroying streams and pools, other threads' allocations) happens while it
// runs, even on a slow host; short enough that the whole suite takes seconds.
inline constexpr unsigned long long long_ns = 250'000'000;

// --- observing kernels without telling the pool anything ---------------------------------------

/// True while the work before `e` has not finished. A raw event: the pool never sees it, so the
/// test only observes and never hands the pool evidence of order.
inline bool still_running(cudaEvent_t e) {
  const cudaError_t r = cudaEventQuery(e);
  if (r == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not ready" is no error: keep it out of the next launch check
    return true;
  }
  CHILD_CUDA(r);
  return false;
}

class probe_event {
 public:
  probe_event() { CHILD_CUDA(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming)); }
  probe_event(probe_event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  probe_event& operator=(probe_event&&) = delete;
  probe_event(const probe_event&) = delete;
  probe_event& operator=(const probe_event&) = delete;
  ~probe_event() {
    if (e_ != nullptr) (void)cudaEventDestroy(e_);
  }
  [[nodiscard]] cudaEvent_t get() const noexcept { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

/// Counters of a case's long kernels, two words each, made before any of them starts: cudaMalloc
/// and cudaFree may synchronize the device, which would close the window a case needs open.
class device_counters {
 public:
  explicit device_counters(std::size_t kernels) {
    CHILD_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_), 2 * kernels * sizeof *d_));
    CHILD_CUDA(cudaMemset(d_, 0, 2 * kernels * sizeof *d_));
    CHILD_CUDA(cudaDeviceSynchronize());
  }
  device_counters(const device_counters&) = delete;
  device_counters& operator=(const device_counters&) = delete;
  ~device_counters() { (void)cudaFree(d_); }
  [[nodiscard]] unsigned long long* slot(std::size_t i) const noexcept { return d_ + 2 * i; }

 private:
  unsigned long long* d_ = nullptr;
};

/// A buffer under a long kernel: filled with `seed`'s pattern, then held by
/// slow_check_fill_kernel, which checks it and writes `seed + 1`'s. `done` completes when the
/// kernel has finished.
struct long_use {
  void* p = nullptr;
  std::size_t bytes = 0;
  std::uint32_t seed = 0;
  unsigned long long* counters = nullptr;
  probe_event done;

  [[nodiscard]] bool running() const { return still_running(done.get()); }
};

inline long_use start_long_use(void* p, std::size_t bytes, std::uint32_t seed, cudaStream_t s,
                               unsigned long long* counters, unsigned long long ns = long_ns, unsigned blocks = 32) {
  long_use u;
  u.p = p;
  u.bytes = bytes;
  u.seed = seed;
  u.counters = counters;
  fill_async(p, bytes, seed, s);
  CHILD_LAUNCHED("fill_async");
  slow_check_fill_kernel<<<blocks, 256, 0, s>>>(static_cast<std::uint32_t*>(p), bytes / 4, seed, seed + 1, ns,
                                                counters);
  CHILD_LAUNCHED("slow_check_fill_kernel");
  CHILD_CUDA(cudaEventRecord(u.done.get(), s));
  return u;
}

// --- the checks ----------------------------------------------------------------------------------

/// The heart of every case. `q` (`bytes` long) was just allocated on a stream that is not
/// ordered after `u`'s kernel. Overlap with `u`'s memory is allowed once that kernel has finished
/// (its free has executed, and the pool may have learnt so), never while it still runs.
inline void expect_not_reused_while_running(const void* q, std::size_t bytes, const long_use& u, int code,
                                            const std::string& where) {
  if (!overlaps(q, bytes, u.p, u.bytes)) return;
  if (!u.running()) {
    note("%s: %p reuses the freed %p after its kernel finished (allowed)", where.c_str(), q, u.p);
    return;
  }
  fail(code, strf("%s: got %p%s, overlapping the %zu bytes at %p freed behind a kernel that is still running",
                  where.c_str(), q, q == u.p ? " (the same address)" : "", u.bytes, u.p));
}

/// The device ran everything without a fault: nothing was unmapped or remapped under a kernel.
inline void expect_device_ok(int code, const char* after) {
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    fail(code, strf("cudaDeviceSynchronize after %s: %s (%s): a kernel faulted, so memory it used was unmapped or "
                    "remapped under it (or the context is lost)",
                    after, cudaGetErrorName(e), cudaGetErrorString(e)));
  }
}

/// After the device synchronized: the long kernel saw its own data (fails with `code`) and ran
/// over every word (fails with `code + 1`).
inline void expect_completed(const long_use& u, int code, const char* what) {
  unsigned long long h[2] = {~0ULL, ~0ULL};
  CHILD_CUDA(cudaMemcpy(h, u.counters, sizeof h, cudaMemcpyDeviceToHost));
  if (h[0] != 0) {
    fail(code, strf("%s: the kernel ordered before the free of %p found %llu of %zu words overwritten while it "
                    "ran: the memory was given to someone else",
                    what, u.p, h[0], u.bytes / 4));
  }
  if (h[1] != u.bytes / 4) {
    fail(code + 1, strf("%s: the kernel over %p visited %llu of %zu words: it did not run to the end", what, u.p,
                        h[1], u.bytes / 4));
  }
}

/// Memory a case allocated while a long kernel ran, and the pattern it wrote there.
struct owner {
  void* p = nullptr;
  std::size_t bytes = 0;
  std::uint32_t seed = 0;
};

inline owner fill_new(void* p, std::size_t bytes, std::uint32_t seed, cudaStream_t s) {
  fill_async(p, bytes, seed, s);
  CHILD_LAUNCHED("fill_async");
  return {p, bytes, seed};
}

/// After the device synchronized: the new owner still holds its pattern.
inline void expect_intact(const owner& o, int code, const char* what) {
  const unsigned long long bad = mismatches(o.p, o.bytes, o.seed);
  if (bad == ~0ULL) fail(code_cuda, strf("%s: checking %p failed (a CUDA error)", what, o.p));
  if (bad != 0) {
    fail(code, strf("%s: %llu of %zu words of the new allocation %p lost their pattern: a kernel ordered before an "
                    "earlier free wrote over them",
                    what, bad, o.bytes / 4, o.p));
  }
}

inline void expect_all_intact(const std::vector<owner>& owners, int code, const char* what) {
  for (const owner& o : owners) expect_intact(o, code, what);
}

/// Frees what a case allocated, once the device has synchronized (so any stream will do).
inline void free_all(streamalloc::pool& p, std::vector<owner>& owners, streamalloc::stream_ref s) {
  for (const owner& o : owners) p.deallocate(o.p, s);
  owners.clear();
}

// --- pool setups ---------------------------------------------------------------------------------

/// The pool properties each stream-order case runs under.
struct config {
  const char* name;
  streamalloc::pool_properties props;
};

inline std::vector<config> configs(std::size_t bytes) {
  const std::size_t g = streamalloc::allocation_granularity(streamalloc::memory_location::device(0));
  // Default properties: the freed block shares a 64 MiB chunk with clear free memory (which it
  // absorbs into its stream's pending bins), and every synchronization point gives back what is
  // clear (release threshold 0), so releasing is exercised too.
  // One chunk per allocation, nothing released: the freed block is the only free memory of its
  // size, the first candidate of a pool that wrongly believes its free has executed.
  streamalloc::pool_properties exact;
  exact.chunk_size = (bytes + g - 1) / g * g;
  exact.release_threshold = SIZE_MAX;
  return {{"default properties", streamalloc::pool_properties{}},
          {"one chunk per allocation, nothing released", exact}};
}

}  // namespace streamalloc_test
