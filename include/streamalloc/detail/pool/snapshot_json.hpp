#pragma once

// A pool's snapshot as a JSON document (pool::snapshot; the C interface's streamalloc_snapshot):
// properties, statistics, the device's memory, the reservations and chunks, every block by
// address with its state, the streams with their live and pending bytes, and the history when
// it is kept. docs/observability.md describes every field; scripts/plot_snapshot.py draws it.
// Numbers are plain JSON integers, addresses too (a reader need not parse hexadecimal).

#include <streamalloc/detail/core/pool_core.hpp>
#include <streamalloc/pool_properties.hpp>
#include <streamalloc/pool_statistics.hpp>
#include <streamalloc/version.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace streamalloc::detail {

inline const char* block_state_name(block_state s) noexcept {
  switch (s) {
    case block_state::live: return "live";
    case block_state::cached: return "cached";
    case block_state::pending: return "pending";
    case block_state::clear: return "free";
    case block_state::graph: return "graph";
    case block_state::imported: return "imported";
  }
  return "?";
}

inline const char* graph_use_name(graph_use u) noexcept {
  switch (u) {
    case graph_use::live: return "live";
    case graph_use::freed: return "freed";
    case graph_use::freed_after: return "freed_after";
    case graph_use::adopted: return "adopted";
    case graph_use::spare: return "spare";
  }
  return "?";
}

/// The device's memory as the driver tells it (cuMemGetInfo), when asked.
struct device_memory_info {
  bool known = false;
  std::size_t free = 0, total = 0;
};

class json_writer {
 public:
  explicit json_writer(std::string& out) : out_(out) {}
  /// `"name": value` after a comma unless first in its object.
  void field(const char* name, std::uint64_t v) { key(name) += std::to_string(v); }
  void field_signed(const char* name, std::int64_t v) { key(name) += std::to_string(v); }
  void field(const char* name, const char* v) { key(name) += std::string("\"") + v + "\""; }
  void field(const char* name, bool v) { key(name) += v ? "true" : "false"; }
  void open(const char* name, char bracket) {
    key(name) += bracket;
    first_ = true;
  }
  void open_item() {
    if (!first_) out_ += ", ";
    out_ += '{';
    first_ = true;
  }
  void close(char bracket) {
    out_ += bracket;
    first_ = false;
  }

 private:
  std::string& key(const char* name) {
    if (!first_) out_ += ", ";
    first_ = false;
    if (name != nullptr) out_ += std::string("\"") + name + "\": ";
    return out_;
  }
  std::string& out_;
  bool first_ = true;
};

inline std::string snapshot_json(int device, const pool_properties& props, const pool_statistics& s,
                                 const core_snapshot& c, device_memory_info mem) {
  std::string out;
  out.reserve(512 + c.blocks.size() * 96 + c.history.events.size() * 96);
  json_writer w(out);
  out += '{';
  w.field("version", std::uint64_t{STREAMALLOC_VERSION});
  w.field("device", static_cast<std::uint64_t>(device));
  w.field("location", props.location.to_string().c_str());
  w.open("properties", '{');
  w.field("max_size", c.max_size);
  w.field("release_threshold", props.release_threshold);
  w.field("chunk_size", c.chunk_size);
  w.field("compact", props.compact);
  w.field("granularity", c.granularity);
  w.open("reuse", '{');
  w.field("follow_event_dependencies", props.reuse.follow_event_dependencies);
  w.field("opportunistic", props.reuse.opportunistic);
  w.field("internal_dependencies", props.reuse.internal_dependencies);
  w.close('}');
  w.close('}');
  w.open("statistics", '{');
  w.field("reserved_current", s.reserved_current);
  w.field("reserved_high", s.reserved_high);
  w.field("used_current", s.used_current);
  w.field("used_high", s.used_high);
  w.field("live_allocations", s.live_allocations);
  w.field("free_clear", s.free_clear);
  w.field("free_pending", s.free_pending);
  w.field("largest_free_block", s.largest_free_block);
  w.field("chunks", s.chunks);
  w.field("remapped_chunks", s.remapped_chunks);
  w.field("grows", s.grows);
  w.field("graph_reserved_current", s.graph_reserved_current);
  w.field("graph_reserved_high", s.graph_reserved_high);
  w.field("graph_allocations", s.graph_allocations);
  w.field("graphs", s.graphs);
  w.close('}');
  if (mem.known) {
    w.open("device_memory", '{');
    w.field("free", mem.free);
    w.field("total", mem.total);
    w.close('}');
  }
  auto ranges = [&w](const char* name, const std::vector<std::pair<std::uint64_t, std::uint64_t>>& list) {
    w.open(name, '[');
    for (const auto& [va, bytes] : list) {
      w.open_item();
      w.field("address", va);
      w.field("bytes", bytes);
      w.close('}');
    }
    w.close(']');
  };
  ranges("reservations", c.reservations);
  ranges("chunks", c.chunks);
  w.open("blocks", '[');
  for (const core_snapshot::block_view& b : c.blocks) {
    w.open_item();
    w.field("address", b.address);
    w.field("bytes", b.bytes);
    w.field("state", block_state_name(b.state));
    if (b.state == block_state::graph) w.field("graph_use", graph_use_name(b.use));
    if (b.stream != 0) {
      w.field("stream", b.stream);
      w.field("stamp", b.stamp);
    }
    // A live block allocated while the history was on: since its allocation.
    if (b.since != 0 && c.now >= b.since) w.field("age_ms", (c.now - b.since) / 1000000u);
    w.close('}');
  }
  w.close(']');
  w.open("streams", '[');
  for (const core_snapshot::stream_view& v : c.streams) {
    w.open_item();
    w.field("id", v.id);
    w.field("handle", v.handle);
    w.field("device", static_cast<std::uint64_t>(v.device));
    w.field_signed("live_bytes", v.live_bytes);
    w.field_signed("live_allocations", v.live_allocations);
    w.field("pending_bytes", v.pending_bytes);
    w.field("held_frees", v.held_frees);
    w.field("newest_free_stamp", v.newest_free_stamp);
    w.field("completed_stamp", v.completed_stamp);
    w.field("events_in_flight", static_cast<std::uint64_t>(v.events_in_flight));
    w.close('}');
  }
  w.close(']');
  w.field("graphs", static_cast<std::uint64_t>(c.graphs));
  if (c.history.capacity != 0) {
    w.open("history", '{');
    w.field("capacity", static_cast<std::uint64_t>(c.history.capacity));
    w.field("dropped", c.history.dropped);
    w.open("events", '[');
    for (const history_event& e : c.history.events) {
      w.open_item();
      w.field("t_ns", e.time_ns);
      w.field("op", history_op_name(e.op));
      w.field("stream", e.stream);
      w.field("address", e.address);
      w.field("bytes", e.bytes);
      w.close('}');
    }
    w.close(']');
    w.close('}');
  }
  out += '}';
  return out;
}

}  // namespace streamalloc::detail
