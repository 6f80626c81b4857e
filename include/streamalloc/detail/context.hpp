#pragma once

// The VMM calls need a current context. A thread that has never made a runtime call has none, so
// streamalloc does what the CUDA runtime does on first use: make the device's primary context
// current. The primary context is retained once per device and never released, like the
// runtime's own reference, so objects that outlive main's locals still find it.

#include <streamalloc/detail/driver_api.hpp>

#include <array>
#include <atomic>
#include <mutex>
#include <string>

namespace streamalloc::detail {

inline constexpr int max_devices = 64;

inline CUcontext primary_context(int device) {
  if (device < 0 || device >= max_devices) {
    throw cuda_error(CUDA_ERROR_INVALID_DEVICE, "cuDevicePrimaryCtxRetain",
                     "device ordinal " + std::to_string(device) + " is out of range");
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

}  // namespace streamalloc::detail
