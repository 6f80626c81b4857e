#pragma once

// A pool's block map: every block by its start address, up to millions of them, asked for the
// block at or just before an address. A B+tree of small sorted arrays rather than a std::map: a
// red-black tree's node per entry costs a cache miss per level (some 20 levels for a million
// blocks) and an allocation per insert, which made the map nearly half of the cost of a free.
// Here a lookup among a million blocks reads a few cache lines in each of four nodes, and
// nodes are recycled, so inserts and erases allocate only when the tree outgrows its spares.
// Measured on a million random keys: 5 to 9 times as fast as the std::map for inserts,
// erases and at_or_before.

#include <algorithm>
#include <cassert>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace streamalloc::detail {

/// Distinct 64-bit keys to `V*`, ordered. Not thread-safe: the pool's lock guards it.
template <class V>
class address_index {
 public:
  address_index() = default;
  address_index(const address_index&) = delete;
  address_index& operator=(const address_index&) = delete;
  address_index(address_index&& other) noexcept { take_from(other); }
  address_index& operator=(address_index&& other) noexcept {
    if (this != &other) {
      clear();
      take_from(other);
    }
    return *this;
  }
  ~address_index() { clear(); }

  /// Adds `key`, which must not be present.
  void insert(std::uint64_t key, V* value) { put(key, value, false); }
  /// Adds `key`, or gives it a new value if present.
  void assign(std::uint64_t key, V* value) { put(key, value, true); }
  /// Removes `key`, which must be present.
  void erase(std::uint64_t key);
  /// Makes sure that the next insert (or assign) needs no host memory, whatever it splits: the
  /// nodes a split at every level needs are taken now. Throws std::bad_alloc, changing nothing
  /// that a lookup sees, when they cannot be had.
  void reserve_insert() { reserve(1, height_ + 1); }

  /// The value of `key`; null if absent.
  [[nodiscard]] V* find(std::uint64_t key) const noexcept {
    const leaf* l = leaf_for(key);
    if (l == nullptr) return nullptr;
    const unsigned i = search(l->keys, l->count, key);
    return i > 0 && l->keys[i - 1] == key ? l->values[i - 1] : nullptr;
  }
  /// The value of the greatest key <= `key`; null if none.
  [[nodiscard]] V* at_or_before(std::uint64_t key) const noexcept {
    const leaf* l = leaf_for(key);
    if (l == nullptr) return nullptr;
    const unsigned i = search(l->keys, l->count, key);
    if (i > 0) return l->values[i - 1];
    // All of l is above `key`, and all of the leaf before it below: the answer ends that one.
    return l->prev != nullptr ? l->prev->values[l->prev->count - 1] : nullptr;
  }
  /// The value of the greatest key < `key`; null if none.
  [[nodiscard]] V* before(std::uint64_t key) const noexcept { return key == 0 ? nullptr : at_or_before(key - 1); }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  /// Removes every entry and frees all memory, spare nodes included.
  void clear() noexcept;

  /// For tests: is the tree well formed (keys sorted and within their parents' separators,
  /// every node but the root at least half full, all leaves at one depth and chained in order,
  /// size() right)?
  [[nodiscard]] bool check_invariants() const;

 private:
  // 64 entries make a leaf 1 KiB. Leaves and inner nodes of 32 to 128 came within 15% of each
  // other on a million keys; 64 was at or near the best for inserts, erases and lookups alike
  // (32 adds a level and more merges, 128 longer shifts).
  static constexpr unsigned leaf_capacity = 64;
  static constexpr unsigned inner_capacity = 64;  // children
  static constexpr unsigned leaf_min = leaf_capacity / 2;
  static constexpr unsigned inner_min = inner_capacity / 2;
  // 32 children an inner node at least: 12 levels hold more than 2^64 / 256 keys.
  static constexpr unsigned max_height = 12;
  // Spare nodes kept for the next growth; beyond these a node is freed, so that memory follows
  // the size when a pool shrinks from a million blocks to ten.
  static constexpr unsigned max_spares = 64;

