#pragma once

// A pool's addresses and physical memory: the virtual address reservations, made as the pool
// grows (the first small enough that thousands of pools fit in one process, each later one at
// least doubling what the pool has), the addresses of them not mapped, and the chunks of
// physical memory mapped into them. What the blocks on top of the chunks are, and when to
// grow, remap or release, is the pool core's business; this keeps the driver-facing side and
// its counters consistent. Not thread-safe: the pool's lock guards it, except for what is
// marked lock-free below.

#include <streamalloc/detail/core/address_ranges.hpp>
#include <streamalloc/detail/core/pool_backend.hpp>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <optional>
#include <utility>
#include <vector>

namespace streamalloc::detail {

template <pool_backend Backend>
class chunk_space {
 public:
  using handle = typename Backend::handle;
  /// Physical memory mapped at some address: its size and handle.
  struct chunk {
    std::uint64_t size;
    handle h;
    /// Earlier addresses where it is still mapped too (map_alias); while there are any, the
    /// pool neither moves nor releases it.
    std::uint32_t aliases = 0;
  };
  /// An earlier mapping of a chunk moved by map_alias: [va, va + size), kept until `owner`'s
  /// frees stamped up to `stamp` are known complete; the chunk is now at `chunk_va`.
  struct alias {
    std::uint64_t va, size, chunk_va;
    void* owner;
    std::uint64_t stamp;
  };
  /// Told of each reservation made (base, size), under the pool lock.
  using reserve_hook = std::function<void(std::uint64_t, std::uint64_t)>;

  /// Reserves the first addresses at once: a pool whose addresses cannot be had fails when
  /// made (the backend's reserve throws). `address_space`: the most addresses ever reserved;
  /// `chunk_size` sizes the first reservation.
  chunk_space(Backend& backend, std::uint64_t chunk_size, std::uint64_t address_space, reserve_hook on_reserve)
      : backend_(backend),
        granularity_(backend.granularity()),
        chunk_size_(chunk_size),
        limit_(round_up(address_space, granularity_)),
        on_reserve_(std::move(on_reserve)) {
    const std::uint64_t first = reservations_.next_size(0, limit_, first_reservation());
    add_reservation(backend_.reserve(first), first);
  }
  chunk_space(const chunk_space&) = delete;
  chunk_space& operator=(const chunk_space&) = delete;

  [[nodiscard]] std::uint64_t granularity() const noexcept { return granularity_; }

  // --- addresses -------------------------------------------------------------------------------

  /// The first reservation's base.
  [[nodiscard]] std::uint64_t base() const noexcept { return reservations_.first_base(); }
  /// The most addresses the pool reserves.
  [[nodiscard]] std::uint64_t limit() const noexcept { return limit_; }
  /// Addresses reserved so far (under the pool lock), and the reservations (base, size;
  /// lock-free).
  [[nodiscard]] std::uint64_t reserved_addresses() const noexcept { return reservations_.reserved(); }
  [[nodiscard]] std::vector<std::pair<std::uint64_t, std::uint64_t>> reservations() const {
    return reservations_.list();
  }
  /// Is `p` within the pool's reservations? Lock-free.
  [[nodiscard]] bool owns(std::uint64_t p) const noexcept { return reservations_.owns(p); }
  /// The size of the last reservation the driver refused (the process's addresses ran out);
  /// 0: none was.
  [[nodiscard]] std::uint64_t refused_reservation() const noexcept { return refused_; }

  /// The reserved addresses not mapped: where new chunks go.
  [[nodiscard]] address_ranges& free_addresses() noexcept { return free_; }

  /// Reserves addresses for a mapping of `bytes` (at `at`, when not 0), within the limit. False
  /// when the limit, the reservations' count, or the driver refuses.
  bool reserve_more(std::uint64_t bytes, std::uint64_t at = 0) {
    const std::uint64_t size = reservations_.next_size(bytes, limit_, first_reservation());
    if (size == 0) return false;
    const std::uint64_t base = backend_.try_reserve(size, at);
    if (base == 0) {
      if (at == 0) refused_ = size;
      return false;
    }
    add_reservation(base, size);
    return true;
  }

