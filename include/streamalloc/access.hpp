#pragma once

/// @file
/// @brief Who may read and write a mapped range: `set_access`, `get_access`, `access_grant`.

#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/memory_location.hpp>

#include <cstddef>
#include <initializer_list>
#include <span>
#include <stdexcept>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace streamalloc {

/// What a location may do with a range.
enum class access_flags : unsigned {
  none = CU_MEM_ACCESS_FLAGS_PROT_NONE,
  read = CU_MEM_ACCESS_FLAGS_PROT_READ,
  read_write = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
};

/**
 * @brief One location's access to a range.
 *
 * For a device location, that GPU's kernels and copies; for a host location (the location of
 * host physical memory), the CPU's loads and stores.
 */
struct access_descriptor {
  /// The device or host location given access.
  memory_location location;
  /// The access it gets.
  access_flags flags = access_flags::read_write;

  /// The same, as the driver's `CUmemAccessDesc`.
  [[nodiscard]] CUmemAccessDesc native() const noexcept {
    CUmemAccessDesc d{};
    d.location = location.native();
    d.flags = static_cast<CUmemAccess_flags>(flags);
    return d;
  }
};

/**
 * @brief Sets the access of each location in `who` to `[address, address + size)`.
 *
 * The range must be fully mapped. Costs tens of microseconds per physical allocation in the
 * range, so grant once for a large range rather than per small block.
 * @throws cuda_error (CUDA_ERROR_INVALID_VALUE for a range not fully mapped,
 *         CUDA_ERROR_INVALID_DEVICE for a device that cannot access the memory)
 */
inline void set_access(CUdeviceptr address, std::size_t size,
                       std::span<const access_descriptor> who) {
  std::vector<CUmemAccessDesc> native;
  native.reserve(who.size());
  for (const auto& d : who) native.push_back(d.native());
  detail::ensure_context(0);
  detail::check(detail::cu::cuMemSetAccess_nothrow(address, size, native.data(), native.size()),
                "cuMemSetAccess", [&] {
                  std::ostringstream m;
                  m << "setting access of " << who.size() << " location(s) to " << size
                    << " bytes at 0x" << std::hex << address;
                  return m.str();
                });
}

/// @overload
inline void set_access(CUdeviceptr address, std::size_t size,
                       std::initializer_list<access_descriptor> who) {
  set_access(address, size, std::span<const access_descriptor>(who.begin(), who.size()));
}

/// `set_access` without exceptions, for destructors; returns the driver's result.
inline CUresult set_access_nothrow(CUdeviceptr address, std::size_t size,
                                   std::span<const access_descriptor> who) noexcept {
  constexpr std::size_t max_locations = 16;
  CUmemAccessDesc native[max_locations];
  if (who.size() > max_locations) return CUDA_ERROR_INVALID_VALUE;
  for (std::size_t i = 0; i < who.size(); ++i) native[i] = who[i].native();
  return detail::cu::cuMemSetAccess_nothrow(address, size, native, who.size());
}

/**
 * @brief The access `where` has to the mapped address `address`.
 * @throws cuda_error (CUDA_ERROR_INVALID_VALUE for an address that is not mapped)
 */
[[nodiscard]] inline access_flags get_access(memory_location where, CUdeviceptr address) {
  detail::ensure_context(0);
  const CUmemLocation loc = where.native();
  unsigned long long flags = 0;
  detail::check(detail::cu::cuMemGetAccess_nothrow(&flags, &loc, address), "cuMemGetAccess",
                [&] { return "access of " + where.to_string(); });
  return static_cast<access_flags>(flags);
}

/**
 * @brief Access granted to some locations over a mapped range, taken back on destruction.
 *
 * For access that should last exactly as long as a scope or an object: a peer GPU's access
 * to a buffer, say. Destroy it before the mapping it covers (declare it after).
 * @code
 * access_grant peer(m.address(), m.size(), {{memory_location::device(1)}});
 * @endcode
 */
class access_grant {
 public:
  access_grant() noexcept = default;
  /// Grants `who` access to `[address, address + size)`.
  /// @throws cuda_error as `set_access`; std::invalid_argument for more than 16 locations
  access_grant(CUdeviceptr address, std::size_t size, std::vector<access_descriptor> who)
      : address_(address), size_(size), who_(std::move(who)) {
    if (who_.size() > 16) throw std::invalid_argument("streamalloc::access_grant: more than 16 locations");
    set_access(address_, size_, who_);
  }
  /// Takes over `other`'s grant; `other` is left granting nothing.
  access_grant(access_grant&& other) noexcept
      : address_(std::exchange(other.address_, 0)),
        size_(std::exchange(other.size_, 0)),
        who_(std::exchange(other.who_, {})) {}
  /// Revokes this grant, then takes over `other`'s.
  access_grant& operator=(access_grant&& other) noexcept {
    if (this != &other) {
      (void)revoke_nothrow();
      address_ = std::exchange(other.address_, 0);
      size_ = std::exchange(other.size_, 0);
      who_ = std::exchange(other.who_, {});
    }
    return *this;
  }
  access_grant(const access_grant&) = delete;
  access_grant& operator=(const access_grant&) = delete;
  ~access_grant() { (void)revoke_nothrow(); }

  /// The first address of the range granted.
  [[nodiscard]] CUdeviceptr address() const noexcept { return address_; }
  /// Bytes granted.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// The locations given access, with their flags.
  [[nodiscard]] const std::vector<access_descriptor>& locations() const noexcept { return who_; }

  /// Takes the access back now.
  /// @throws cuda_error when the driver refuses; the grant is then still held
  void revoke() {
    if (address_ == 0) return;
    detail::check(revoke_nothrow(), "cuMemSetAccess", [] { return "revoking access"; });
  }

 private:
  CUresult revoke_nothrow() noexcept {
    if (address_ == 0) return CUDA_SUCCESS;
    CUmemAccessDesc none[16];  // the constructor caps the locations at 16
    for (std::size_t i = 0; i < who_.size(); ++i) {
      none[i] = who_[i].native();
      none[i].flags = CU_MEM_ACCESS_FLAGS_PROT_NONE;
    }
    CUresult r = detail::cu::cuMemSetAccess_nothrow(address_, size_, none, who_.size());
    if (r == CUDA_SUCCESS) {
      address_ = 0;
      size_ = 0;
      who_.clear();
    }
    return r;
  }

  CUdeviceptr address_ = 0;
  std::size_t size_ = 0;
  std::vector<access_descriptor> who_;
};

}  // namespace streamalloc
