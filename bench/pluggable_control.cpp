// A control for bench/pytorch_end_to_end.py, not an allocator to use: the least an allocator
// behind PyTorch's CUDAPluggableAllocator can do per call, so that a step's time with it shows
// what PyTorch's pluggable interface itself costs, apart from any allocator's own work.
//
// Each freed block waits in a list of its own stream and size (rounded up to 512 bytes) for the
// next request of that stream and size: same-stream reuse only, which stream order allows with
// no event as long as nothing else uses a block on another stream (PyTorch does not forward
// Tensor.record_stream to a pluggable allocator; none of the bench's workloads needs it).
// Blocks come from cudaMalloc and go back only when a cudaMalloc fails (then, after the device
// is synchronized, every block waiting on that device is given back and the request tried
// again; failing again, it throws std::bad_alloc, which PyTorch turns into its out-of-memory
// error: a null pointer would become a tensor's data). One mutex and one hash lookup a call.
// PyTorch calls it with the tensor's device current, so cudaMalloc needs no cudaSetDevice.
//
// The functions have the signatures CUDAPluggableAllocator loads (malloc: size, device,
// stream; free: pointer, size, device, stream); control_reserved_high says how many bytes of
// cudaMalloc memory it held at most.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <mutex>
#include <new>
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

// Never destroyed: PyTorch may free memory while the process's static objects go.
struct state {
  std::mutex mutex;
  std::unordered_map<key, std::vector<void*>, key_hash> waiting;
  std::size_t held = 0, held_high = 0;
};
state& s = *new state;

std::size_t rounded(std::size_t n) { return (n == 0 ? 512 : (n + 511) / 512 * 512); }

/// Gives `device`'s waiting blocks back (under the lock), once the work queued before their
/// frees has run: the next cudaMalloc may then succeed. A block whose cudaFree fails stays.
void release_waiting(int device) {
  (void)cudaDeviceSynchronize();
  for (auto& [k, blocks] : s.waiting) {
    if (k.device != device) continue;
    std::vector<void*> kept;
    for (void* p : blocks) {
      if (cudaFree(p) == cudaSuccess) {
        s.held -= k.size;
      } else {
        kept.push_back(p);
      }
    }
    blocks.swap(kept);
  }
  (void)cudaGetLastError();  // no failure here is left for PyTorch's next launch check to find
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) void* control_torch_malloc(std::size_t size, int device, cudaStream_t stream) {
  const key k{stream, rounded(size), device};
  std::lock_guard lock(s.mutex);
  if (auto it = s.waiting.find(k); it != s.waiting.end() && !it->second.empty()) {
    void* p = it->second.back();
    it->second.pop_back();
    return p;
  }
  void* p = nullptr;
  if (cudaMalloc(&p, k.size) != cudaSuccess) {
    (void)cudaGetLastError();
    release_waiting(device);
    if (cudaMalloc(&p, k.size) != cudaSuccess) {
      (void)cudaGetLastError();
      std::fprintf(stderr, "pluggable_control: cudaMalloc of %zu bytes failed\n", k.size);
      throw std::bad_alloc();
    }
  }
  s.held += k.size;
  if (s.held > s.held_high) s.held_high = s.held;
  return p;
}

__attribute__((visibility("default"))) void control_torch_free(void* p, std::size_t size, int device, cudaStream_t stream) {
  if (p == nullptr) return;
  std::lock_guard lock(s.mutex);
  s.waiting[key{stream, rounded(size), device}].push_back(p);
}

__attribute__((visibility("default"))) std::uint64_t control_reserved_high() {
  std::lock_guard lock(s.mutex);
  return s.held_high;
}

}  // extern "C"
