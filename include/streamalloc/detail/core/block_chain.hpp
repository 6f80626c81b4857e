#pragma once

// The blocks of a pool's mapped memory, live or free, in address order: each contiguous mapped
// run is a chain of blocks linked to their address neighbours (block::prev_addr, next_addr),
// the runs are kept by start, and every block is indexed by its start address, so that the
// block holding any address is found in a few cache lines. Which blocks may merge and which
// bins they sit in is the pool's business; this only keeps the chain, the runs and the index
// consistent with each other. Not thread-safe: the pool's lock guards it.

#include <streamalloc/detail/core/address_index.hpp>
#include <streamalloc/detail/core/block.hpp>

#include <cstdint>
#include <iterator>
#include <map>
#include <utility>

namespace streamalloc::detail {

class block_chain {
 public:
  /// Puts newly mapped [va, va + size) into the chain as one block, joining the run that ends at
  /// `va` and the run that starts at `va + size`, if any. Returns the block (in no bins).
  block* place(std::uint64_t va, std::uint64_t size) {
    block* b = make(va, size);
    std::uint64_t run_start = va, run_end = va + size;
    if (const auto before = run_ending_at(va); before != runs_.end()) {
      run_start = before->first;
      block* prev = index_.before(va);
      prev->next_addr = b;
      b->prev_addr = prev;
      runs_.erase(before);
    }
    if (const auto after = runs_.find(va + size); after != runs_.end()) {
      run_end = after->second;
      block* next = index_.find(va + size);
      next->prev_addr = b;
      b->next_addr = next;
      runs_.erase(after);
    }
    runs_[run_start] = run_end;
    return b;
  }

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
    index_.erase(x->addr);
    arena_.recycle(x);
  }

  /// Moves `x`'s start up by `bytes`, which its predecessor has taken over.
  void give_front(block* x, std::uint64_t bytes) {
    index_.erase(x->addr);
    x->addr += bytes;
    x->size -= bytes;
    index_.insert(x->addr, x);
  }

  /// Takes [va, va + size) out of the chain (it is being unmapped): the block `b` holding it
  /// is replaced by the pieces before and after the range, returned (null where there is none,
  /// in no bins), and the run holding it is split in two.
  std::pair<block*, block*> cut(block* b, std::uint64_t va, std::uint64_t size) {
    block* before = b->addr < va ? arena_.make(b->addr, va - b->addr) : nullptr;
    block* after = b->addr + b->size > va + size ? arena_.make(va + size, b->addr + b->size - va - size) : nullptr;
    block* prev = b->prev_addr;
    block* next = b->next_addr;
    index_.erase(b->addr);
    arena_.recycle(b);
    if (before != nullptr) {
      before->prev_addr = prev;
      if (prev != nullptr) prev->next_addr = before;
      index_.insert(before->addr, before);
    } else if (prev != nullptr) {
      prev->next_addr = nullptr;
    }
    if (after != nullptr) {
      after->next_addr = next;
      if (next != nullptr) next->prev_addr = after;
      index_.insert(after->addr, after);
    } else if (next != nullptr) {
      next->prev_addr = nullptr;
    }
    const auto run = std::prev(runs_.upper_bound(va));
    const std::uint64_t run_start = run->first, run_end = run->second;
    runs_.erase(run);
    if (run_start < va) runs_[run_start] = va;
    if (va + size < run_end) runs_[va + size] = run_end;
    return {before, after};
  }

  /// The block starting at or before `addr` (the one holding it, if `addr` is mapped); null if none.
  [[nodiscard]] block* at_or_before(std::uint64_t addr) const noexcept { return index_.at_or_before(addr); }
  /// The block starting before `addr` (at `addr - 1` or below); null if none.
  [[nodiscard]] block* before(std::uint64_t addr) const noexcept { return index_.before(addr); }
  /// The block starting at `addr`; null if none.
  [[nodiscard]] block* starting_at(std::uint64_t addr) const noexcept { return index_.find(addr); }

  /// The mapped runs: start -> end.
  [[nodiscard]] const std::map<std::uint64_t, std::uint64_t>& runs() const noexcept { return runs_; }
  /// Blocks in the chain.
  [[nodiscard]] std::size_t size() const noexcept { return index_.size(); }

 private:
  block* make(std::uint64_t va, std::uint64_t size) {
    block* b = arena_.make(va, size);
    try {
      index_.insert(va, b);
    } catch (...) {
      arena_.recycle(b);
      throw;
    }
    return b;
  }
  // Runs do not overlap: the one ending at `end`, if any, is the last one starting below it.
  std::map<std::uint64_t, std::uint64_t>::iterator run_ending_at(std::uint64_t end) {
    auto it = runs_.lower_bound(end);
    if (it == runs_.begin()) return runs_.end();
    --it;
    return it->second == end ? it : runs_.end();
  }

  block_arena arena_;
  address_index<block> index_;                   // every block, live or free, by start
  std::map<std::uint64_t, std::uint64_t> runs_;  // contiguous mapped runs: start -> end
};

}  // namespace streamalloc::detail
