// For bench/pytorch_end_to_end.py: streamalloc behind PyTorch's CUDAPluggableAllocator with a
// clock around each call, so that a step's time inside streamalloc is measured in the real
// process (the trace replay measures it with warm caches and `stream`s; beside the control
// allocator, PyTorch's steps took 1 to 2.6 ms more with streamalloc than the replay accounts
// for). Forwards to libstreamalloc_c's streamalloc_torch_malloc and streamalloc_free; adds two
// steady_clock reads and a few relaxed atomic adds to each call (some 40 to 60 ns), which the
// figures include. An exception from the allocation (out of memory) is not timed.
//
// Besides the totals it keeps, for allocations and frees apart, how the calls' times are
// spread (powers of two), and it offers probes that the script runs in the same process after
// the steps: one call of a kind timed on its own, again and again, with the CPU's caches warm
// or with a buffer written over between calls (as the launches between two allocations of a
// step do), so the time a call takes in the steps can be told apart into what the work costs
// and what cold caches add.

#include <streamalloc/c_api.h>

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
constexpr int bucket_count = 32;  // bucket b: calls of at least 2^(b-1) ns and under 2^b ns

struct kind_counters {
  std::atomic<std::uint64_t> calls{0}, nanoseconds{0};
  std::atomic<std::uint64_t> buckets[bucket_count]{};
  std::atomic<std::uint64_t> bucket_nanoseconds[bucket_count]{};  // the time of each bucket's calls
};
kind_counters kinds[2];  // 0: allocations, 1: frees

std::uint64_t since(clock_type::time_point start) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now() - start).count());
}

struct timed {
  int kind;
  clock_type::time_point start = clock_type::now();
  void done() const {
    const std::uint64_t ns = since(start);
    kind_counters& k = kinds[kind];
    k.nanoseconds.fetch_add(ns, std::memory_order_relaxed);
    k.calls.fetch_add(1, std::memory_order_relaxed);
    const int b = std::min<int>(bucket_count - 1, std::bit_width(ns));
    k.buckets[b].fetch_add(1, std::memory_order_relaxed);
    k.bucket_nanoseconds[b].fetch_add(ns, std::memory_order_relaxed);
  }
};

// The probes' view of the driver: looked up in the libcuda the process has already loaded.
template <class F>
F driver_function(const char* name) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  return lib != nullptr ? reinterpret_cast<F>(dlsym(lib, name)) : nullptr;
}

// Writing one byte in each line of `bytes`: what was cached before is evicted from every level
// smaller than it.
void evict(std::vector<unsigned char>& buffer) {
  for (std::size_t i = 0; i < buffer.size(); i += 64) buffer[i] = static_cast<unsigned char>(buffer[i] + 1);
  std::atomic_signal_fence(std::memory_order_seq_cst);
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* timed_torch_malloc(std::size_t size, int device, streamalloc_stream stream) {
  const timed t{0};
  void* p = streamalloc_torch_malloc(size, device, stream);
  t.done();
  return p;
}

__attribute__((visibility("default"))) void timed_torch_free(void* p, std::size_t size, int device, streamalloc_stream stream) {
  const timed t{1};
  streamalloc_free(p, size, device, stream);
  t.done();
}

/// The calls made and the nanoseconds spent in them so far, from any thread.
__attribute__((visibility("default"))) void timed_totals(std::uint64_t* calls_out, std::uint64_t* nanoseconds_out) {
  *calls_out = kinds[0].calls.load(std::memory_order_relaxed) + kinds[1].calls.load(std::memory_order_relaxed);
  *nanoseconds_out =
      kinds[0].nanoseconds.load(std::memory_order_relaxed) + kinds[1].nanoseconds.load(std::memory_order_relaxed);
}

/// Of one kind (0 allocations, 1 frees): calls, nanoseconds, and the calls in each of the 32
/// power-of-two buckets (bucket b: at least 2^(b-1) ns, under 2^b) and their nanoseconds.
__attribute__((visibility("default"))) void timed_kind(int kind, std::uint64_t* calls_out,
                                                       std::uint64_t* nanoseconds_out, std::uint64_t* buckets_out,
                                                       std::uint64_t* bucket_nanoseconds_out) {
  const kind_counters& k = kinds[kind == 0 ? 0 : 1];
  *calls_out = k.calls.load(std::memory_order_relaxed);
  *nanoseconds_out = k.nanoseconds.load(std::memory_order_relaxed);
  for (int b = 0; b < bucket_count; ++b) {
    buckets_out[b] = k.buckets[b].load(std::memory_order_relaxed);
    bucket_nanoseconds_out[b] = k.bucket_nanoseconds[b].load(std::memory_order_relaxed);
  }
}

/// The median ns of one operation, timed alone `repetitions` times on `stream`, with
/// `evict_bytes` written over before each (0: caches warm). Operations: 0 nothing (the clock's
/// own cost), 1 allocating 4 KiB through streamalloc (the free after it not timed), 2 freeing
/// it (the allocation before it not timed, made before the caches are written over),
/// 3 cuCtxGetCurrent, 4 cuStreamIsCapturing,
/// 5 cuStreamGetId. -1 when the driver lacks the function or streamalloc failed.
__attribute__((visibility("default"))) double timed_probe(int operation, int device, streamalloc_stream stream,
                                                          std::size_t evict_bytes, int repetitions) {
  using ctx_get = CUresult (*)(CUcontext*);
  using is_capturing = CUresult (*)(CUstream, CUstreamCaptureStatus*);
  using get_id = CUresult (*)(CUstream, unsigned long long*);
  static const auto ctx_get_current = driver_function<ctx_get>("cuCtxGetCurrent");
  static const auto stream_is_capturing = driver_function<is_capturing>("cuStreamIsCapturing");
  static const auto stream_get_id = driver_function<get_id>("cuStreamGetId");
  if ((operation == 3 && ctx_get_current == nullptr) || (operation == 4 && stream_is_capturing == nullptr) ||
      (operation == 5 && stream_get_id == nullptr) || repetitions < 1) {
    return -1;
  }
  std::vector<unsigned char> buffer(evict_bytes);
  std::vector<std::uint64_t> times;
  times.reserve(static_cast<std::size_t>(repetitions));
  const auto s = reinterpret_cast<CUstream>(stream);
  for (int i = 0; i < repetitions; ++i) {
    void* p = nullptr;
    // The free's allocation before the caches are written over, or it would bring back what
    // the free then finds warm.
    if (operation == 2 && (p = streamalloc_malloc(4096, device, stream)) == nullptr) return -1;
    evict(buffer);
    CUcontext ctx = nullptr;
    CUstreamCaptureStatus status{};
    unsigned long long id = 0;
    const auto start = clock_type::now();
    switch (operation) {
      case 1: p = streamalloc_malloc(4096, device, stream); break;
      case 2: streamalloc_free(p, 4096, device, stream); break;
      case 3: ctx_get_current(&ctx); break;
      case 4: stream_is_capturing(s, &status); break;
      case 5: stream_get_id(s, &id); break;
      default: break;
    }
    times.push_back(since(start));
    if (operation == 1) {
      if (p == nullptr) return -1;
      streamalloc_free(p, 4096, device, stream);
    }
  }
  std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2), times.end());
  return static_cast<double>(times[times.size() / 2]);
}

}  // extern "C"
