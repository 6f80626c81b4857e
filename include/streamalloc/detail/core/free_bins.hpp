#pragma once

// Free blocks binned by size, two-level segregated fit (after TLSF): sizes below 16 KiB have a
// bin per 256 bytes; above, each power of two is split into 32 bins, so a bin's sizes differ by
// at most 1/32. Insert, remove and "find a block of at least n bytes" are O(1) apart from a
// short scan of one bin: lists are intrusive (block::prev_free/next_free) and non-empty bins
// are found through a bitmap. The only allocation is a bin group's first use (below).
//
// Every stream a pool serves has two of these (its cache and its pending frees), so their size
// is a cost per stream: with all 1,248 list heads inline they were 10 KiB each, and a ring over
// 10,000 streams spent its time missing the caches on them. The heads come in groups of 64 bins
// (512 bytes), made when a bin of the group is first used and kept: a stream that frees a few
// sizes holds a few hundred bytes. A group that cannot be made (out of host memory) does not
// fail the insert: the block goes to an overflow list, which find and the walks also read.

#include <streamalloc/detail/core/block.hpp>

#include <array>
#include <bit>
#include <cstdint>
#include <new>

namespace streamalloc::detail {

class free_bins {
 public:
  static constexpr std::uint64_t quantum = 256;  // every size is a multiple of this
  static constexpr unsigned linear_bins = 64;    // sizes < 64 * 256 = 16 KiB
  static constexpr unsigned sub_bins_log2 = 5;   // 32 bins per power of two above
  static constexpr unsigned first_log2 = 14;     // 16 KiB
  static constexpr unsigned max_log2 = 50;       // 1 PiB: larger sizes share the last bin
  static constexpr unsigned bin_count = linear_bins + (max_log2 - first_log2 + 1) * (1u << sub_bins_log2);

  free_bins() = default;
  free_bins(const free_bins&) = delete;
  free_bins& operator=(const free_bins&) = delete;
  ~free_bins() {
    for (group& g : groups_) delete[] g.heads;
  }

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
    unsigned i = bin_of(b->size);
    block** head = head_of(i);
    if (head == nullptr) {
      i = overflow_bin;
      head = &overflow_;
    } else {
      groups_[i / group_size].bits |= std::uint64_t{1} << (i % group_size);
    }
    b->bin = i;
    b->bins = this;
    b->prev_free = nullptr;
    b->next_free = *head;
    if (*head != nullptr) (*head)->prev_free = b;
    *head = b;
    bytes_ += b->size;
    ++count_;
  }

  void remove(block* b) noexcept {
    const unsigned i = b->bin;
    if (b->prev_free != nullptr) {
      b->prev_free->next_free = b->next_free;
    } else if (i == overflow_bin) {
      overflow_ = b->next_free;
    } else {
      group& g = groups_[i / group_size];
      block*& head = g.heads[i % group_size];
      head = b->next_free;
      if (head == nullptr) g.bits &= ~(std::uint64_t{1} << (i % group_size));
    }
    if (b->next_free != nullptr) b->next_free->prev_free = b->prev_free;
    b->prev_free = b->next_free = nullptr;
    b->bins = nullptr;
    bytes_ -= b->size;
    --count_;
  }

  /// A block of at least `n` bytes for which `usable(block*)` holds: the smallest found in n's
  /// own bin (scanning at most `scan` entries), else the first usable in the next bins up to
  /// `max_bin`. Blocks from a bin above n's waste at most 1/32 (plus a bin) more than best fit.
  /// Null if none.
  template <class Usable>
  block* find(std::uint64_t n, Usable&& usable, unsigned max_bin = bin_count - 1,
              unsigned scan = 16) const noexcept {
    const unsigned first = bin_of(n);
    block* best = nullptr;
    unsigned seen = 0;
    for (block* b = bin_head(first); b != nullptr && seen < scan; b = b->next_free, ++seen) {
      if (b->size >= n && (best == nullptr || b->size < best->size) && usable(b)) best = b;
    }
    if (best != nullptr) return best;
    for (unsigned i = next_nonempty(first + 1); i <= max_bin && i < bin_count; i = next_nonempty(i + 1)) {
      seen = 0;
      for (block* b = bin_head(i); b != nullptr && seen < scan; b = b->next_free, ++seen) {
        if (usable(b)) return b;
      }
    }
    // Only after host memory ran out: the best fit within reach among the overflow.
    for (block* b = overflow_; b != nullptr; b = b->next_free) {
      if (b->size >= n && bin_of(b->size) <= max_bin && (best == nullptr || b->size < best->size) && usable(b)) {
        best = b;
      }
    }
    return best;
  }

