#pragma once

// The VMM calls need a current context. A thread that has never made a runtime call has none, so
// streamalloc does what the CUDA runtime does on first use: make the device's primary context
// current. The primary context is retained once per device and never released, like the
// runtime's own reference, so objects that outlive main's locals still find it.

#include <streamalloc/detail/driver/driver_api.hpp>

#include <array>
#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>

namespace streamalloc::detail {

inline constexpr int max_devices = 64;

/// `device`'s primary context, retained on first use.
/// @throws std::invalid_argument for an ordinal outside [0, max_devices), before any driver call
/// @throws cuda_error when the driver has no such device
inline CUcontext primary_context(int device) {
  if (device < 0 || device >= max_devices) [[unlikely]] {
    // Caught here, not by the driver: the array below is indexed by it.
    throw std::invalid_argument("streamalloc: device ordinal " + std::to_string(device) +
                                " is out of range (streamalloc handles devices 0 to " +
                                std::to_string(max_devices - 1) + ")");
  }
  static std::array<std::atomic<CUcontext>, max_devices> contexts{};
  static std::mutex retain_mutex;
  if (CUcontext c = contexts[device].load(std::memory_order_acquire)) return c;
  std::lock_guard lock(retain_mutex);
  if (CUcontext c = contexts[device].load(std::memory_order_relaxed)) return c;
  CUdevice dev{};
  check(cu::cuDeviceGet_nothrow(&dev, device), "cuDeviceGet",
        [&] { return "device ordinal " + std::to_string(device); });
  CUcontext c = nullptr;
  cu::cuDevicePrimaryCtxRetain(&c, dev);
  contexts[device].store(c, std::memory_order_release);
  return c;
}

/// Makes sure the calling thread has a current context; if it has none, makes `device`'s primary
/// context current. A context the caller set is left alone.
inline void ensure_context(int device) {
  CUcontext current = nullptr;
  cu::cuCtxGetCurrent(&current);
  if (current == nullptr) cu::cuCtxSetCurrent(primary_context(device));
}

/// The device whose primary context a default stream's handle names on a thread that has no
/// current context: device 0, as for a CUDA runtime call there, unless a caller that was told
/// the device (the C interface: PyTorch and CuPy pass it with every call) says otherwise for
/// the length of its call (default_stream_device_scope). The calls that meet a thread without
/// a context learn it from the driver's refusal (CUDA_ERROR_INVALID_CONTEXT) and make this
/// device's context current then, instead of every call asking first (cuCtxGetCurrent: 41 ns
/// with the CPU's caches warm on an H200 host, 670 ns once the launches between a step's
/// allocations have evicted them; docs/deep-learning.md).
inline int& default_stream_device() noexcept {
  thread_local int device = 0;
  return device;
}

/// Sets default_stream_device for a scope, then restores it. The scope covers whatever runs
/// inside the call, callbacks included (a pool's out-of-memory handler): a default stream they
/// name on a thread with no context is the scope's device's too.
class default_stream_device_scope {
 public:
  explicit default_stream_device_scope(int device) noexcept : saved_(default_stream_device()) {
    default_stream_device() = device;
  }
  ~default_stream_device_scope() { default_stream_device() = saved_; }
  default_stream_device_scope(const default_stream_device_scope&) = delete;
  default_stream_device_scope& operator=(const default_stream_device_scope&) = delete;

 private:
  int saved_;
};

/// Makes `ctx` the calling thread's current context for the guard's scope (cuCtxPushCurrent),
/// then restores the one before it (cuCtxPopCurrent). Pushing rather than setting leaves a
/// context the caller made current untouched once the scope ends.
class scoped_context {
 public:
  /// @throws cuda_error when the driver refuses the push; nothing is then popped
  explicit scoped_context(CUcontext ctx) { cu::cuCtxPushCurrent(ctx); }
  // The nothrow pop: a destructor cannot report a failure, and a pop that fails (no context
  // current any more) leaves nothing to restore.
  ~scoped_context() {
    CUcontext popped = nullptr;
    (void)cu::cuCtxPopCurrent_nothrow(&popped);
  }
  scoped_context(const scoped_context&) = delete;
  scoped_context& operator=(const scoped_context&) = delete;
  scoped_context(scoped_context&&) = delete;
  scoped_context& operator=(scoped_context&&) = delete;
};

}  // namespace streamalloc::detail