  struct leaf {
    unsigned count;
    leaf* prev;  // the leaves in key order, for at_or_before's step back
    leaf* next;  // also the link of the spares
    std::uint64_t keys[leaf_capacity];
    V* values[leaf_capacity];
  };
  struct inner {
    unsigned count;  // children
    inner* next_spare;
    std::uint64_t keys[inner_capacity - 1];  // keys[i]: above the keys of child i, at most those of child i+1
    void* children[inner_capacity];          // leaves at the last inner level, inner nodes above
  };
  // The inner nodes from the root down to a leaf, and the child taken in each.
  struct path {
    inner* nodes[max_height];
    unsigned slots[max_height];
  };

  // How many of the first n sorted keys are <= key, found two ways. Inner nodes are read by a
  // branch-free binary search, whose loads the CPU overlaps. An insert or erase shifts the tail
  // of its leaf anyway: a scan from the front reads the rest in order, which the prefetcher
  // streams in. Each was faster than the other at its own job (1M keys: a fifth in leaves; in
  // inner nodes the search took 4% off a pool's allocate among a million blocks, whose inserts
  // all land at the end, where a scan reads every key).
  static unsigned search(const std::uint64_t* keys, unsigned n, std::uint64_t key) noexcept {
    if (n == 0) return 0;
    const std::uint64_t* first = keys;
    while (n > 1) {
      const unsigned half = n / 2;
      first = first[half] <= key ? first + half : first;  // a conditional move, not a branch
      n -= half;
    }
    return static_cast<unsigned>(first - keys) + (*first <= key ? 1u : 0u);
  }
  static unsigned scan(const std::uint64_t* keys, unsigned n, std::uint64_t key) noexcept {
    unsigned below = 0;
    while (below < n && keys[below] <= key) ++below;
    return below;
  }

  [[nodiscard]] const leaf* leaf_for(std::uint64_t key) const noexcept {
    const void* n = root_;
    for (unsigned level = 0; level < height_; ++level) {
      const inner* in = static_cast<const inner*>(n);
      n = in->children[search(in->keys, in->count - 1, key)];
    }
    return static_cast<const leaf*>(n);
  }
  leaf* descend(std::uint64_t key, path& p) const noexcept {
    void* n = root_;
    for (unsigned level = 0; level < height_; ++level) {
      inner* in = static_cast<inner*>(n);
      p.nodes[level] = in;
      p.slots[level] = search(in->keys, in->count - 1, key);
      n = in->children[p.slots[level]];
    }
    return static_cast<leaf*>(n);
  }

  void put(std::uint64_t key, V* value, bool overwrite);
  void split_and_insert(leaf* l, unsigned at, std::uint64_t key, V* value, const path& p);
  void rebalance_leaf(leaf* l, const path& p);
  void rebalance_inner(const path& p, unsigned level);

  static void insert_into(leaf* l, unsigned at, std::uint64_t key, V* value) noexcept {
    std::copy_backward(l->keys + at, l->keys + l->count, l->keys + l->count + 1);
    std::copy_backward(l->values + at, l->values + l->count, l->values + l->count + 1);
    l->keys[at] = key;
    l->values[at] = value;
    ++l->count;
  }
  // Moves `n` entries of `from`, starting at `first`, to the end of `to`, closing the gap.
  static void move_entries(leaf* from, unsigned first, unsigned n, leaf* to) noexcept {
    std::copy(from->keys + first, from->keys + first + n, to->keys + to->count);
    std::copy(from->values + first, from->values + first + n, to->values + to->count);
    std::copy(from->keys + first + n, from->keys + from->count, from->keys + first);
    std::copy(from->values + first + n, from->values + from->count, from->values + first);
    to->count += n;
    from->count -= n;
  }
  // Removes child `c` (c >= 1) and the separator before it.
  static void remove_child(inner* in, unsigned c) noexcept {
    std::copy(in->keys + c, in->keys + in->count - 1, in->keys + c - 1);
    std::copy(in->children + c + 1, in->children + in->count, in->children + c);
    --in->count;
  }
  static void unlink(leaf* l) noexcept {
    if (l->prev != nullptr) l->prev->next = l->next;
    if (l->next != nullptr) l->next->prev = l->prev;
  }

