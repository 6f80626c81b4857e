#pragma once

/// @file
/// @brief The virtual memory management layer: reservations, physical allocations, mappings,
/// access, granularity and export. The pool is built on these; they are public for code that
/// wants to place memory itself.

#include <streamalloc/access.hpp>
#include <streamalloc/address_reservation.hpp>
#include <streamalloc/driver.hpp>
#include <streamalloc/mapping.hpp>
#include <streamalloc/memory_location.hpp>
#include <streamalloc/physical_allocation.hpp>
#include <streamalloc/shareable_handle.hpp>
