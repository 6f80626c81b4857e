#pragma once

/// @file
/// @brief Everything streamalloc offers, in one include.

#include <streamalloc/version.hpp>
#include <streamalloc/error.hpp>
#include <streamalloc/driver.hpp>
#include <streamalloc/stream.hpp>
#include <streamalloc/user_object.hpp>
#include <streamalloc/vmm.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/captured_graph.hpp>
#include <streamalloc/graph_exec.hpp>
#include <streamalloc/graph_allocation.hpp>
#include <streamalloc/ipc.hpp>
#include <streamalloc/ordering.hpp>
#include <streamalloc/resource.hpp>
#include <streamalloc/logging_resource.hpp>
#include <streamalloc/stream_buffer.hpp>
#include <streamalloc/device_arena.hpp>
