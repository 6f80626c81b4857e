#pragma once

// The blocks of a pool's mapped memory, live or free, in address order: each contiguous mapped
// run is a chain of blocks linked to their address neighbours (block::prev_addr, next_addr),
// the runs are kept by start, and every block is indexed by its start address, so that the
// block holding any address is found in a few cache lines. Blocks made lately wait in a hash
// table (fresh_blocks.hpp) until the index is asked or the table fills: most are merged away
// again first, and never cost the index an insert and an erase. Which blocks may merge and which
// bins they sit in is the pool's business; this only keeps the chain, the runs and the index
// consistent with each other. Not thread-safe: the pool's lock guards it.

#include <streamalloc/detail/core/address_index.hpp>
#include <streamalloc/detail/core/block.hpp>
#include <streamalloc/detail/core/fresh_blocks.hpp>

#include <cstdint>
#include <iterator>
#include <map>
#include <new>
#include <utility>

namespace streamalloc::detail {

class block_chain {
 public:
  /// What placing [va, va + size) in the chain needs of host memory, taken ahead by
  /// prepare_place: the block, indexed but linked to nothing, and a run entry of its own.
  struct placed {
    block* b = nullptr;
  };

  /// Takes what placing newly mapped [va, va + size) needs: may throw, out of host memory,
  /// having changed nothing. Until finish_place or abandon_place the chain may be cut
  /// elsewhere (prepare_cut, finish_cut), even in the run that ends at `va`.
  placed prepare_place(std::uint64_t va, std::uint64_t size) {
    const auto run = runs_.emplace(va, va + size).first;
    try {
      return placed{make(va, size)};
    } catch (...) {
      runs_.erase(run);
      throw;
    }
  }
  /// Links the prepared block to the runs that end at its start and start at its end, if any.
  /// Returns it (in no bins).
  block* finish_place(const placed& p) noexcept {
    block* b = p.b;
    const std::uint64_t va = b->addr, end = va + b->size;
    auto run = runs_.find(va);
    if (const auto before = run_ending_at(va); before != runs_.end()) {
      block* prev = at_or_before(va - 1);  // the last block of the run ending at va
      prev->next_addr = b;
      b->prev_addr = prev;
      runs_.erase(run);
      run = before;
    }
    run->second = end;
    if (const auto after = runs_.find(end); after != runs_.end()) {
      block* next = starting_at(end);
      next->prev_addr = b;
      b->next_addr = next;
      run->second = after->second;
      runs_.erase(after);
    }
    return b;
  }
  /// Gives back what prepare_place took: the range was not mapped after all.
  void abandon_place(const placed& p) noexcept {
    runs_.erase(p.b->addr);
    forget(p.b->addr);
    arena_.recycle(p.b);
  }

  /// Puts newly mapped [va, va + size) into the chain as one block, joining the run that ends at
  /// `va` and the run that starts at `va + size`, if any. Returns the block (in no bins). Out
  /// of host memory it throws having changed nothing (the caller still holds the mapping).
  block* place(std::uint64_t va, std::uint64_t size) { return finish_place(prepare_place(va, size)); }

  /// Cuts `b` after its first `n` bytes; returns the rest as a block of its own, linked after
  /// `b`, in no bins.
  block* split(block* b, std::uint64_t n) {
    block* rest = make(b->addr + n, b->size - n);
    rest->prev_addr = b;
    rest->next_addr = b->next_addr;
    if (b->next_addr != nullptr) b->next_addr->prev_addr = rest;
    b->next_addr = rest;
    b->size = n;
    return rest;
  }

  /// Removes `x`, whose bytes its predecessor has taken over, and recycles it.
  void unlink(block* x) {
    if (x->prev_addr != nullptr) x->prev_addr->next_addr = x->next_addr;
    if (x->next_addr != nullptr) x->next_addr->prev_addr = x->prev_addr;
    forget(x->addr);
    arena_.recycle(x);
  }

  /// Makes sure the next give_front needs no host memory (its new index entry may split nodes):
  /// may throw std::bad_alloc, changing nothing.
  void reserve_give_front() { index_.reserve_insert(); }

