#pragma once

/// @file
/// @brief Owned physical memory (`cuMemCreate`), its granularity, and its export to other
/// processes as a POSIX file descriptor.

#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/driver.hpp>
#include <streamalloc/memory_location.hpp>
#include <streamalloc/shareable_handle.hpp>

#include <fcntl.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace streamalloc {

/// Which granularity to ask for: sizes and mapping offsets must be multiples of the minimum;
/// the recommended one may be faster.
enum class granularity_kind { minimum, recommended };

/// How physical memory is created, besides its size and location.
struct allocation_options {
  /// Handle types the memory can later be exported as (`none` for memory that stays here).
  shareable_handle_type handle_types = shareable_handle_type::none;
  /// Ask for memory usable with GPUDirect RDMA.
  bool gpu_direct_rdma = false;
};

namespace detail {
inline CUmemAllocationProp allocation_prop(memory_location where, const allocation_options& o) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location = where.native();
  p.requestedHandleTypes = static_cast<CUmemAllocationHandleType>(o.handle_types);
  p.allocFlags.gpuDirectRDMACapable = o.gpu_direct_rdma ? 1 : 0;
  return p;
}

/// A device whose context the VMM calls for `where` can run in.
inline int context_device(memory_location where) { return where.is_device() ? where.id() : 0; }

/// After the driver refused to create or size memory: throws `not_supported` if the device
/// lacks what was asked for, since the driver's code rarely says which property it refused.
inline void throw_if_unsupported(memory_location where, const allocation_options& options) {
  if (!driver_available()) return;
  require_location(where, context_device(where));
  if (where.is_device()) require_handle_types(where.id(), options.handle_types);
}
}  // namespace detail

/**
 * @brief The granularity of physical allocations at `where`.
 * @throws driver_unavailable, cuda_error (an unknown device), not_supported
 */