  /// Takes `bytes` of free addresses, reserving more when none are left; nullopt if they
  /// cannot be had.
  std::optional<std::uint64_t> take_or_reserve(std::uint64_t bytes) {
    std::optional<std::uint64_t> at = free_.take(bytes);
    if (!at && reserve_more(bytes)) at = free_.take(bytes);
    return at;
  }

  // --- physical memory -------------------------------------------------------------------------

  /// `bytes` of physical memory were made for the pool (one growth, of one or more chunks):
  /// they count as held from here.
  void note_growth(std::uint64_t bytes) noexcept {
    held_ += bytes;
    held_high_ = std::max(held_high_, held_);
    held_seen_.store(held_, std::memory_order_relaxed);
    ++grows_;
  }
  /// Maps `c` at `va`, whose addresses were taken from free_addresses(). If it cannot be
  /// mapped (the driver fails, or no host memory for the entry), the memory goes back to the
  /// device, its bytes no longer count as held, and the error propagates.
  void map(std::uint64_t va, chunk c) {
    typename std::map<std::uint64_t, chunk>::iterator it;
    try {
      it = chunks_.emplace(va, std::move(c)).first;
    } catch (...) {  // the node is allocated before `c` is moved into it: `c` still holds it
      release(std::move(c));
      throw;
    }
    try {
      backend_.map(va, it->second.size, it->second.h);
    } catch (...) {
      chunk lost = std::move(it->second);
      chunks_.erase(it);
      release(std::move(lost));
      throw;
    }
  }
  /// Unmaps the chunk at `va` and gives its addresses back; returns it, still held (to map
  /// elsewhere, or to release).
  chunk unmap(std::uint64_t va) noexcept {
    auto node = chunks_.extract(va);
    backend_.unmap(va, node.mapped().size);
    free_.give_back_or_drop(va, node.mapped().size);
    return std::move(node.mapped());
  }
  /// Unmaps the chunk at `va` and returns it, still held; its addresses stay taken (other
  /// physical memory is mapped there next: pool_graph_memory.hpp).
  chunk unmap_in_place(std::uint64_t va) noexcept {
    auto node = chunks_.extract(va);
    backend_.unmap(va, node.mapped().size);
    return std::move(node.mapped());
  }
  /// Maps the chunk at `va` at `dst` too (addresses taken from free_addresses()), where it is
  /// found from now on; the mapping at `va` stays, addresses included, until unmap_aliases
  /// finds `owner`'s frees up to `stamp` complete. May throw (the driver refuses, or no host
  /// memory), changing nothing.
  void map_alias(std::uint64_t va, std::uint64_t dst, void* owner, std::uint64_t stamp) {
    aliases_.reserve(aliases_.size() + 1);
    auto it = chunks_.find(va);
    backend_.map(dst, it->second.size, it->second.h);
    auto node = chunks_.extract(it);
    node.key() = dst;
    ++node.mapped().aliases;
    aliases_.push_back({va, node.mapped().size, dst, owner, stamp});
    chunks_.insert(std::move(node));
  }
  /// Undoes the last map_alias, whose chunk is now found at `dst`: unmapped there and found at
  /// its old place again. The addresses at `dst` stay taken (the caller gives them back).
  void undo_alias(std::uint64_t dst) noexcept {
    const alias a = aliases_.back();
    aliases_.pop_back();
    backend_.unmap(dst, a.size);
    auto node = chunks_.extract(dst);
    node.key() = a.va;
    --node.mapped().aliases;
    chunks_.insert(std::move(node));
  }
  /// Unmaps the earlier mappings for which `done(owner, stamp)` holds and gives their
  /// addresses back; returns how many.
  template <class Done>
  std::size_t unmap_aliases(Done&& done) noexcept {
    std::size_t n = 0;
    for (std::size_t i = 0; i < aliases_.size();) {
      const alias a = aliases_[i];
      if (!done(a.owner, a.stamp)) {
        ++i;
        continue;
      }
      backend_.unmap(a.va, a.size);
      free_.give_back_or_drop(a.va, a.size);
      --chunks_.at(a.chunk_va).aliases;
      aliases_[i] = aliases_.back();
      aliases_.pop_back();
      ++n;
    }
    return n;
  }
  [[nodiscard]] const std::vector<alias>& aliases() const noexcept { return aliases_; }
  /// Physical memory made for the pool outside its chunks (pages shared by graphs): counts as
  /// held until given to release().
  void note_held(std::uint64_t bytes) noexcept {
    held_ += bytes;
    held_high_ = std::max(held_high_, held_);
    held_seen_.store(held_, std::memory_order_relaxed);
  }
  /// Gives physical memory back to the device.
  void release(chunk c) noexcept {
    backend_.release(c.h);
    held_ -= c.size;
    held_seen_.store(held_, std::memory_order_relaxed);
  }
  /// Unmaps and releases every chunk (the pool is closing). The addresses stay reserved.
  void release_all() noexcept {
    unmap_aliases([](void*, std::uint64_t) { return true; });
    while (!chunks_.empty()) release(unmap(chunks_.begin()->first));
  }

