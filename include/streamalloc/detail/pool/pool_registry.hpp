#pragma once

// What the process knows of its pools: every live pool's reservations by address (to find the
// pool of a pointer), each device's pool cores (graph memory statistics and trim go over
// them), and each device's current pool. Process-wide; each outlives every pool.

#include <streamalloc/detail/core/pool_core.hpp>
#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/pool/vmm_backend.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <utility>
#include <vector>

namespace streamalloc::detail {

class pool_state;

static_assert(pool_backend<vmm_backend>);
using vmm_pool_core = pool_core<vmm_backend>;

/// Every live pool's reservations, by address, for finding the pool of a pointer (a lookup in
/// a process with thousands of pools costs a map search, not a walk over them).
class pool_directory {
 public:
  void add(pool_state* p, std::uint64_t base, std::uint64_t size) {
    std::unique_lock lock(mutex_);
    entries_[base] = {base + size, p};
  }
  void remove(pool_state* p) {
    std::unique_lock lock(mutex_);
    std::erase_if(entries_, [p](const auto& e) { return e.second.owner == p; });
  }
  pool_state* find(std::uint64_t addr) {
    std::shared_lock lock(mutex_);
    auto it = entries_.upper_bound(addr);
    if (it == entries_.begin()) return nullptr;
    --it;
    return addr < it->second.end ? it->second.owner : nullptr;
  }

 private:
  struct entry {
    std::uint64_t end;
    pool_state* owner;
  };
  std::shared_mutex mutex_;
  std::map<std::uint64_t, entry> entries_;  // reservation base -> its end, its pool
};

inline pool_directory& pools() {
  static pool_directory* d = new pool_directory;  // outlives every pool, default pools included
  return *d;
}

/// The cores of each device's pools, closed pools' included while graphs keep them: what the
/// device's graph memory statistics and trim (graph_allocation.hpp) go over. Weak: a core goes
/// when its pool and graphs do, and its entry with the next walk.
class device_cores {
 public:
  void add(int device, const std::shared_ptr<vmm_pool_core>& core) {
    std::lock_guard lock(mutex_);
    cores_.emplace_back(device, core);
  }
  /// The live cores of `device`, each held for the caller.
  std::vector<std::shared_ptr<vmm_pool_core>> of(int device) {
    std::vector<std::shared_ptr<vmm_pool_core>> out;
    std::lock_guard lock(mutex_);
    std::erase_if(cores_, [&](const auto& e) {
      std::shared_ptr<vmm_pool_core> c = e.second.lock();
      if (c == nullptr) return true;
      if (e.first == device) out.push_back(std::move(c));
      return false;
    });
    return out;
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<int, std::weak_ptr<vmm_pool_core>>> cores_;
};

inline device_cores& cores_by_device() {
  static device_cores* d = new device_cores;  // pools may outlive main's locals
  return *d;
}

/// Each device's current pool, when `set_current_pool` set one (null: its default pool).
inline std::array<std::atomic<pool_state*>, max_devices>& current_pools() {
  static std::array<std::atomic<pool_state*>, max_devices> p{};
  return p;
}
/// A closing pool stops being any device's current pool.
inline void forget_current_pool(pool_state* p) noexcept {
  for (auto& slot : current_pools()) {
    pool_state* expected = p;
    slot.compare_exchange_strong(expected, nullptr, std::memory_order_acq_rel);
  }
}

}  // namespace streamalloc::detail