  // Nodes come from the spares first. reserve() fills the spares beforehand, so that a split
  // never meets an allocation failure halfway.
  void reserve(unsigned leaves, unsigned inners) {
    for (; spare_leaf_count_ < leaves; ++spare_leaf_count_) spare_leaves_ = new leaf{0, nullptr, spare_leaves_, {}, {}};
    for (; spare_inner_count_ < inners; ++spare_inner_count_) spare_inners_ = new inner{0, spare_inners_, {}, {}};
  }
  leaf* take_leaf() {
    reserve(1, 0);
    leaf* l = std::exchange(spare_leaves_, spare_leaves_->next);
    --spare_leaf_count_;
    l->count = 0;
    return l;
  }
  inner* take_inner() {
    reserve(0, 1);
    inner* in = std::exchange(spare_inners_, spare_inners_->next_spare);
    --spare_inner_count_;
    in->count = 0;
    return in;
  }
  void give_back(leaf* l) noexcept {
    if (spare_leaf_count_ >= max_spares) {
      delete l;
      return;
    }
    l->next = std::exchange(spare_leaves_, l);
    ++spare_leaf_count_;
  }
  void give_back(inner* in) noexcept {
    if (spare_inner_count_ >= max_spares) {
      delete in;
      return;
    }
    in->next_spare = std::exchange(spare_inners_, in);
    ++spare_inner_count_;
  }
  void free_subtree(void* n, unsigned level) noexcept {
    if (level == height_) {
      delete static_cast<leaf*>(n);
      return;
    }
    inner* in = static_cast<inner*>(n);
    for (unsigned c = 0; c < in->count; ++c) free_subtree(in->children[c], level + 1);
    delete in;
  }
  bool check_subtree(const void* n, unsigned level, const std::uint64_t* low, const std::uint64_t* high,
                     const leaf*& last_leaf, std::size_t& entries) const;

  void take_from(address_index& other) noexcept {
    root_ = std::exchange(other.root_, nullptr);
    finger_ = std::exchange(other.finger_, nullptr);
    finger_low_ = other.finger_low_;
    finger_high_ = other.finger_high_;
    height_ = std::exchange(other.height_, 0);
    size_ = std::exchange(other.size_, 0);
    spare_leaves_ = std::exchange(other.spare_leaves_, nullptr);
    spare_leaf_count_ = std::exchange(other.spare_leaf_count_, 0);
    spare_inners_ = std::exchange(other.spare_inners_, nullptr);
    spare_inner_count_ = std::exchange(other.spare_inner_count_, 0);
  }

  // The keys a leaf may hold are those its parents' separators bound it to: [low, high).
  void set_finger(leaf* l, const path& p) noexcept {
    finger_ = l;
    finger_low_ = 0;
    finger_high_ = ~std::uint64_t{0};
    bool have_low = false, have_high = false;
    for (unsigned level = height_; level-- > 0 && !(have_low && have_high);) {
      const inner* in = p.nodes[level];
      const unsigned slot = p.slots[level];
      if (!have_low && slot > 0) finger_low_ = in->keys[slot - 1], have_low = true;
      if (!have_high && slot + 1 < in->count) finger_high_ = in->keys[slot], have_high = true;
    }
  }

  void* root_ = nullptr;  // a leaf when height_ is 0; null when empty
  unsigned height_ = 0;   // inner levels above the leaves
  std::size_t size_ = 0;
  // The leaf of the last insert and the bounds its parents give it (see put); null after any
  // change of leaves or separators (a split, an erase's rebalancing, a clear, a move).
  leaf* finger_ = nullptr;
  std::uint64_t finger_low_ = 0, finger_high_ = 0;
  leaf* spare_leaves_ = nullptr;
  unsigned spare_leaf_count_ = 0;
  inner* spare_inners_ = nullptr;
  unsigned spare_inner_count_ = 0;
};

