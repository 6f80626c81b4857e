#pragma once

/// @file
/// @brief streamalloc's version. CMake reads the project version from these three lines.

/// The major version: changes that break the API (before 1.0, the minor version may too).
#define STREAMALLOC_VERSION_MAJOR 0
/// The minor version: additions.
#define STREAMALLOC_VERSION_MINOR 1
/// The patch version: fixes.
#define STREAMALLOC_VERSION_PATCH 0

/// @brief The version as one number: major * 10000 + minor * 100 + patch.
#define STREAMALLOC_VERSION                                                                        \
  (STREAMALLOC_VERSION_MAJOR * 10000 + STREAMALLOC_VERSION_MINOR * 100 + STREAMALLOC_VERSION_PATCH)