[[nodiscard]] inline std::size_t allocation_granularity(
    memory_location where, granularity_kind kind = granularity_kind::minimum,
    allocation_options options = {}) {
  detail::ensure_context(detail::context_device(where));
  const CUmemAllocationProp prop = detail::allocation_prop(where, options);
  std::size_t g = 0;
  detail::check(detail::cu::cuMemGetAllocationGranularity_nothrow(
                    &g, &prop,
                    kind == granularity_kind::minimum ? CU_MEM_ALLOC_GRANULARITY_MINIMUM
                                                      : CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                "cuMemGetAllocationGranularity", [&] {
                  detail::throw_if_unsupported(where, options);
                  return "granularity of physical memory on " + where.to_string();
                });
  return g;
}

/**
 * @brief Physical memory on a device or in host memory, released on destruction.
 *
 * Nothing can touch it until it is mapped (`mapping`) and access is granted (`set_access`).
 * Releasing it while it is still mapped is allowed: the driver frees the memory when the last
 * mapping goes away.
 *
 * @code
 * using namespace streamalloc;
 * const auto gpu = memory_location::device(0);
 * physical_allocation mem(allocation_granularity(gpu), gpu,
 *                         {.handle_types = shareable_handle_type::posix_fd});
 * unique_fd fd = mem.export_to_fd();   // hand it to another process
 * @endcode
 */
class physical_allocation {
 public:
  /// Owns nothing.
  physical_allocation() noexcept = default;

  /**
   * @brief Creates `size` bytes of physical memory at `where`.
   * @param size a multiple of `allocation_granularity(where)`, not 0
   * @param where a device, or host memory (of a NUMA node, or of none in particular)
   * @param options the handle types it may be exported as, and GPUDirect RDMA
   * @throws std::invalid_argument for a zero size or one not a multiple of the granularity
   * @throws not_supported when the device lacks VMM, the location kind or a handle type asked
   *         for (checked when the driver refuses, so creation costs no extra queries)
   * @throws cuda_error otherwise; CUDA_ERROR_OUT_OF_MEMORY when the memory is not there
   */
  physical_allocation(std::size_t size, memory_location where, allocation_options options = {})
      : size_(size), location_(where), handle_types_(options.handle_types) {
    if (size == 0) throw std::invalid_argument("streamalloc::physical_allocation: size is 0");
    const std::size_t g = allocation_granularity(where, granularity_kind::minimum, options);
    if (size % g != 0) {
      throw std::invalid_argument("streamalloc::physical_allocation: size " +
                                  std::to_string(size) + " is not a multiple of the granularity " +
                                  std::to_string(g) + " of " + where.to_string());
    }
    const CUmemAllocationProp prop = detail::allocation_prop(where, options);
    CUresult r = detail::cu::cuMemCreate_nothrow(&handle_, size, &prop, 0ULL);
    if (r != CUDA_SUCCESS) [[unlikely]] {
      handle_ = 0;
      explain_create_failure(r, size, where, options);
    }
  }

  /**
   * @brief Imports physical memory another process exported as a POSIX file descriptor.
   * @param fd the descriptor received (not consumed: close it when convenient)
   * @param size the size of the exported allocation, as the exporter sent it
   * @throws std::invalid_argument for a descriptor that is not open, or a zero size
   * @throws cuda_error when the driver rejects the descriptor (CUDA_ERROR_UNKNOWN for one that
   *         is open but not an exported allocation)
   */
  [[nodiscard]] static physical_allocation import_from_fd(int fd, std::size_t size) {
    if (fd < 0) throw std::invalid_argument("streamalloc::physical_allocation::import_from_fd: invalid descriptor " + std::to_string(fd));
    if (size == 0) throw std::invalid_argument("streamalloc::physical_allocation::import_from_fd: size is 0");
    if (::fcntl(fd, F_GETFD) == -1) {
      throw std::invalid_argument("streamalloc::physical_allocation::import_from_fd: descriptor " +
                                  std::to_string(fd) + " is not open");
    }
    detail::ensure_context(0);
    physical_allocation a;
    detail::check(detail::cu::cuMemImportFromShareableHandle_nothrow(
                      &a.handle_, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                  "cuMemImportFromShareableHandle", [&] {
                    // The driver answers CUDA_ERROR_UNKNOWN for a descriptor that is open but
                    // not an exported allocation (seen with 580.159); say what that means.
                    return "importing physical memory from file descriptor " + std::to_string(fd) +
                           " (is it a descriptor from export_to_fd, received intact?)";
                  });
    a.describe_imported(size);
    return a;
  }

  /**
   * @brief Imports physical memory another process (of this node or, over multi-node NVLink,
   * of another) exported as a fabric handle.
   * @param handle the 64 bytes the exporter's `cuMemExportToShareableHandle` wrote
   * @param size the size of the exported allocation, as the exporter sent it
   * @throws std::invalid_argument for a zero size
   * @throws not_supported where the driver or system has no fabric handles (no IMEX channel)
   * @throws cuda_error when the driver rejects the handle
   */
  [[nodiscard]] static physical_allocation import_from_fabric(const CUmemFabricHandle& handle, std::size_t size) {
    if (size == 0) throw std::invalid_argument("streamalloc::physical_allocation::import_from_fabric: size is 0");
    detail::ensure_context(0);
    physical_allocation a;
    const CUresult r = detail::cu::cuMemImportFromShareableHandle_nothrow(
        &a.handle_, const_cast<CUmemFabricHandle*>(&handle), CU_MEM_HANDLE_TYPE_FABRIC);
    if (r == CUDA_ERROR_NOT_SUPPORTED || r == CUDA_ERROR_NOT_PERMITTED) {
      throw not_supported("streamalloc::physical_allocation::import_from_fabric: this system has no fabric handles "
                          "(they need multi-node NVLink with an IMEX channel): " + detail::result_name(r));
    }
    detail::check(r, "cuMemImportFromShareableHandle", [] { return "importing physical memory from a fabric handle"; });
    a.describe_imported(size);
    return a;
  }

  /// Takes over `other`'s memory; `other` is left owning nothing.
  physical_allocation(physical_allocation&& other) noexcept
      : handle_(std::exchange(other.handle_, 0)),
        size_(std::exchange(other.size_, 0)),
        location_(other.location_),
        handle_types_(other.handle_types_) {}
  /// Releases this memory, then takes over `other`'s.
  physical_allocation& operator=(physical_allocation&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, 0);
      size_ = std::exchange(other.size_, 0);
      location_ = other.location_;
      handle_types_ = other.handle_types_;
    }
    return *this;
  }
  physical_allocation(const physical_allocation&) = delete;
  physical_allocation& operator=(const physical_allocation&) = delete;
  ~physical_allocation() { reset(); }

  /// The driver's handle, for mapping.
  [[nodiscard]] CUmemGenericAllocationHandle handle() const noexcept { return handle_; }
  /// Bytes of physical memory.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Where the memory lives.
  [[nodiscard]] memory_location location() const noexcept { return location_; }
  /// The handle types it can be exported as.
  [[nodiscard]] shareable_handle_type handle_types() const noexcept { return handle_types_; }
  /// True while it owns memory.
  [[nodiscard]] explicit operator bool() const noexcept { return handle_ != 0; }

  /**
   * @brief Exports the memory as a POSIX file descriptor another process can import.
   * @throws not_supported unless it was created with `shareable_handle_type::posix_fd`
   * @throws cuda_error when the driver refuses
   */
  [[nodiscard]] unique_fd export_to_fd() const {
    if (!has_handle_type(handle_types_, shareable_handle_type::posix_fd)) {
      throw not_supported("this physical allocation was created without "
                          "shareable_handle_type::posix_fd, so it cannot be exported as one");
    }
    int fd = -1;
    detail::check(detail::cu::cuMemExportToShareableHandle_nothrow(
                      &fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0ULL),
                  "cuMemExportToShareableHandle",
                  [&] { return "exporting " + std::to_string(size_) + " bytes as a file descriptor"; });
    return unique_fd(fd);
  }

  /// Gives up ownership; the caller must cuMemRelease the handle.
  [[nodiscard]] CUmemGenericAllocationHandle release() noexcept {
    size_ = 0;
    return std::exchange(handle_, 0);
  }

 private:
  void reset() noexcept {
    if (handle_ != 0) (void)detail::cu::cuMemRelease_nothrow(handle_);
    handle_ = 0;
    size_ = 0;
  }

  /// After an import: the size the exporter sent, and the location and handle types the
  /// driver reports.
  void describe_imported(std::size_t size) noexcept {
    size_ = size;
    CUmemAllocationProp prop{};
    if (detail::cu::cuMemGetAllocationPropertiesFromHandle_nothrow(&prop, handle_) == CUDA_SUCCESS) {
      location_ = prop.location.type == CU_MEM_LOCATION_TYPE_DEVICE      ? memory_location::device(prop.location.id)
                  : prop.location.type == CU_MEM_LOCATION_TYPE_HOST_NUMA ? memory_location::host_numa(prop.location.id)
                                                                         : memory_location::host();
      handle_types_ = static_cast<shareable_handle_type>(prop.requestedHandleTypes);
    }
  }
  [[noreturn]] STREAMALLOC_COLD static void explain_create_failure(CUresult r, std::size_t size,
                                                                   memory_location where,
                                                                   allocation_options options) {
    if (r != CUDA_ERROR_OUT_OF_MEMORY) detail::throw_if_unsupported(where, options);
    detail::throw_driver_failure(r, "cuMemCreate",
                                 "creating " + std::to_string(size) + " bytes of physical memory on " +
                                     where.to_string());
  }

  CUmemGenericAllocationHandle handle_ = 0;
  std::size_t size_ = 0;
  memory_location location_ = memory_location::device(0);
  shareable_handle_type handle_types_ = shareable_handle_type::none;
};

}  // namespace streamalloc