template <class V>
void address_index<V>::put(std::uint64_t key, V* value, [[maybe_unused]] bool overwrite) {
  if (root_ == nullptr) {
    leaf* l = take_leaf();
    l->count = 1;
    l->prev = l->next = nullptr;
    l->keys[0] = key;
    l->values[0] = value;
    root_ = l;
    size_ = 1;
    return;
  }
  // The leaf of the last insert, while its bounds hold the key and it has room: a pool's
  // allocations split the same free block again and again, each new block just above the
  // last, so most inserts land there and need no descent.
  if (finger_ != nullptr && finger_low_ <= key && key < finger_high_ && finger_->count < leaf_capacity) {
    leaf* l = finger_;
    const unsigned at = l->count > 0 && l->keys[l->count - 1] < key ? l->count : scan(l->keys, l->count, key);
    if (at > 0 && l->keys[at - 1] == key) {
      assert(overwrite && "address_index::insert: the key is present");
      l->values[at - 1] = value;
      return;
    }
    insert_into(l, at, key, value);
    ++size_;
    return;
  }
  path p;
  leaf* l = descend(key, p);
  // Above every key of the leaf (the append above, when the leaf was full or another): no scan.
  const unsigned at = l->count > 0 && l->keys[l->count - 1] < key ? l->count : scan(l->keys, l->count, key);
  if (at > 0 && l->keys[at - 1] == key) {
    assert(overwrite && "address_index::insert: the key is present");
    l->values[at - 1] = value;
    return;
  }
  if (l->count < leaf_capacity) {
    insert_into(l, at, key, value);
    set_finger(l, p);
  } else {
    split_and_insert(l, at, key, value, p);  // leaves and separators change: no finger
    finger_ = nullptr;
  }
  ++size_;
}

template <class V>
void address_index<V>::split_and_insert(leaf* l, unsigned at, std::uint64_t key, V* value, const path& p) {
  // The split climbs through the full inner nodes above the leaf, and adds a root if all are.
  unsigned full = 0;
  while (full < height_ && p.nodes[height_ - 1 - full]->count == inner_capacity) ++full;
  assert(full < height_ || height_ + 1 < max_height);
  reserve(1, full + (full == height_ ? 1 : 0));  // from here on, nothing allocates

  // Split the leaf in two halves, the new entry in the one where it belongs.
  constexpr unsigned stay = (leaf_capacity + 1) / 2;  // entries the left half ends with
  leaf* right = take_leaf();
  if (at < stay) {
    move_entries(l, stay - 1, leaf_capacity - (stay - 1), right);
    insert_into(l, at, key, value);
  } else {
    move_entries(l, stay, leaf_capacity - stay, right);
    insert_into(right, at - stay, key, value);
  }
  right->prev = l;
  right->next = l->next;
  if (l->next != nullptr) l->next->prev = right;
  l->next = right;

  // Hand (separator, new node) to the parents, splitting those that are full.
  std::uint64_t separator = right->keys[0];
  void* new_child = right;
  for (unsigned level = height_; level-- > 0;) {
    inner* in = p.nodes[level];
    const unsigned slot = p.slots[level];  // the new child goes right after this one
    if (in->count < inner_capacity) {
      std::copy_backward(in->keys + slot, in->keys + in->count - 1, in->keys + in->count);
      std::copy_backward(in->children + slot + 1, in->children + in->count, in->children + in->count + 1);
      in->keys[slot] = separator;
      in->children[slot + 1] = new_child;
      ++in->count;
      return;
    }
    // Lay all children out in order, then keep the first half here and move the rest.
    std::uint64_t keys[inner_capacity];
    void* children[inner_capacity + 1];
    std::copy(in->keys, in->keys + slot, keys);
    keys[slot] = separator;
    std::copy(in->keys + slot, in->keys + (inner_capacity - 1), keys + slot + 1);
    std::copy(in->children, in->children + slot + 1, children);
    children[slot + 1] = new_child;
    std::copy(in->children + slot + 1, in->children + inner_capacity, children + slot + 2);
    constexpr unsigned kept = (inner_capacity + 1) / 2;
    inner* sibling = take_inner();
    std::copy(keys, keys + kept - 1, in->keys);
    std::copy(children, children + kept, in->children);
    in->count = kept;
    std::copy(keys + kept, keys + inner_capacity, sibling->keys);
    std::copy(children + kept, children + inner_capacity + 1, sibling->children);
    sibling->count = inner_capacity + 1 - kept;
    separator = keys[kept - 1];
    new_child = sibling;
  }
  inner* root = take_inner();
  root->count = 2;
  root->keys[0] = separator;
  root->children[0] = root_;
  root->children[1] = new_child;
  root_ = root;
  ++height_;
}

