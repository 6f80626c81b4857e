#pragma once

/// @file
/// @brief `log_format` and `logging_options`: how a `logging_resource`
/// (<streamalloc/logging_resource.hpp>) writes its lines.

#include <cstddef>

namespace streamalloc {

/// The format of a `logging_resource`'s lines (`docs/observability.md` shows both).
enum class log_format {
  csv,         ///< comma-separated values with a header line first; RFC 4180 quoting
  json_lines,  ///< one JSON object a line (JSON Lines)
};

/// How a `logging_resource` writes its lines.
struct logging_options {
  /// CSV or JSON lines.
  log_format format = log_format::csv;
  /// Memory for lines waiting to be written: a ring of slots of 384 bytes (a line takes one),
  /// rounded up to a power of two of them, at least 16 (the default: 1,024 slots, 384 KiB).
  /// Whoever completes a quarter of the ring moves what is waiting to a staging buffer, written
  /// to the sink once 32 KiB wait there; `flush()` and the end of the last resource writing to
  /// the log write the rest. From 1 byte to 1 GiB.
  std::size_t buffer_bytes = std::size_t{256} << 10;
  /// Writes each line to the sink as it is made (and flushes a `std::ostream`), for a program
  /// that may die before its resource is destroyed (a bad free that aborts, say). Costs a system
  /// call per line with a file.
  bool flush_every_line = false;
};

}  // namespace streamalloc
