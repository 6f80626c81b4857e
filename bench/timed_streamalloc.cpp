// For bench/pytorch_end_to_end.py: streamalloc behind PyTorch's CUDAPluggableAllocator with a
// clock around each call, so that a step's time inside streamalloc is measured in the real
// process (the trace replay measures it with warm caches and `stream`s; beside the control
// allocator, PyTorch's steps took 1 to 2.6 ms more with streamalloc than the replay accounts
// for). Forwards to libstreamalloc_c's streamalloc_torch_malloc and streamalloc_free; adds two
// steady_clock reads and two relaxed atomic adds to each call (some 40 to 60 ns), which the
// figures include. An exception from the allocation (out of memory) is not timed.

#include <streamalloc/c_api.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace {

std::atomic<std::uint64_t> calls{0}, nanoseconds{0};

struct timed {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  void done() const {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start);
    nanoseconds.fetch_add(static_cast<std::uint64_t>(ns.count()), std::memory_order_relaxed);
    calls.fetch_add(1, std::memory_order_relaxed);
  }
};

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* timed_torch_malloc(std::size_t size, int device, streamalloc_stream stream) {
  const timed t;
  void* p = streamalloc_torch_malloc(size, device, stream);
  t.done();
  return p;
}

__attribute__((visibility("default"))) void timed_torch_free(void* p, std::size_t size, int device, streamalloc_stream stream) {
  const timed t;
  streamalloc_free(p, size, device, stream);
  t.done();
}

/// The calls made and the nanoseconds spent in them so far, from any thread.
__attribute__((visibility("default"))) void timed_totals(std::uint64_t* calls_out, std::uint64_t* nanoseconds_out) {
  *calls_out = calls.load(std::memory_order_relaxed);
  *nanoseconds_out = nanoseconds.load(std::memory_order_relaxed);
}

}  // extern "C"
