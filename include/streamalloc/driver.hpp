#pragma once

/// @file
/// @brief Is the CUDA driver there, which version, and what can each device do.
///
/// Every query loads the driver on first use (see detail/driver/driver_loader.hpp); nothing links
/// against libcuda. Queries that need the driver throw `driver_unavailable` when it is missing,
/// except `driver_available()`, which only answers.

#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/error.hpp>
#include <streamalloc/memory_location.hpp>
#include <streamalloc/shareable_handle.hpp>

#include <string>

namespace streamalloc {

/// True when the driver loaded, is new enough and found at least one device.
[[nodiscard]] inline bool driver_available() noexcept {
  return detail::driver().status == CUDA_SUCCESS;
}

/// Why the driver cannot be used; empty when it can.
[[nodiscard]] inline std::string driver_problem() { return detail::driver().problem; }

/// Throws `driver_unavailable`, saying why, unless the driver is usable.
inline void require_driver() {
  const auto& d = detail::driver();
  if (d.status != CUDA_SUCCESS) throw driver_unavailable(d.status, "driver load", d.problem);
}

/// The CUDA version the driver supports, as 1000 * major + 10 * minor (12080 for 12.8).
/// @throws driver_unavailable when there is no usable driver
[[nodiscard]] inline int driver_version() {
  require_driver();
  return detail::driver().version;
}

/// The number of CUDA devices visible to this process.
/// @throws driver_unavailable when there is no usable driver
[[nodiscard]] inline int device_count() {
  require_driver();
  int n = 0;
  detail::cu::cuDeviceGetCount(&n);
  return n;
}

namespace detail {
inline CUdevice device_handle(int ordinal) {
  CUdevice d{};
  check(cu::cuDeviceGet_nothrow(&d, ordinal), "cuDeviceGet",
        [&] { return "there is no CUDA device " + std::to_string(ordinal); });
  return d;
}
inline int device_attribute(int ordinal, CUdevice_attribute a) {
  int v = 0;
  cu::cuDeviceGetAttribute(&v, a, device_handle(ordinal));
  return v;
}
}  // namespace detail

/// The device's name, e.g. "NVIDIA H200".
/// @throws cuda_error (`CUDA_ERROR_INVALID_DEVICE`) for a device that does not exist
[[nodiscard]] inline std::string device_name(int device) {
  char name[256] = {};
  detail::cu::cuDeviceGetName(name, static_cast<int>(sizeof name), detail::device_handle(device));
  return name;
}

/// What one device supports, as far as streamalloc cares.
struct device_capabilities {
  int compute_capability = 0;         ///< 10 * major + minor (90 for Hopper)
  bool virtual_memory = false;        ///< cuMemAddressReserve / cuMemCreate / cuMemMap
  bool posix_fd_handles = false;      ///< physical memory exportable as a POSIX file descriptor
  bool fabric_handles = false;        ///< physical memory exportable as a fabric handle
  bool host_numa_memory = false;      ///< cuMemCreate on a host NUMA node, mapped for this device
  bool host_memory = false;           ///< cuMemCreate on host memory without a node
  bool gpu_direct_rdma = false;       ///< VMM allocations usable with GPUDirect RDMA
  int host_numa_id = -1;              ///< the closest host NUMA node, -1 without NUMA
};

/// Queries what `device` supports.
/// @throws driver_unavailable, or cuda_error for a device that does not exist
[[nodiscard]] inline device_capabilities query_capabilities(int device) {
  require_driver();
  using detail::device_attribute;
  device_capabilities c;
  c.compute_capability =
      10 * device_attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) +
      device_attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  c.virtual_memory =
      device_attribute(device, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) != 0;
  c.posix_fd_handles =
      device_attribute(device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) !=
      0;
  c.fabric_handles =
      device_attribute(device, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED) != 0;
  c.gpu_direct_rdma =
      device_attribute(device, CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) != 0;
  // Attributes newer than the running driver read as "not supported" rather than failing.
  auto optional_attribute = [&](CUdevice_attribute a) {
    int v = 0;
    return detail::cu::cuDeviceGetAttribute_nothrow(&v, a, detail::device_handle(device)) ==
                   CUDA_SUCCESS
               ? v
               : 0;
  };
  c.host_numa_memory =
      optional_attribute(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) != 0;
  c.host_memory =
      optional_attribute(CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED) != 0;
  int numa = -1;
  if (detail::cu::cuDeviceGetAttribute_nothrow(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID,
                                               detail::device_handle(device)) == CUDA_SUCCESS) {
    c.host_numa_id = numa;
  }
  return c;
}

/// @throws not_supported unless `device` supports virtual memory management
inline void require_virtual_memory(int device) {
  if (!query_capabilities(device).virtual_memory) {
    throw not_supported("device " + std::to_string(device) + " (" + device_name(device) +
                        ") does not support CUDA virtual memory management "
                        "(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)");
  }
}

/// @throws not_supported unless `device` can export physical memory as every type in `types`
inline void require_handle_types(int device, shareable_handle_type types) {
  const auto c = query_capabilities(device);
  if (has_handle_type(types, shareable_handle_type::posix_fd) && !c.posix_fd_handles) {
    throw not_supported("device " + std::to_string(device) +
                        " cannot export physical memory as POSIX file descriptors");
  }
  if (has_handle_type(types, shareable_handle_type::fabric) && !c.fabric_handles) {
    throw not_supported("device " + std::to_string(device) +
                        " cannot export physical memory as fabric handles (needs IMEX)");
  }
}

/// @throws not_supported unless physical memory can be created at `where` and mapped for
/// `accessing_device` (for a device location, that device itself)
inline void require_location(memory_location where, int accessing_device) {
  const int dev = where.is_device() ? where.id() : accessing_device;
  const auto c = query_capabilities(dev);
  if (!c.virtual_memory) require_virtual_memory(dev);
  if (where.type() == memory_location::kind::host_numa && !c.host_numa_memory) {
    throw not_supported("device " + std::to_string(dev) +
                        " cannot map host NUMA memory through the VMM API "
                        "(CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)");
  }
  if (where.type() == memory_location::kind::host && !c.host_memory) {
    throw not_supported("device " + std::to_string(dev) +
                        " cannot map host memory through the VMM API "
                        "(CU_DEVICE_ATTRIBUTE_HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0)");
  }
}

/// Free and total memory of `device`, in bytes, as the driver reports them.
struct device_memory_info {
  /// Bytes free on the device now.
  std::size_t free = 0;
  /// Bytes the device has in all.
  std::size_t total = 0;
};

/// @throws driver_unavailable; std::invalid_argument for an ordinal outside 0..63 (before any
/// driver call); cuda_error for another device that does not exist
[[nodiscard]] inline device_memory_info device_memory(int device) {
  require_driver();
  // cuMemGetInfo answers for the current context's device; switch for the call if needed.
  CUcontext previous = nullptr;
  detail::cu::cuCtxGetCurrent(&previous);
  CUcontext target = detail::primary_context(device);
  if (previous != target) detail::cu::cuCtxSetCurrent(target);
  device_memory_info info;
  CUresult r = detail::cu::cuMemGetInfo_nothrow(&info.free, &info.total);
  if (previous != target) detail::cu::cuCtxSetCurrent_nothrow(previous);
  detail::check(r, "cuMemGetInfo");
  return info;
}

}  // namespace streamalloc