template <class V>
void address_index<V>::erase(std::uint64_t key) {
  if (root_ == nullptr) {
    assert(false && "address_index::erase: the key is absent");
    return;
  }
  path p;
  leaf* l = descend(key, p);
  const unsigned at = scan(l->keys, l->count, key);
  if (at == 0 || l->keys[at - 1] != key) {
    assert(false && "address_index::erase: the key is absent");
    return;
  }
  std::copy(l->keys + at, l->keys + l->count, l->keys + at - 1);
  std::copy(l->values + at, l->values + l->count, l->values + at - 1);
  --l->count;
  --size_;
  if (height_ == 0) {
    if (l->count == 0) {
      give_back(l);
      root_ = nullptr;
      finger_ = nullptr;
    }
    return;
  }
  // Separators above may still name the erased key: they stay valid bounds.
  if (l->count < leaf_min) {
    rebalance_leaf(l, p);
    finger_ = nullptr;
  }
}

// l is below half full: even it out with a sibling that can spare entries, else merge the two.
template <class V>
void address_index<V>::rebalance_leaf(leaf* l, const path& p) {
  inner* parent = p.nodes[height_ - 1];
  const unsigned slot = p.slots[height_ - 1];
  leaf* left = slot > 0 ? static_cast<leaf*>(parent->children[slot - 1]) : nullptr;
  leaf* right = slot + 1 < parent->count ? static_cast<leaf*>(parent->children[slot + 1]) : nullptr;
  // Moving half the difference, not one entry, spares the next few erases a rebalance.
  if (left != nullptr && left->count > leaf_min) {
    const unsigned n = (left->count - l->count) / 2;
    std::copy_backward(l->keys, l->keys + l->count, l->keys + l->count + n);
    std::copy_backward(l->values, l->values + l->count, l->values + l->count + n);
    std::copy(left->keys + left->count - n, left->keys + left->count, l->keys);
    std::copy(left->values + left->count - n, left->values + left->count, l->values);
    left->count -= n;
    l->count += n;
    parent->keys[slot - 1] = l->keys[0];
    return;
  }
  if (right != nullptr && right->count > leaf_min) {
    move_entries(right, 0, (right->count - l->count) / 2, l);
    parent->keys[slot] = right->keys[0];
    return;
  }
  if (left != nullptr) {
    move_entries(l, 0, l->count, left);
    unlink(l);
    give_back(l);
    remove_child(parent, slot);
  } else {
    move_entries(right, 0, right->count, l);
    unlink(right);
    give_back(right);
    remove_child(parent, slot + 1);
  }
  rebalance_inner(p, height_ - 1);
}

