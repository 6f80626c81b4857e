#pragma once

// The checks of a pool's properties when it is made: sizes no device could serve, handle types
// streamalloc does not know, a location or handle type the device cannot back (probed with one
// granule, so a refusal comes at construction with the property named, not at the first
// allocation). pool_state's constructor runs them before it reserves or maps anything.

#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/driver.hpp>
#include <streamalloc/error.hpp>
#include <streamalloc/memory_location.hpp>
#include <streamalloc/physical_allocation.hpp>
#include <streamalloc/pool_properties.hpp>
#include <streamalloc/shareable_handle.hpp>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace streamalloc::detail {

/// The largest `max_size`, `address_space` or `chunk_size` a pool accepts: 2^50 bytes (1 PiB).
/// No device addresses that much (Hopper's virtual address space is 2^49 bytes), and keeping
/// sizes far below 2^64 leaves the pool's arithmetic (four times the size, rounding up to the
/// granularity) free of overflow.
inline constexpr std::size_t max_pool_bytes = std::size_t{1} << 50;

/// The handle types streamalloc knows; any other bit is refused when a pool is made.
inline constexpr unsigned known_handle_types =
    static_cast<unsigned>(shareable_handle_type::posix_fd) | static_cast<unsigned>(shareable_handle_type::fabric);

/// "posix_fd", "posix_fd | fabric", for messages.
inline std::string handle_type_names(shareable_handle_type t) {
  std::string s;
  if (has_handle_type(t, shareable_handle_type::posix_fd)) s = "posix_fd";
  if (has_handle_type(t, shareable_handle_type::fabric)) s += s.empty() ? "fabric" : " | fabric";
  return s.empty() ? "none" : s;
}

/// Refuses sizes no device could serve, before anything is computed from them.
inline void check_pool_sizes(const pool_properties& props) {
  const auto refuse = [](const char* name, std::size_t v) {
    throw std::invalid_argument(std::string("streamalloc::pool: pool_properties::") + name + " " + std::to_string(v) +
                                " is above 2^50 bytes (1 PiB): no device address space is that large");
  };
  if (props.max_size > max_pool_bytes) refuse("max_size", props.max_size);
  if (props.address_space > max_pool_bytes) refuse("address_space", props.address_space);
  if (props.chunk_size > max_pool_bytes) refuse("chunk_size", props.chunk_size);
}

/// Says which property the driver refused when probe_pool_properties' granule failed.
[[noreturn]] STREAMALLOC_COLD inline void refuse_pool_properties(const cuda_error& e, memory_location where,
                                                                const allocation_options& opts, std::size_t g) {
  // The driver's code rarely says which property it refused: when the same location
  // without handle types works, the handle types are at fault.
  bool handle_types_refused = false;
  if (opts.handle_types != shareable_handle_type::none) {
    try {
      physical_allocation plain(g, where, {});
      handle_types_refused = true;
    } catch (const cuda_error&) {
    }
  }
  const std::string property =
      handle_types_refused ? "pool_properties::handle_types (" + handle_type_names(opts.handle_types) +
                                 ") on " + where.to_string()
                           : "pool_properties::location (" + where.to_string() + ")";
  const std::string what = "streamalloc::pool: the driver refused " + property + ": creating one granule (" +
                           std::to_string(g) + " bytes) with it failed when the pool was made";
  if (dynamic_cast<const not_supported*>(&e) != nullptr) throw not_supported(what + " (" + e.what() + ")");
  throw cuda_error(e.code(), e.call(), what);
}

/**
 * Creates and releases one granule with the pool's properties, so that a property the
 * driver refuses (a host NUMA node that does not exist, a handle type the device cannot
 * create, such as fabric without its service) fails when the pool is made, not at its first
 * allocation. A lack of memory is no fault of the properties: the pool may still be used
 * once memory is freed.
 */
inline void probe_pool_properties(memory_location where, const allocation_options& opts, std::size_t g) {
  try {
    const physical_allocation granule(g, where, opts);
  } catch (const driver_unavailable&) {
    throw;
  } catch (const cuda_error& e) {
    if (e.code() == CUDA_ERROR_OUT_OF_MEMORY) return;
    refuse_pool_properties(e, where, opts, g);
  }
}

/// Every check of `props` for a pool of `device` whose chunks are made with `opts`, in the
/// order a user would fix them. Returns the allocation granularity the pool works in.
/// @throws std::invalid_argument, not_supported or cuda_error naming the property
inline std::size_t check_pool_properties(const pool_properties& props, int device, const allocation_options& opts) {
  if (props.location.is_device() && props.location.id() >= device_count()) {
    throw std::invalid_argument("streamalloc::pool: there is no device " + std::to_string(props.location.id()));
  }
  check_pool_sizes(props);
  if ((static_cast<unsigned>(props.handle_types) & ~known_handle_types) != 0) {
    throw std::invalid_argument("streamalloc::pool: pool_properties::handle_types " +
                                std::to_string(static_cast<unsigned>(props.handle_types)) +
                                " has bits no shareable_handle_type names (posix_fd, fabric)");
  }
  require_location(props.location, device);
  if (props.handle_types != shareable_handle_type::none && props.location.is_device()) {
    require_handle_types(device, props.handle_types);
  }
  const std::size_t g = allocation_granularity(props.location, granularity_kind::minimum, opts);
  if (props.chunk_size != 0 && props.chunk_size % g != 0) {
    throw std::invalid_argument("streamalloc::pool: chunk_size " + std::to_string(props.chunk_size) +
                                " is not a multiple of the allocation granularity " + std::to_string(g));
  }
  if (props.max_size != 0 && props.max_size < g) {
    throw std::invalid_argument("streamalloc::pool: max_size " + std::to_string(props.max_size) +
                                " is below the allocation granularity " + std::to_string(g));
  }
  probe_pool_properties(props.location, opts, g);
  return g;
}

}  // namespace streamalloc::detail