  /// Moves `x`'s start up by `bytes`, which its predecessor has taken over. Needs host memory
  /// unless reserve_give_front came just before.
  void give_front(block* x, std::uint64_t bytes) {
    forget(x->addr);
    x->addr += bytes;
    x->size -= bytes;
    index_.insert(x->addr, x);
  }

  /// What cutting [va, va + size) out of the chain needs of host memory, taken ahead by
  /// prepare_cut: where the range starts, and the pieces before and after it (the entry of the
  /// run after it is in the runs already).
  struct cut_pieces {
    std::uint64_t va = 0;
    block* before = nullptr;
    block* after = nullptr;
  };

  /// Takes what cutting [va, va + size) needs, where the blocks from `first` to `last` (linked)
  /// cover it: may throw, out of host memory, having changed nothing. Until finish_cut the
  /// chain is used for nothing but joining those blocks into `first` (unlink).
  cut_pieces prepare_cut(const block* first, const block* last, std::uint64_t va, std::uint64_t size) {
    const std::uint64_t run_end = std::prev(runs_.upper_bound(va))->second;
    const std::uint64_t last_end = last->addr + last->size;
    cut_pieces p{va, nullptr, nullptr};
    p.before = first->addr < va ? arena_.make(first->addr, va - first->addr) : nullptr;
    try {
      if (last_end > va + size) p.after = make(va + size, last_end - va - size);
      if (va + size < run_end) runs_.emplace(va + size, run_end);
    } catch (...) {
      if (p.after != nullptr) {
        forget(p.after->addr);
        arena_.recycle(p.after);
      }
      if (p.before != nullptr) arena_.recycle(p.before);
      throw;
    }
    return p;
  }

  /// Takes the range out: `b`, now the one block covering it, is replaced by the pieces before
  /// and after it, returned (null where there is none, in no bins), and the run holding it is
  /// split in two. Needs nothing more.
  std::pair<block*, block*> finish_cut(block* b, const cut_pieces& p) noexcept {
    const auto run = std::prev(runs_.upper_bound(p.va));
    block* prev = b->prev_addr;
    block* next = b->next_addr;
    if (p.before != nullptr) {
      // b's start: replaced, no new entry.
      if (!fresh_.assign(p.before->addr, p.before)) index_.assign(p.before->addr, p.before);
      p.before->prev_addr = prev;
      if (prev != nullptr) prev->next_addr = p.before;
    } else {
      forget(b->addr);
      if (prev != nullptr) prev->next_addr = nullptr;
    }
    arena_.recycle(b);
    if (p.after != nullptr) {
      p.after->next_addr = next;
      if (next != nullptr) next->prev_addr = p.after;
    } else if (next != nullptr) {
      next->prev_addr = nullptr;
    }
    if (run->first < p.va) {
      run->second = p.va;
    } else {
      runs_.erase(run);
    }
    return {p.before, p.after};
  }

  /// Takes [va, va + size) out of the chain (it is being unmapped): prepare_cut and finish_cut
  /// for the one block `b` holding it. Out of host memory it throws having changed nothing.
  std::pair<block*, block*> cut(block* b, std::uint64_t va, std::uint64_t size) {
    return finish_cut(b, prepare_cut(b, b, va, size));
  }

  /// An entry of the runs made ahead (spare_run), for a cut that may not fail (cut_whole).
  using run_node = std::map<std::uint64_t, std::uint64_t>::node_type;
  /// Makes a run entry now, where running out of host memory may throw, for a cut_whole later.
  static run_node spare_run() {
    std::map<std::uint64_t, std::uint64_t> m;
    m.emplace(0, 0);
    return m.extract(m.begin());
  }
  /// Takes `b`'s whole range out of the chain without host memory, for callers that may not
  /// fail (a gone graph's pieces): where the range splits a run, `spare` (from spare_run)
  /// becomes the entry of the run's part after it; else it stays unused.
  void cut_whole(block* b, run_node& spare) noexcept {
    const std::uint64_t end = b->addr + b->size;
    const std::uint64_t run_end = std::prev(runs_.upper_bound(b->addr))->second;
    if (end < run_end) {
      spare.key() = end;
      spare.mapped() = run_end;
      runs_.insert(std::move(spare));  // a node handle's insert allocates nothing
    }
    (void)finish_cut(b, cut_pieces{b->addr, nullptr, nullptr});
  }

