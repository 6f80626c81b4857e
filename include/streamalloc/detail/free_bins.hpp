#pragma once

// Free blocks binned by size, two-level segregated fit (after TLSF): sizes below 16 KiB have a
// bin per 256 bytes; above, each power of two is split into 32 bins, so a bin's sizes differ by
// at most 1/32. Insert, remove and "find a block of at least n bytes" are O(1) apart from a
// short scan of one bin, with no allocation: lists are intrusive (block::prev_free/next_free)
// and non-empty bins are found through a bitmap.

#include <streamalloc/detail/block.hpp>

#include <array>
#include <bit>
#include <cstdint>

namespace streamalloc::detail {

class free_bins {
 public:
  static constexpr std::uint64_t quantum = 256;  // every size is a multiple of this
  static constexpr unsigned linear_bins = 64;    // sizes < 64 * 256 = 16 KiB
  static constexpr unsigned sub_bins_log2 = 5;   // 32 bins per power of two above
  static constexpr unsigned first_log2 = 14;     // 16 KiB
  static constexpr unsigned max_log2 = 50;       // 1 PiB: larger sizes share the last bin
  static constexpr unsigned bin_count = linear_bins + (max_log2 - first_log2 + 1) * (1u << sub_bins_log2);

  /// The bin holding blocks of `size` bytes.
  static constexpr unsigned bin_of(std::uint64_t size) noexcept {
    if (size < linear_bins * quantum) return static_cast<unsigned>(size / quantum);
    unsigned l = static_cast<unsigned>(std::bit_width(size) - 1);
    if (l > max_log2) return bin_count - 1;
    unsigned sub = static_cast<unsigned>((size >> (l - sub_bins_log2)) & ((1u << sub_bins_log2) - 1));
    return linear_bins + (l - first_log2) * (1u << sub_bins_log2) + sub;
  }
  /// The smallest size a block in bin `b` can have.
  static constexpr std::uint64_t bin_floor(unsigned b) noexcept {
    if (b < linear_bins) return std::uint64_t{b} * quantum;
    unsigned l = first_log2 + (b - linear_bins) / (1u << sub_bins_log2);
    unsigned sub = (b - linear_bins) % (1u << sub_bins_log2);
    return (std::uint64_t{1} << l) + (std::uint64_t{sub} << (l - sub_bins_log2));
  }

  void insert(block* b) noexcept {
    const unsigned i = bin_of(b->size);
    b->bin = i;
    b->bins = this;
    b->prev_free = nullptr;
    b->next_free = heads_[i];
    if (heads_[i] != nullptr) heads_[i]->prev_free = b;
    heads_[i] = b;
    bitmap_[i / 64] |= std::uint64_t{1} << (i % 64);
    bytes_ += b->size;
    ++count_;
  }

  void remove(block* b) noexcept {
    const unsigned i = b->bin;
    if (b->prev_free != nullptr) {
      b->prev_free->next_free = b->next_free;
    } else {
      heads_[i] = b->next_free;
      if (heads_[i] == nullptr) bitmap_[i / 64] &= ~(std::uint64_t{1} << (i % 64));
    }
    if (b->next_free != nullptr) b->next_free->prev_free = b->prev_free;
    b->prev_free = b->next_free = nullptr;
    b->bins = nullptr;
    bytes_ -= b->size;
    --count_;
  }

  /// A block of at least `n` bytes for which `usable(block*)` holds: the smallest found in n's
  /// own bin (scanning at most `scan` entries), else the first usable in the next bins. Blocks
  /// from a bin above n's waste at most 1/32 (plus a bin) more than best fit. Null if none.
  template <class Usable>
  block* find(std::uint64_t n, Usable&& usable, unsigned max_bin = bin_count - 1,
              unsigned scan = 16) const noexcept {
    const unsigned first = bin_of(n);
    block* best = nullptr;
    unsigned seen = 0;
    for (block* b = heads_[first]; b != nullptr && seen < scan; b = b->next_free, ++seen) {
      if (b->size >= n && (best == nullptr || b->size < best->size) && usable(b)) best = b;
    }
    if (best != nullptr) return best;
    for (unsigned i = next_nonempty(first + 1); i <= max_bin && i < bin_count; i = next_nonempty(i + 1)) {
      seen = 0;
      for (block* b = heads_[i]; b != nullptr && seen < scan; b = b->next_free, ++seen) {
        if (usable(b)) return b;
      }
    }
    return nullptr;
  }

  template <class Fn>
  void for_each(Fn&& fn) const {
    for (unsigned i = next_nonempty(0); i < bin_count; i = next_nonempty(i + 1)) {
      for (block* b = heads_[i]; b != nullptr;) {
        block* next = b->next_free;  // fn may remove b
        fn(b);
        b = next;
      }
    }
  }

  /// The largest block's size (0 when empty).
  [[nodiscard]] std::uint64_t largest() const noexcept {
    for (unsigned w = words; w-- > 0;) {
      if (bitmap_[w] == 0) continue;
      const unsigned i = w * 64 + 63 - static_cast<unsigned>(std::countl_zero(bitmap_[w]));
      std::uint64_t m = 0;
      for (block* b = heads_[i]; b != nullptr; b = b->next_free) m = b->size > m ? b->size : m;
      return m;
    }
    return 0;
  }

  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] std::size_t count() const noexcept { return count_; }
  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }

 private:
  static constexpr unsigned words = (bin_count + 63) / 64;

  [[nodiscard]] unsigned next_nonempty(unsigned from) const noexcept {
    if (from >= bin_count) return bin_count;
    unsigned w = from / 64;
    std::uint64_t bits = bitmap_[w] & (~std::uint64_t{0} << (from % 64));
    while (bits == 0) {
      if (++w == words) return bin_count;
      bits = bitmap_[w];
    }
    return w * 64 + static_cast<unsigned>(std::countr_zero(bits));
  }

  std::array<block*, bin_count> heads_{};
  std::array<std::uint64_t, words> bitmap_{};
  std::uint64_t bytes_ = 0;
  std::size_t count_ = 0;
};

}  // namespace streamalloc::detail
