#pragma once

/// @file
/// @brief An owned range of virtual addresses, with nothing mapped into it yet.

#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

namespace streamalloc {

/**
 * @brief A reserved virtual address range (`cuMemAddressReserve`), freed on destruction.
 *
 * Reserving costs no physical memory; map physical allocations into it with `mapping`. The
 * range is visible to every device (unified addressing), so one reservation serves all GPUs.
 *
 * @code
 * streamalloc::address_reservation va(64 << 20);          // 64 MiB of addresses
 * streamalloc::physical_allocation mem(2 << 20, streamalloc::memory_location::device(0));
 * streamalloc::mapping m(va, 0, mem);                      // first 2 MiB now backed
 * @endcode
 *
 * Destroy mappings before their reservation: freeing a range that still has mappings fails,
 * and the destructor then leaves the addresses reserved rather than corrupt anything.
 */
class address_reservation {
 public:
  /// An empty reservation, owning nothing.
  address_reservation() noexcept = default;

  /**
   * @brief Reserves `size` bytes of virtual addresses.
   * @param size bytes; a multiple of the allocation granularity is what mappings need
   * @param alignment of the start address; 0 for the driver's default, else a power of two
   * @param hint an address to try to place the range at; 0 to let the driver choose
   * @throws std::invalid_argument for a zero size or an alignment that is not a power of two
   * @throws cuda_error when the driver refuses (CUDA_ERROR_OUT_OF_MEMORY when the address
   *         space is exhausted, as for an absurd size)
   */
  explicit address_reservation(std::size_t size, std::size_t alignment = 0, CUdeviceptr hint = 0) {
    if (size == 0) throw std::invalid_argument("streamalloc::address_reservation: size is 0");
    if ((alignment & (alignment - 1)) != 0) {
      throw std::invalid_argument("streamalloc::address_reservation: alignment " +
                                  std::to_string(alignment) + " is not a power of two");
    }
    // Reservations belong to no device; device 0's primary context serves if the thread has
    // none, as the runtime would pick it.
    detail::ensure_context(0);
    CUdeviceptr p = 0;
    detail::check(detail::cu::cuMemAddressReserve_nothrow(&p, size, alignment, hint, 0ULL),
                  "cuMemAddressReserve", [&] {
                    return "reserving " + std::to_string(size) + " bytes of virtual addresses";
                  });
    address_ = p;
    size_ = size;
  }

  /// Takes over `other`'s range; `other` is left empty.
  address_reservation(address_reservation&& other) noexcept
      : address_(std::exchange(other.address_, 0)), size_(std::exchange(other.size_, 0)) {}
  /// Frees this range, then takes over `other`'s.
  address_reservation& operator=(address_reservation&& other) noexcept {
    if (this != &other) {
      reset();
      address_ = std::exchange(other.address_, 0);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  address_reservation(const address_reservation&) = delete;
  address_reservation& operator=(const address_reservation&) = delete;
  ~address_reservation() { reset(); }

  /// The first address, as the driver types it.
  [[nodiscard]] CUdeviceptr address() const noexcept { return address_; }
  /// The first address, as a pointer.
  [[nodiscard]] void* data() const noexcept { return reinterpret_cast<void*>(address_); }
  /// Bytes reserved.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// True while it holds a range.
  [[nodiscard]] explicit operator bool() const noexcept { return address_ != 0; }
  /// True if [p, p + n) lies inside the range.
  [[nodiscard]] bool contains(CUdeviceptr p, std::size_t n = 1) const noexcept {
    return p >= address_ && n <= size_ && p - address_ <= size_ - n;
  }

  /// Frees the range now (nothing may still be mapped in it).
  /// @throws cuda_error when the driver refuses; the reservation is then still owned
  void free() {
    if (address_ == 0) return;
    detail::cu::cuMemAddressFree(address_, size_);
    address_ = 0;
    size_ = 0;
  }

  /// Gives up ownership; the caller must free the range with cuMemAddressFree.
  [[nodiscard]] std::pair<CUdeviceptr, std::size_t> release() noexcept {
    return {std::exchange(address_, 0), std::exchange(size_, 0)};
  }

 private:
  void reset() noexcept {
    if (address_ != 0) (void)detail::cu::cuMemAddressFree_nothrow(address_, size_);
    address_ = 0;
    size_ = 0;
  }

  CUdeviceptr address_ = 0;
  std::size_t size_ = 0;
};

}  // namespace streamalloc
