#pragma once

/// @file
/// @brief Where physical memory lives: a device, or host memory (a NUMA node, or any node).

#include <streamalloc/detail/config.hpp>

#include <stdexcept>
#include <string>

namespace streamalloc {

/**
 * @brief A place physical memory can be created: a GPU, a host NUMA node, or host memory
 * without a node preference.
 *
 * Made only through the named factories, so an integer cannot silently become a location:
 * @code
 * auto gpu0 = streamalloc::memory_location::device(0);
 * auto numa0 = streamalloc::memory_location::host_numa(0);
 * @endcode
 */
class memory_location {
 public:
  /// The kinds of location.
  enum class kind { device, host, host_numa };

  /// GPU `ordinal` (as the CUDA runtime and driver count devices).
  /// @throws std::invalid_argument if `ordinal` is negative
  static constexpr memory_location device(int ordinal) {
    if (ordinal < 0) throw std::invalid_argument("streamalloc::memory_location::device: negative device ordinal");
    return memory_location(kind::device, ordinal);
  }
  /// Host memory on NUMA node `node` (0 on systems without NUMA).
  /// @throws std::invalid_argument if `node` is negative
  static constexpr memory_location host_numa(int node) {
    if (node < 0) throw std::invalid_argument("streamalloc::memory_location::host_numa: negative NUMA node");
    return memory_location(kind::host_numa, node);
  }
  /// Host memory on no particular NUMA node (driver 12.8 and newer).
  static constexpr memory_location host() noexcept { return memory_location(kind::host, 0); }

  /// Device, host NUMA node or host.
  [[nodiscard]] constexpr kind type() const noexcept { return kind_; }
  /// The device ordinal or NUMA node; 0 for `host()`.
  [[nodiscard]] constexpr int id() const noexcept { return id_; }
  /// Memory of a GPU.
  [[nodiscard]] constexpr bool is_device() const noexcept { return kind_ == kind::device; }
  /// Host memory (of a NUMA node or of none in particular).
  [[nodiscard]] constexpr bool is_host() const noexcept { return kind_ != kind::device; }

  /// The driver's description of this location.
  [[nodiscard]] constexpr CUmemLocation native() const noexcept {
    CUmemLocation l{};
    l.type = kind_ == kind::device ? CU_MEM_LOCATION_TYPE_DEVICE
             : kind_ == kind::host ? CU_MEM_LOCATION_TYPE_HOST
                                   : CU_MEM_LOCATION_TYPE_HOST_NUMA;
    l.id = id_;
    return l;
  }

  /// "device 0", "host NUMA node 1", "host".
  [[nodiscard]] std::string to_string() const {
    switch (kind_) {
      case kind::device: return "device " + std::to_string(id_);
      case kind::host_numa: return "host NUMA node " + std::to_string(id_);
      case kind::host: break;
    }
    return "host";
  }

  /// Same kind and same device or node.
  friend constexpr bool operator==(memory_location, memory_location) noexcept = default;

 private:
  constexpr memory_location(kind k, int id) noexcept : kind_(k), id_(id) {}
  kind kind_;
  int id_;
};

}  // namespace streamalloc
