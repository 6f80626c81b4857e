// A control for bench/pytorch_end_to_end.py, not an allocator to use: the least an allocator
// behind PyTorch's CUDAPluggableAllocator can do per call, so that a step's time with it shows
// what PyTorch's pluggable interface itself costs, apart from any allocator's own work.
//
// Each freed block waits in a list of its own stream and size (rounded up to 512 bytes) for the
// next request of that stream and size: same-stream reuse only, which stream order allows with
// no event. Blocks come from cudaMalloc and go back only when a cudaMalloc fails (then every
// waiting block is given back and the request tried again). One mutex, one hash lookup a call:
// some tens of nanoseconds, against streamalloc's hundreds and PyTorch's own allocator's.
//
// The functions have the signatures CUDAPluggableAllocator loads (malloc: size, device,
// stream; free: pointer, size, device, stream); control_reserved_high says how many bytes of
// cudaMalloc memory it held at most.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

struct key {
  cudaStream_t stream;
  std::size_t size;
  int device;
  bool operator==(const key&) const = default;
};
struct key_hash {
  std::size_t operator()(const key& k) const noexcept {
    return std::hash<std::uintptr_t>{}(reinterpret_cast<std::uintptr_t>(k.stream)) ^ (k.size * 0x9e3779b97f4a7c15ull) ^
           static_cast<std::size_t>(k.device);
  }
};

std::mutex mutex;
std::unordered_map<key, std::vector<void*>, key_hash> waiting;
std::size_t held = 0, held_high = 0;

std::size_t rounded(std::size_t n) { return (n == 0 ? 512 : (n + 511) / 512 * 512); }

/// Gives every waiting block back (under the lock): the next cudaMalloc may then succeed.
void release_waiting() {
  for (auto& [k, blocks] : waiting) {
    for (void* p : blocks) {
      if (cudaFree(p) == cudaSuccess) held -= k.size;
    }
    blocks.clear();
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* control_torch_malloc(std::size_t size, int device, cudaStream_t stream) {
  const key k{stream, rounded(size), device};
  std::lock_guard lock(mutex);
  if (auto it = waiting.find(k); it != waiting.end() && !it->second.empty()) {
    void* p = it->second.back();
    it->second.pop_back();
    return p;
  }
  void* p = nullptr;
  if (cudaMalloc(&p, k.size) != cudaSuccess) {
    (void)cudaGetLastError();
    release_waiting();
    if (cudaMalloc(&p, k.size) != cudaSuccess) {
      (void)cudaGetLastError();
      std::fprintf(stderr, "pluggable_control: cudaMalloc of %zu bytes failed\n", k.size);
      return nullptr;
    }
  }
  held += k.size;
  if (held > held_high) held_high = held;
  return p;
}

__attribute__((visibility("default"))) void control_torch_free(void* p, std::size_t size, int device, cudaStream_t stream) {
  if (p == nullptr) return;
  std::lock_guard lock(mutex);
  waiting[key{stream, rounded(size), device}].push_back(p);
}

__attribute__((visibility("default"))) std::uint64_t control_reserved_high() {
  std::lock_guard lock(mutex);
  return held_high;
}

}  // extern "C"