  template <class Fn>
  void for_each(Fn&& fn) const {
    auto walk = [&](block* b) {
      while (b != nullptr) {
        block* next = b->next_free;  // fn may remove b
        fn(b);
        b = next;
      }
    };
    for (unsigned i = next_nonempty(0); i < bin_count; i = next_nonempty(i + 1)) walk(bin_head(i));
    walk(overflow_);
  }

  /// The first block of the smallest bin that has one (the overflow list's when only it has);
  /// null when empty.
  [[nodiscard]] block* first() const noexcept {
    const unsigned i = next_nonempty(0);
    return i < bin_count ? bin_head(i) : overflow_;
  }

  /// The largest block's size (0 when empty).
  [[nodiscard]] std::uint64_t largest() const noexcept {
    std::uint64_t m = 0;
    for (block* b = overflow_; b != nullptr; b = b->next_free) m = b->size > m ? b->size : m;
    for (unsigned w = group_count; w-- > 0;) {
      if (groups_[w].bits == 0) continue;
      const unsigned i = w * group_size + group_size - 1 - static_cast<unsigned>(std::countl_zero(groups_[w].bits));
      for (block* b = bin_head(i); b != nullptr; b = b->next_free) m = b->size > m ? b->size : m;
      break;
    }
    return m;
  }

  [[nodiscard]] std::uint64_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] std::size_t count() const noexcept { return count_; }
  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
  /// Blocks held in the overflow list (for tests: non-zero only after a group could not be made).
  [[nodiscard]] std::size_t overflow_count() const noexcept {
    std::size_t n = 0;
    for (block* b = overflow_; b != nullptr; b = b->next_free) ++n;
    return n;
  }

 private:
  static constexpr unsigned group_size = 64;  // bins per group of heads: one word of bits
  static constexpr unsigned group_count = (bin_count + group_size - 1) / group_size;
  static constexpr unsigned overflow_bin = bin_count;  // block::bin of a block in the overflow list

  /// The head of bin `i`'s list, its group made if need be; null if the group cannot be made.
  block** head_of(unsigned i) noexcept {
    block**& g = groups_[i / group_size].heads;
    if (g == nullptr) [[unlikely]] {
      g = new (std::nothrow) block*[group_size]();
      if (g == nullptr) return nullptr;
    }
    return &g[i % group_size];
  }
  /// The first block of bin `i`; null if empty or never used.
  [[nodiscard]] block* bin_head(unsigned i) const noexcept {
    block* const* g = groups_[i / group_size].heads;
    return g == nullptr ? nullptr : g[i % group_size];
  }

  [[nodiscard]] unsigned next_nonempty(unsigned from) const noexcept {
    if (from >= bin_count) return bin_count;
    unsigned w = from / group_size;
    std::uint64_t bits = groups_[w].bits & (~std::uint64_t{0} << (from % group_size));
    while (bits == 0) {
      if (++w == group_count) return bin_count;
      bits = groups_[w].bits;
    }
    return w * group_size + static_cast<unsigned>(std::countr_zero(bits));
  }

  // A group's bits (which of its bins hold blocks) beside its heads' pointer: a bin's lookup
  // reads one line of this object, not one of a bitmap and another of the pointers, which is
  // what a stream's first use after many others costs (a ring over thousands of streams).
  struct group {
    std::uint64_t bits = 0;
    block** heads = nullptr;
  };
  std::array<group, group_count> groups_{};
  block* overflow_ = nullptr;
  std::uint64_t bytes_ = 0;
  std::size_t count_ = 0;
};

}  // namespace streamalloc::detail