// p.nodes[level] has lost a child: rotate one in from a sibling or merge, up to the root, and
// drop the root when it is left with one child.
template <class V>
void address_index<V>::rebalance_inner(const path& p, unsigned level) {
  for (;; --level) {
    inner* in = p.nodes[level];
    if (level == 0) {
      if (in->count == 1) {
        root_ = in->children[0];
        --height_;
        give_back(in);
      }
      return;
    }
    if (in->count >= inner_min) return;
    inner* parent = p.nodes[level - 1];
    const unsigned slot = p.slots[level - 1];
    inner* left = slot > 0 ? static_cast<inner*>(parent->children[slot - 1]) : nullptr;
    inner* right = slot + 1 < parent->count ? static_cast<inner*>(parent->children[slot + 1]) : nullptr;
    if (left != nullptr && left->count > inner_min) {
      // The parent's separator comes down in front; left's last key goes up in its place.
      std::copy_backward(in->keys, in->keys + in->count - 1, in->keys + in->count);
      std::copy_backward(in->children, in->children + in->count, in->children + in->count + 1);
      in->keys[0] = parent->keys[slot - 1];
      in->children[0] = left->children[left->count - 1];
      parent->keys[slot - 1] = left->keys[left->count - 2];
      --left->count;
      ++in->count;
      return;
    }
    if (right != nullptr && right->count > inner_min) {
      in->keys[in->count - 1] = parent->keys[slot];
      in->children[in->count] = right->children[0];
      parent->keys[slot] = right->keys[0];
      std::copy(right->keys + 1, right->keys + right->count - 1, right->keys);
      std::copy(right->children + 1, right->children + right->count, right->children);
      --right->count;
      ++in->count;
      return;
    }
    // Merge into the left one of the pair, the parent's separator between their keys.
    inner* into = left != nullptr ? left : in;
    inner* from = left != nullptr ? in : right;
    const unsigned from_slot = left != nullptr ? slot : slot + 1;
    into->keys[into->count - 1] = parent->keys[from_slot - 1];
    std::copy(from->keys, from->keys + from->count - 1, into->keys + into->count);
    std::copy(from->children, from->children + from->count, into->children + into->count);
    into->count += from->count;
    give_back(from);
    remove_child(parent, from_slot);
  }
}

template <class V>
void address_index<V>::clear() noexcept {
  if (root_ != nullptr) free_subtree(root_, 0);
  root_ = nullptr;
  finger_ = nullptr;
  height_ = 0;
  size_ = 0;
  while (spare_leaves_ != nullptr) delete std::exchange(spare_leaves_, spare_leaves_->next);
  while (spare_inners_ != nullptr) delete std::exchange(spare_inners_, spare_inners_->next_spare);
  spare_leaf_count_ = spare_inner_count_ = 0;
}

template <class V>
bool address_index<V>::check_invariants() const {
  if (root_ == nullptr) return height_ == 0 && size_ == 0;
  const leaf* last_leaf = nullptr;
  std::size_t entries = 0;
  if (!check_subtree(root_, 0, nullptr, nullptr, last_leaf, entries)) return false;
  return last_leaf->next == nullptr && entries == size_;
}

// Keys of the subtree at `n` must lie in [*low, *high) (null: unbounded); leaves must come in
// chain order after `last_leaf`.
template <class V>
bool address_index<V>::check_subtree(const void* n, unsigned level, const std::uint64_t* low,
                                     const std::uint64_t* high, const leaf*& last_leaf,
                                     std::size_t& entries) const {
  const bool is_root = level == 0;
  const std::uint64_t* keys;
  unsigned key_count;
  if (level == height_) {
    const leaf* l = static_cast<const leaf*>(n);
    if (l->count > leaf_capacity || l->count < (is_root ? 1 : leaf_min)) return false;
    if (l->prev != last_leaf || (last_leaf != nullptr && last_leaf->next != l)) return false;
    last_leaf = l;
    entries += l->count;
    keys = l->keys;
    key_count = l->count;
  } else {
    const inner* in = static_cast<const inner*>(n);
    if (in->count > inner_capacity || in->count < (is_root ? 2 : inner_min)) return false;
    for (unsigned c = 0; c < in->count; ++c) {
      const std::uint64_t* child_low = c > 0 ? &in->keys[c - 1] : low;
      const std::uint64_t* child_high = c + 1 < in->count ? &in->keys[c] : high;
      if (!check_subtree(in->children[c], level + 1, child_low, child_high, last_leaf, entries)) return false;
    }
    keys = in->keys;
    key_count = in->count - 1;
  }
  for (unsigned i = 0; i < key_count; ++i) {
    if (i > 0 && keys[i - 1] >= keys[i]) return false;
    if ((low != nullptr && keys[i] < *low) || (high != nullptr && keys[i] >= *high)) return false;
  }
  return true;
}

}  // namespace streamalloc::detail
