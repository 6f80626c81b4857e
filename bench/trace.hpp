#pragma once

// The random allocation trace the memory benches replay: sizes log-uniform between 4 KiB and
// 64 MiB; allocate until `live_target` bytes are live, then `steps` times free a uniformly
// chosen live allocation and allocate until the target is reached again. Seeded: the same
// trace for every allocator and every run.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace bench {

struct trace_op {
  bool alloc;
  std::uint32_t id;
  std::size_t size;
};

inline std::vector<trace_op> make_trace(std::size_t live_target, int steps, std::size_t& peak_live) {
  std::mt19937_64 rng(2026);
  std::uniform_real_distribution<double> log_size(std::log(4096.0), std::log(64.0 * 1024 * 1024));
  std::vector<trace_op> ops;
  std::vector<std::uint32_t> live;
  std::vector<std::size_t> size_of;
  std::size_t cur = 0;
  peak_live = 0;
  auto fill = [&] {
    while (cur < live_target) {
      const auto z = static_cast<std::size_t>(std::exp(log_size(rng)));
      const auto id = static_cast<std::uint32_t>(size_of.size());
      size_of.push_back(z);
      ops.push_back({true, id, z});
      live.push_back(id);
      cur += z;
      peak_live = cur > peak_live ? cur : peak_live;
    }
  };
  fill();
  for (int s = 0; s < steps; ++s) {
    const std::size_t i = rng() % live.size();
    const std::uint32_t id = live[i];
    live[i] = live.back();
    live.pop_back();
    ops.push_back({false, id, size_of[id]});
    cur -= size_of[id];
    fill();
  }
  return ops;
}

}  // namespace bench