  /// The mapped chunks by address.
  [[nodiscard]] const std::map<std::uint64_t, chunk>& chunks() const noexcept { return chunks_; }
  /// For tests: are the free addresses disjoint from each other and from every mapping of a
  /// chunk (aliases' earlier places included)? A range given back twice, or while mapped there,
  /// would be handed out over a mapping.
  [[nodiscard]] bool addresses_consistent() const {
    const auto& ranges = free_.ranges();
    std::uint64_t end = 0;
    for (const auto& [at, size] : ranges) {
      if (at < end) return false;
      end = at + size;
    }
    auto overlaps_free = [&](std::uint64_t va, std::uint64_t size) {
      auto it = ranges.upper_bound(va);  // the first range starting after va
      if (it != ranges.end() && it->first < va + size) return true;
      return it != ranges.begin() && std::prev(it)->first + std::prev(it)->second > va;
    };
    for (const auto& [va, c] : chunks_) {
      if (overlaps_free(va, c.size)) return false;
    }
    for (const alias& a : aliases_) {
      if (overlaps_free(a.va, a.size)) return false;
    }
    return true;
  }

  // --- counters --------------------------------------------------------------------------------

  /// Physical bytes held now, and the most held since made or reset.
  [[nodiscard]] std::uint64_t held() const noexcept { return held_; }
  [[nodiscard]] std::uint64_t held_high() const noexcept { return held_high_; }
  /// The same as held(), for readers without the lock (a relaxed copy).
  [[nodiscard]] std::uint64_t held_seen() const noexcept { return held_seen_.load(std::memory_order_relaxed); }
  void reset_high() noexcept { held_high_ = held_; }
  /// Growths (note_growth), and chunks remapped (note_remap).
  [[nodiscard]] std::uint64_t grows() const noexcept { return grows_; }
  [[nodiscard]] std::uint64_t remapped() const noexcept { return remapped_; }
  void note_remap() noexcept { ++remapped_; }

 private:
  static std::uint64_t round_up(std::uint64_t v, std::uint64_t to) { return (v + to - 1) / to * to; }

  /// The first reservation: 8 GiB (128 default chunks), or 16 chunks when they are larger.
  std::uint64_t first_reservation() const noexcept {
    return round_up(std::max<std::uint64_t>(8ull << 30, 16 * chunk_size_), granularity_);
  }
  /// Out of host memory it throws with the addresses unused: the hook (the process's directory
  /// of pools) hears first, as an address the pool hands out must be found there.
  void add_reservation(std::uint64_t base, std::uint64_t size) {
    if (on_reserve_) on_reserve_(base, size);
    free_.add_reservation(base, size);
    reservations_.add(base, size);
  }

  Backend& backend_;
  std::uint64_t granularity_;
  std::uint64_t chunk_size_;
  std::uint64_t limit_;
  reserve_hook on_reserve_;
  reservation_list reservations_;
  std::uint64_t refused_ = 0;
  address_ranges free_;
  std::map<std::uint64_t, chunk> chunks_;
  std::vector<alias> aliases_;
  std::uint64_t held_ = 0, held_high_ = 0;
  std::atomic<std::uint64_t> held_seen_{0};
  std::uint64_t grows_ = 0, remapped_ = 0;
};

}  // namespace streamalloc::detail
