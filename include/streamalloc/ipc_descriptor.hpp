#pragma once

/// @file
/// @brief `ipc_descriptor`: what an exporting process sends another so that it can import one
/// allocation of a pool (see ipc.hpp).

#include <array>
#include <cstdint>
#include <type_traits>

namespace streamalloc {

/**
 * @brief One exported allocation of a pool, as another process imports it.
 *
 * Opaque, fixed-size (64 bytes) and trivially copyable: send it by any means (a pipe, a file,
 * shared memory, an MPI message). It names the pool (a random identity drawn when the pool was
 * exported), the allocation's address and size in the exporting process, and a serial that
 * changes when the allocation is freed, so that a descriptor kept after the free is refused
 * instead of mapping memory that belongs to another allocation by then. It grants nothing by
 * itself: only a process connected to the pool's socket (`imported_pool`) can import it.
 */
struct ipc_descriptor {
  std::uint32_t magic = 0;    ///< identifies a streamalloc descriptor
  std::uint32_t version = 0;  ///< of the protocol that made it
  std::array<std::uint64_t, 2> pool_id{};  ///< the exporting pool's identity
  std::uint64_t address = 0;  ///< in the exporting process
  std::uint64_t size = 0;     ///< bytes the importer maps
  std::uint64_t serial = 0;   ///< of this allocation's export
  std::uint64_t reserved[2]{};  ///< zero; room for later versions
};
static_assert(sizeof(ipc_descriptor) == 64 && std::is_trivially_copyable_v<ipc_descriptor>);

}  // namespace streamalloc
