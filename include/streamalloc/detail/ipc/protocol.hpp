#pragma once

// The messages between an exporting pool and an importer, one per packet (channel.hpp).
// Importers ask, the exporter answers each request but `release` in order:
//   hello            -> hello_reply     the pool's identity, location and granularity
//   import(desc)     -> import_reply    an id for the import, and the pieces of physical memory
//                                       under the allocation (chunk, offset, length); the
//                                       exporter holds the allocation from here
//   fetch(chunk)     -> fetch_reply     the chunk's memory as a file descriptor (SCM_RIGHTS), or
//                                       as a fabric handle; only chunks an import of this
//                                       importer lies on, and only while it does
//   release(id)      (no answer)        the import is over (the importer has unmapped it)
// A closed socket releases every import of that importer. All fields are of one machine: the
// peers are processes of one host.

#include <streamalloc/ipc_descriptor.hpp>

#include <cuda.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace streamalloc::detail::ipc {

inline constexpr std::uint32_t magic = 0x50494153;  // "SAIP"
inline constexpr std::uint32_t version = 1;
/// The most pieces one allocation may lie on (each a chunk of the pool).
inline constexpr std::uint32_t max_pieces = 2048;

enum class kind : std::uint32_t { hello = 1, import = 2, fetch = 3, release = 4 };

struct request {
  std::uint32_t magic = ipc::magic;
  kind what = kind::hello;
  ipc_descriptor descriptor{};  ///< import
  std::uint64_t id = 0;         ///< fetch: the chunk; release: the import
};

/// A refusal's reason travels with every reply; empty when the request was granted.
struct reason {
  char text[240]{};
  void set(std::string_view s) noexcept {
    const std::size_t n = std::min(s.size(), sizeof text - 1);
    std::memcpy(text, s.data(), n);
    text[n] = '\0';
  }
  [[nodiscard]] bool refused() const noexcept { return text[0] != '\0'; }
};

struct hello_reply {
  std::uint32_t magic = ipc::magic;
  std::uint32_t version = ipc::version;
  reason refusal;
  std::array<std::uint64_t, 2> pool_id{};
  std::int32_t location_kind = 0;  ///< memory_location's kind and id, as the exporter sees them
  std::int32_t location_id = 0;
  CUuuid device{};  ///< the device the exporter's pool is resident on (for host pools: the one it serves)
  std::uint64_t granularity = 0;
  std::uint32_t handle_types = 0;  ///< posix_fd or fabric: how fetch replies carry memory
};

// No default member initializers: a reply's 2048 pieces are not zeroed for each message.
struct piece {
  std::uint64_t chunk;       ///< the chunk's id (stable while an import lies on it)
  std::uint64_t chunk_size;
  std::uint64_t offset;      ///< of the piece in the chunk
  std::uint64_t length;
};

struct import_reply {
  std::uint32_t magic = ipc::magic;
  std::uint32_t count = 0;  ///< pieces that follow
  reason refusal;
  std::uint64_t id = 0;     ///< of the import, for release
  piece pieces[max_pieces];

  /// Ready for another answer (the pieces are overwritten as they are used).
  void clear() noexcept {
    count = 0;
    refusal = {};
    id = 0;
  }
  /// The bytes to send: the header and the pieces in use.
  [[nodiscard]] std::size_t bytes() const noexcept { return offsetof(import_reply, pieces) + count * sizeof(piece); }
};

struct fetch_reply {
  std::uint32_t magic = ipc::magic;
  std::uint32_t handle_type = 0;  ///< of what comes: a descriptor with the message, or `fabric`
  reason refusal;
  CUmemFabricHandle fabric{};
};

}  // namespace streamalloc::detail::ipc
