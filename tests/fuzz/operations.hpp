#pragma once

// How the input becomes a pool and operations on it: its first bytes configure the pool, the
// device and the first streams; then each step's first byte selects an operation (step()), whose
// own bytes follow it. Calls on blocks are in block_operations.hpp; the rest are here.

#include "harness.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>

namespace pool_core_fuzz {

// --- configuration -------------------------------------------------------------------------------

inline void harness::configure() {
  const std::uint8_t b0 = in_.byte(), b1 = in_.byte(), b2 = in_.byte(), b3 = in_.byte(), b4 = in_.byte(),
                     b5 = in_.byte(), b6 = in_.byte();
  dev_ = std::make_shared<sim_device>();
  dev_->granularity = (b0 & 16) ? 64 * KiB : 2 * MiB;
  const std::uint64_t g = dev_->granularity;
  core_options o;
  o.reuse = {bool(b0 & 1), bool(b0 & 2), bool(b0 & 4)};
  o.own_chunk_for_large = !(b0 & 8);
  const std::uint64_t chunks[] = {0, g, 2 * g, 8 * MiB, 16 * MiB, 3 * g};
  o.chunk_size = chunks[b1 % 6];
  const std::uint64_t maxes[] = {0, 0, 0, 8 * MiB, 32 * MiB, 128 * MiB, 1 * GiB, 3 * g};
  o.max_size = maxes[b2 % 8];
  const std::uint64_t chunk = o.chunk_size == 0 ? 64 * MiB : round_up(o.chunk_size, g);
  const std::uint64_t thresholds[] = {0, 0, chunk, 64 * MiB, ~0ull};
  o.release_threshold = thresholds[b3 % 5];
  const std::uint64_t spaces[] = {64 * GiB, 64 * GiB, 256 * MiB, 1 * GiB, 8 * GiB, 1024 * GiB};
  o.address_space = spaces[b4 % 6];
  const std::uint64_t capacities[] = {1ull << 40, 64 * MiB, 256 * MiB, 2 * GiB, 16 * GiB};
  dev_->capacity = capacities[b5 % 5];
  // A pool that builds large requests from chunks maps one handle per chunk: bound their
  // number, so each input runs in milliseconds.
  if (!o.own_chunk_for_large) dev_->capacity = std::min(dev_->capacity, chunk * 2048);
  TRACE("pool: granularity %llu, chunk %llu, max %llu, threshold %llu, addresses %llu, device %llu, reuse "
        "%d%d%d, own chunk for large %d",
        ull(g), ull(chunk), ull(o.max_size), ull(o.release_threshold), ull(o.address_space), ull(dev_->capacity),
        o.reuse.follow_event_dependencies, o.reuse.opportunistic, o.reuse.internal_dependencies,
        o.own_chunk_for_large);
  pool_ = std::make_unique<core>(fuzz_backend{sim_backend{dev_}, this}, o);

  // The host pseudo-stream, as pool.hpp's host_key() makes it.
  stream_record& h = ordering().record(~std::uint64_t{0});
  h.mark_completed(~std::uint64_t{0} >> 1);
  streams_.push_back({});
  streams_[host].record = record_ref(h);
  streams_[host].retirable = false;
  const int first = 1 + (b6 & 3);
  for (int i = 0; i < first; ++i) make_stream(((b6 >> (2 + i)) & 1) ? 0 : 2);
}

// --- operations ----------------------------------------------------------------------------------

inline void harness::step() {
  const std::uint8_t op = in_.byte();
  switch (op % 32) {
    case 0: case 1: case 2: case 3: case 4: case 5: case 6: case 7: {
      const std::size_t s = pick_stream(in_.byte());
      const std::uint64_t bytes = size_from_input();
      const std::uint8_t w = in_.byte();
      const auto where = (w & 1) ? streamalloc::placement::room_to_grow : streamalloc::placement::packed;
      // One request in 16: the driver refuses a mapping it asks for (short of memory), after
      // letting 0 to 7 through; with bit 5 of the operation set, the mapping fails for
      // another reason instead (a sticky error's stand-in), which must reach the caller.
      if (s != none) allocate(s, bytes, where, (w & 0xf0) == 0xf0, (w >> 1) & 7, (op & 0x20) != 0);
      break;
    }
    case 8: case 9: case 10: case 11: case 12: case 13: free_live(); break;
    case 14: bad_pointer(); break;
    case 15: case 16: {
      const std::size_t s = pick_stream(in_.byte());
      const std::size_t t = pick_stream(in_.byte(), s);
      if (s == none || t == none) break;
      if (op & 0x80) {
        // Through raw CUDA calls: t is ordered after s, but streamalloc does not know it.
        TRACE("raw event on stream %zu waited for by stream %zu", s, t);
        model_wait(t, point_now(s));
      } else {
        TRACE("event on stream %zu waited for by stream %zu", s, t);
        order_after(t, s);
      }
      break;
    }
    case 17: {
      const std::uint8_t b = in_.byte();
      auto& slot = user_events_[b % user_events_.size()];
      if (b & 0x80) {
        const std::size_t s = pick_stream(in_.byte());
        if (s == none) break;
        TRACE("event %d recorded on stream %zu", b % 4, s);
        const point p = point_now(s);
        slot = user_event{streams_[s].record->capture(), p};
      } else if (slot) {
        const std::size_t t = pick_stream(in_.byte());
        if (t == none || t == slot->at.stream) break;
        TRACE("stream %zu waits for event %d (stream %zu op %llu)", t, b % 4, slot->at.stream, ull(slot->at.op));
        streams_[t].record->wait_for(slot->snap);
        model_wait(t, slot->at);
      }
      break;
    }
    case 18: {
      auto& slot = user_events_[in_.byte() % user_events_.size()];
      if (!slot) break;
      TRACE("host synchronizes an event (stream %zu op %llu)", slot->at.stream, ull(slot->at.op));
      device_run(slot->at.stream, slot->at.op);
      ordering().complete(slot->snap);
      break;
    }
    case 19: {
      const std::size_t s = pick_stream(in_.byte());
      if (s == none) break;
      TRACE("host synchronizes stream %zu", s);
      host_synchronize(s);
      break;
    }
    case 20: case 21: {
      // The device runs some of a stream's work (a destroyed stream's too), unannounced.
      const std::uint8_t b = in_.byte();
      const std::size_t s = 1 + b % (streams_.size() - 1);
      model_stream& m = streams_[s];
      const std::uint8_t k = in_.byte();
      const std::uint64_t target = (k & 1) || m.ops == m.done ? m.ops : m.done + 1 + k % (m.ops - m.done);
      TRACE("device runs stream %zu to op %llu of %llu", s, ull(target), ull(m.ops));
      device_run(s, target);
      break;
    }
    case 22:
      TRACE("host synchronizes the device");
      device_synchronize();
      break;
    case 23: case 24: grow(); break;
    case 25: shrink(); break;
    case 26: move_block(); break;
    case 27: {
      const std::uint8_t b = in_.byte();
      const std::uint64_t chunk = pool_->options().chunk_size;
      const std::uint64_t amounts[] = {0, chunk, 2 * chunk, 64 * MiB, ~0ull, in_.bytes(4) * 256};
      const std::uint64_t v = amounts[(b >> 2) % 6];
      if (b % 3 == 0) {
        TRACE("trim_to(%llu)", ull(v));
        pool_->trim_to(v);
      } else if (b % 3 == 1) {
        TRACE("set_release_threshold(%llu)", ull(v));
        pool_->set_release_threshold(v);
      } else {
        const reuse_policy r{bool(b & 8), bool(b & 16), bool(b & 32)};
        TRACE("set_reuse(%d%d%d)", r.follow_event_dependencies, r.opportunistic, r.internal_dependencies);
        pool_->set_reuse(r);
      }
      break;
    }
    case 28: make_stream(in_.byte()); break;
    case 29: {
      const std::size_t s = pick_stream(in_.byte());
      if (s != none && streams_[s].retirable) destroy_stream(s);
      break;
    }
    case 30: query(); break;
    default: {
      // The host pseudo-stream: allocate_sync, or deallocate_sync of a live block.
      const std::uint8_t b = in_.byte();
      if ((b & 1) || live_.empty()) {
        const std::uint64_t bytes = size_from_input();
        allocate(host, bytes, streamalloc::placement::packed);
      } else {
        auto it = std::next(live_.begin(), static_cast<std::ptrdiff_t>(in_.byte() % live_.size()));
        free_block(it->first, host, b & 2);
      }
      break;
    }
  }
}

// --- sizes ---------------------------------------------------------------------------------------

inline std::uint64_t harness::size_from_input() {
  const std::uint64_t g = pool_->granularity(), chunk = pool_->options().chunk_size;
  const std::uint8_t kind = in_.byte();
  switch (kind % 8) {
    case 0: return in_.byte();
    case 1: return in_.bytes(2);
    case 2: return in_.bytes(3);
    case 3: {  // whole granules, give or take a little
      const std::uint64_t k = in_.byte() % 9;
      const std::uint64_t d = in_.byte();
      return std::max<std::int64_t>(0, static_cast<std::int64_t>(k * g + d * 256) - 16 * 256);
    }
    case 4: {  // whole chunks, give or take a little
      const std::uint64_t k = 1 + in_.byte() % 4;
      const std::uint64_t d = in_.byte();
      return k * chunk + d * 256 - 128 * 256;
    }
    case 5: {
      const std::uint64_t edge[] = {0,
                                    1,
                                    255,
                                    256,
                                    257,
                                    4096,
                                    g - 1,
                                    g,
                                    g + 1,
                                    chunk - 1,
                                    chunk,
                                    chunk + 1,
                                    1ull << 40,
                                    1ull << 50,
                                    pool_front_limit,
                                    pool_front_limit + 1,
                                    1ull << 63,
                                    ~0ull - 255,
                                    ~0ull - 254,
                                    ~0ull};
      return edge[in_.byte() % std::size(edge)];
    }
    case 6: return in_.bytes(4);
    default: return in_.bytes(8);
  }
}

}  // namespace pool_core_fuzz
