#pragma once

/// @file
/// @brief Physical memory mapped at virtual addresses, unmapped on destruction.

#include <streamalloc/address_reservation.hpp>
#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/physical_allocation.hpp>

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace streamalloc {

/**
 * @brief A range of reserved addresses backed by (part of) a physical allocation
 * (`cuMemMap`), unmapped on destruction (`cuMemUnmap`).
 *
 * A new mapping is not accessible by anyone until `set_access` grants it. The mapping keeps
 * the physical memory alive on its own: the `physical_allocation` may be destroyed first.
 *
 * Growing in place: map more physical memory right after an existing mapping, in the same
 * reservation; the addresses already handed out stay valid and their contents stay put.
 * @code
 * mapping first(va, 0, mem_a);                 // [0, a) of the reservation
 * mapping second(va, mem_a.size(), mem_b);     // [a, a + b): the buffer grew, same pointer
 * set_access(va.address() + mem_a.size(), mem_b.size(), {memory_location::device(0)});
 * @endcode
 */
class mapping {
 public:
  /// Maps nothing.
  mapping() noexcept = default;

  /**
   * @brief Maps `size` bytes of `memory`, from `memory_offset` on, at address `at`.
   * @param at inside a reservation, aligned to the allocation granularity
   * @param memory the physical memory to map
   * @param memory_offset where in `memory` the mapped part begins
   * @param size bytes; 0 means the rest of `memory` after `memory_offset`
   * @throws cuda_error when the driver refuses: CUDA_ERROR_INVALID_VALUE for a range outside
   *         any reservation, already mapped, or misaligned, or an offset past the memory
   */
  mapping(CUdeviceptr at, const physical_allocation& memory, std::size_t memory_offset = 0,
          std::size_t size = 0) {
    require_memory(memory);
    if (size == 0) size = memory_offset < memory.size() ? memory.size() - memory_offset : 0;
    detail::ensure_context(detail::context_device(memory.location()));
    detail::check(detail::cu::cuMemMap_nothrow(at, size, memory_offset, memory.handle(), 0ULL),
                  "cuMemMap", [&] {
                    std::ostringstream m;
                    m << "mapping " << size << " bytes (offset " << memory_offset << " of "
                      << memory.size() << " bytes on " << memory.location().to_string()
                      << ") at 0x" << std::hex << at;
                    return m.str();
                  });
    address_ = at;
    size_ = size;
  }

  /**
   * @brief Maps all of `memory` at `offset` bytes into `reservation`.
   *
   * The range must lie inside the reservation. streamalloc checks this itself: the driver
   * (seen with 580.159) accepts a range that runs past the end of a reservation into addresses
   * it does not own, which would map memory over a neighbour's range.
   * @throws std::invalid_argument, before any driver call, when the range leaves the
   *         reservation or `memory` is empty (moved from)
   * @throws cuda_error as the driver refuses (see above)
   */
  mapping(const address_reservation& reservation, std::size_t offset,
          const physical_allocation& memory) {
    require_memory(memory);
    const CUdeviceptr at = reservation.address() + offset;
    auto describe = [&] {
      return "mapping " + std::to_string(memory.size()) + " bytes at offset " +
             std::to_string(offset) + " of a reservation of " + std::to_string(reservation.size()) +
             " bytes";
    };
    if (offset > reservation.size() || !reservation.contains(at, memory.size())) [[unlikely]] {
      throw std::invalid_argument("streamalloc::mapping: " + describe() +
                                  ": the range leaves the reservation; nothing was mapped");
    }
    detail::ensure_context(detail::context_device(memory.location()));
    detail::check(detail::cu::cuMemMap_nothrow(at, memory.size(), 0, memory.handle(), 0ULL),
                  "cuMemMap", describe);
    address_ = at;
    size_ = memory.size();
  }

  /// Takes over `other`'s mapping; `other` is left mapping nothing.
  mapping(mapping&& other) noexcept
      : address_(std::exchange(other.address_, 0)), size_(std::exchange(other.size_, 0)) {}
  /// Unmaps this range, then takes over `other`'s.
  mapping& operator=(mapping&& other) noexcept {
    if (this != &other) {
      reset();
      address_ = std::exchange(other.address_, 0);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  mapping(const mapping&) = delete;
  mapping& operator=(const mapping&) = delete;
  ~mapping() { reset(); }

  /// The first mapped address, as the driver types it.
  [[nodiscard]] CUdeviceptr address() const noexcept { return address_; }
  /// The first mapped address, as a pointer.
  [[nodiscard]] void* data() const noexcept { return reinterpret_cast<void*>(address_); }
  /// Bytes mapped.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// True while it maps a range.
  [[nodiscard]] explicit operator bool() const noexcept { return address_ != 0; }

  /// Unmaps now. The addresses stay reserved; the physical memory is freed if nothing else
  /// maps or holds it. Work still running on the range must be finished first.
  /// @throws cuda_error when the driver refuses; the mapping is then still owned
  void unmap() {
    if (address_ == 0) return;
    detail::cu::cuMemUnmap(address_, size_);
    address_ = 0;
    size_ = 0;
  }

  /// Gives up ownership; the caller must cuMemUnmap the range.
  [[nodiscard]] std::pair<CUdeviceptr, std::size_t> release() noexcept {
    return {std::exchange(address_, 0), std::exchange(size_, 0)};
  }

 private:
  // The driver does not validate handles: a released one crashes it (seen with 580.159), so
  // an empty owner is stopped here. A live owner cannot hold a stale handle.
  static void require_memory(const physical_allocation& memory) {
    if (!memory) {
      throw std::invalid_argument(
          "streamalloc::mapping: the physical_allocation is empty (moved from or released)");
    }
  }

  void reset() noexcept {
    if (address_ != 0) (void)detail::cu::cuMemUnmap_nothrow(address_, size_);
    address_ = 0;
    size_ = 0;
  }

  CUdeviceptr address_ = 0;
  std::size_t size_ = 0;
};

}  // namespace streamalloc