  /// The block starting at or before `addr` (the one holding it, if `addr` is mapped); null if none.
  [[nodiscard]] block* at_or_before(std::uint64_t addr) const noexcept {
    take_in_fresh();
    block* b = index_.at_or_before(addr);
    if (!fresh_.empty()) [[unlikely]] {  // what the index could not take in, out of host memory
      block* f = fresh_.at_or_before(addr);
      if (f != nullptr && (b == nullptr || f->addr > b->addr)) b = f;
    }
    return b;
  }
  /// The block starting before `addr` (at `addr - 1` or below); null if none.
  [[nodiscard]] block* before(std::uint64_t addr) const noexcept { return addr == 0 ? nullptr : at_or_before(addr - 1); }
  /// The block starting at `addr`; null if none.
  [[nodiscard]] block* starting_at(std::uint64_t addr) const noexcept {
    if (block* f = fresh_.find(addr)) return f;
    return index_.find(addr);
  }

  /// The mapped runs: start -> end.
  [[nodiscard]] const std::map<std::uint64_t, std::uint64_t>& runs() const noexcept { return runs_; }
  /// Blocks in the chain.
  [[nodiscard]] std::size_t size() const noexcept { return index_.size() + fresh_.size(); }

 private:
  block* make(std::uint64_t va, std::uint64_t size) {
    block* b = arena_.make(va, size);
    try {
      if (straight_to_index_ != 0) {
        --straight_to_index_;
        index_.insert(va, b);
        return b;
      }
      if (fresh_.full()) {
        // Fewer than half of the blocks the table took in were merged away before it filled:
        // it only delays the index's inserts, at the cost of a hash insert and a sort each
        // (a pool growing by many small blocks that stay). The next ones go straight there.
        // (This block is the window's first.)
        if (fresh_made_ < 2 * fresh_blocks::max_entries) straight_to_index_ = 15 * fresh_blocks::max_entries - 1;
        take_in_fresh();
        if (straight_to_index_ != 0 || fresh_.full()) {
          index_.insert(va, b);
          return b;
        }
      }
      try {
        fresh_.insert(va, b);
        ++fresh_made_;
        return b;
      } catch (const std::bad_alloc&) {  // the table could not grow: straight to the index
      }
      index_.insert(va, b);
    } catch (...) {
      arena_.recycle(b);
      throw;
    }
    return b;
  }
  /// The fresh blocks into the index, as far as host memory allows: what it cannot take stays
  /// in the table, where lookups find it too.
  void take_in_fresh() const noexcept {
    if (fresh_.empty()) return;
    try {
      fresh_.drain([this](std::uint64_t va, block* b) { index_.insert(va, b); });
    } catch (const std::bad_alloc&) {
    }
    fresh_made_ = fresh_.size();
  }
  /// Removes `va`'s entry, wherever it is.
  void forget(std::uint64_t va) noexcept {
    if (!fresh_.erase(va)) index_.erase(va);
  }
  // Runs do not overlap: the one ending at `end`, if any, is the last one starting below it.
  std::map<std::uint64_t, std::uint64_t>::iterator run_ending_at(std::uint64_t end) {
    auto it = runs_.lower_bound(end);
    if (it == runs_.begin()) return runs_.end();
    --it;
    return it->second == end ? it : runs_.end();
  }

  block_arena arena_;
  // Every block, live or free, by start: in the index, or lately made and in fresh_. Both are
  // brought up to date by lookups, which are const: mutable.
  mutable address_index<block> index_;
  mutable fresh_blocks fresh_;
  mutable std::size_t fresh_made_ = 0;  // blocks put in fresh_ since it was last drained
  std::size_t straight_to_index_ = 0;   // blocks still to make straight into the index
  std::map<std::uint64_t, std::uint64_t> runs_;  // contiguous mapped runs: start -> end
};

}  // namespace streamalloc::detail
