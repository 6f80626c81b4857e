#pragma once

/// @file
/// @brief Graph memory added by hand: `add_allocation` and `add_free` on a `captured_graph`
/// (made with `make_graph`, or by capture), `graph_allocation` (for those and for a capture's
/// own allocations: `allocation_of`, `unfreed_allocations`), and the device's graph memory
/// statistics and trim.
///
/// The driver's graph memory nodes (`cudaGraphAddMemAllocNode`) allocate at each launch and may
/// not appear in a device-launched graph. streamalloc's graph allocations are memory of a pool
/// at a fixed address, mapped ahead and held while the graph (or an executable, clone or
/// `graph_allocation` made from it) lives: the "allocation node" is an empty node marking where
/// in the graph the allocation begins, and the "free node" one marking where it ends. Work that
/// uses the memory goes between them (dependencies the caller adds, as with the driver's nodes).
///
/// @code
/// streamalloc::captured_graph g = streamalloc::make_graph();
/// streamalloc::graph_allocation tmp = streamalloc::add_allocation(g, pool, bytes);
/// cudaGraphNode_t k = ...;  // a kernel node using tmp.get(), depending on tmp.node()
/// cudaGraphNode_t f = streamalloc::add_free(g, tmp, {&k, 1});
/// // an allocation depending on f (directly or through other nodes) may reuse tmp's memory
/// streamalloc::graph_exec exec(g);
/// @endcode

#include <streamalloc/access.hpp>
#include <streamalloc/captured_graph.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/detail/pool/graph_ties.hpp>
#include <streamalloc/error.hpp>
#include <streamalloc/pool.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace streamalloc {

static_assert(std::is_same_v<cudaGraphNode_t, CUgraphNode>, "cudaGraphNode_t is expected to be CUgraphNode");

/**
 * @brief An allocation in a graph: its address (fixed for the graph's life), size, node and
 * graph. Made by `add_allocation`, or for an allocation a capture made by `allocation_of` and
 * `unfreed_allocations`. Holds the graph's memory of that pool while it lives, like the graph
 * itself: the address stays valid for work ordered after a launch even once the graph is
 * destroyed, until this object goes too. While one lives, the graph keeps memory of its own
 * (it is not mapped onto pages other graphs share: graph_exec.hpp). Move-only; holds nothing
 * once moved from.
 */
class graph_allocation {
 public:
  graph_allocation() noexcept = default;
  /// Takes over `o`'s hold; `o` is left empty.
  graph_allocation(graph_allocation&& o) noexcept { swap(o); }
  /// Lets go of this hold (as `reset`), then takes over `o`'s.
  graph_allocation& operator=(graph_allocation&& o) noexcept {
    if (this != &o) {
      reset();
      swap(o);
    }
    return *this;
  }
  graph_allocation(const graph_allocation&) = delete;
  graph_allocation& operator=(const graph_allocation&) = delete;
  ~graph_allocation() { reset(); }

  /// Lets go of the hold (the graph keeps its own). Empty afterwards.
  void reset() noexcept {
    if (hold_ != nullptr) hold_->let_go();
    hold_ = nullptr;
    ptr_ = nullptr;
    bytes_ = 0;
    node_ = nullptr;
    graph_ = nullptr;
  }

  /// The memory's address: the same at every launch.
  [[nodiscard]] void* get() const noexcept { return ptr_; }
  /// The bytes requested from `add_allocation`; for an allocation a capture made, the bytes
  /// usable at `get()` (those requested, rounded up to the pool's 256-byte quantum).
  [[nodiscard]] std::size_t size() const noexcept { return bytes_; }
  /// The allocation node: work using the memory depends on it. Null for an allocation a
  /// capture made (the captured work that uses it comes after it in the capture's order).
  [[nodiscard]] CUgraphNode node() const noexcept { return node_; }
  /// The graph it was added to.
  [[nodiscard]] CUgraph graph() const noexcept { return graph_; }
  /// True while it holds an allocation.
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

  /// Exchanges the allocations held by the two.
  void swap(graph_allocation& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    std::swap(node_, o.node_);
    std::swap(graph_, o.graph_);
    std::swap(hold_, o.hold_);
  }

 private:
  friend struct detail::graph_building;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  CUgraphNode node_ = nullptr;
  CUgraph graph_ = nullptr;
  detail::graph_tie* hold_ = nullptr;
};

namespace detail {

struct graph_building {
  static void require_graph(const captured_graph& g, const char* who) {
    if (!g) throw std::invalid_argument(std::string("streamalloc::") + who + ": the captured_graph is empty");
  }
  static capture_info identity(const captured_graph& g) noexcept { return {g.id_, g.graph_}; }

  /// Takes the ties pools made for `g` since the last call (one per pool new to the graph).
  static void take_new_ties(captured_graph& g) {
    std::vector<graph_tie*> fresh = graph_tie_registry::instance().take(g.id_);
    g.ties_.reserve(g.ties_.size() + fresh.size());
    for (graph_tie* t : fresh) g.ties_.push_back(t);  // reserved: cannot throw
  }

  /// The tie holding `owner`'s memory for `g`, held once more for a graph_allocation.
  static graph_tie* hold_for(const captured_graph& g, const pool_state& owner) noexcept {
    for (graph_tie* t : g.ties_) {
      if (t->pool_core_address() == owner.core_address()) {
        t->hold();
        return t;
      }
    }
    return nullptr;
  }

  /// Every node `deps` depend on, themselves included (the driver asked, node by node).
  static std::unordered_set<CUgraphNode> ancestors(std::span<const CUgraphNode> deps) {
    std::unordered_set<CUgraphNode> seen(deps.begin(), deps.end());
    std::vector<CUgraphNode> todo(deps.begin(), deps.end());
    std::vector<CUgraphNode> up;
    while (!todo.empty()) {
      const CUgraphNode n = todo.back();
      todo.pop_back();
      std::size_t count = 0;
      cu::cuGraphNodeGetDependencies(n, static_cast<CUgraphNode*>(nullptr), static_cast<CUgraphEdgeData*>(nullptr),
                                     &count);
      up.resize(count);
      if (count != 0) cu::cuGraphNodeGetDependencies(n, up.data(), static_cast<CUgraphEdgeData*>(nullptr), &count);
      for (std::size_t i = 0; i < count; ++i) {
        if (seen.insert(up[i]).second) todo.push_back(up[i]);
      }
    }
    return seen;
  }

  /// An owner of the allocation (`addr`, `bytes`) of `g` that tie `t` holds: one hold more.
  static graph_allocation owner(const captured_graph& g, graph_tie* t, std::uint64_t addr, std::uint64_t bytes,
                                CUgraphNode node) noexcept {
    t->hold();
    graph_allocation a;
    a.ptr_ = reinterpret_cast<void*>(addr);
    a.bytes_ = bytes;
    a.node_ = node;
    a.graph_ = g.graph_;
    a.hold_ = t;
    return a;
  }

  static graph_allocation allocation_of(const captured_graph& g, const void* p) {
    require_graph(g, "allocation_of");
    const auto addr = reinterpret_cast<std::uint64_t>(p);
    for (graph_tie* t : g.ties_) {
      if (const std::uint64_t bytes = t->allocation_size(addr); bytes != 0) return owner(g, t, addr, bytes, nullptr);
    }
    throw std::invalid_argument("streamalloc::allocation_of: " + hex(addr) +
                                " is not the start of an allocation this graph made (by its capture or "
                                "add_allocation); memory allocated outside the graph, even if the graph frees it, "
                                "is an ordinary allocation of its pool");
  }

  static std::vector<graph_allocation> unfreed_allocations(const captured_graph& g) {
    require_graph(g, "unfreed_allocations");
    std::vector<std::pair<graph_tie*, std::pair<std::uint64_t, std::uint64_t>>> found;
    for (graph_tie* t : g.ties_) {
      for (const auto& range : t->unfreed()) found.emplace_back(t, range);
    }
    std::sort(found.begin(), found.end(), [](const auto& x, const auto& y) { return x.second < y.second; });
    std::vector<graph_allocation> out;
    out.reserve(found.size());  // owner() cannot throw after this
    for (const auto& [t, range] : found) out.push_back(owner(g, t, range.first, range.second, nullptr));
    return out;
  }

  static graph_allocation add_allocation(captured_graph& g, pool_ref p, std::size_t bytes,
                                         std::span<const CUgraphNode> deps, std::span<const access_descriptor> access) {
    require_graph(g, "add_allocation");
    pool_state* st = state_of(p);
    if (st == nullptr) {
      throw pool_closed("streamalloc::add_allocation: the pool was moved from (its memory belongs to the pool it "
                        "was moved into)");
    }
    if (bytes == 0) throw std::invalid_argument("streamalloc::add_allocation: 0 bytes (a graph allocation has a size)");
    const std::uint64_t peers = st->graph_peers(access, "add_allocation");
    // Blocks freed by a free node this allocation comes after may be reused: they are free of
    // every use the free node was made to depend on.
    std::unordered_set<CUgraphNode> before;
    if (g.frees_ != 0) before = ancestors(deps);
    const auto after = [&](std::uint64_t free_node) {
      return before.contains(reinterpret_cast<CUgraphNode>(free_node));
    };
    CUgraphNode node = nullptr;
    check(cu::cuGraphAddEmptyNode_nothrow(&node, g.graph_, deps.data(), deps.size()), "cuGraphAddEmptyNode",
          [] { return std::string("adding a streamalloc allocation node"); });
    void* ptr = st->allocate_in_graph(bytes, identity(g), peers, after);
    take_new_ties(g);  // cannot fail after the memory is the graph's: the vector reserved room
    graph_allocation a;
    a.ptr_ = ptr;
    a.bytes_ = bytes;
    a.node_ = node;
    a.graph_ = g.graph_;
    a.hold_ = hold_for(g, *st);
    return a;
  }

  static CUgraphNode add_free(captured_graph& g, void* p, std::span<const CUgraphNode> deps) {
    require_graph(g, "add_free");
    if (p == nullptr) throw std::invalid_argument("streamalloc::add_free: a null pointer");
    pool_state* st = pools().find(reinterpret_cast<std::uint64_t>(p));
    if (st == nullptr) {
      throw std::invalid_argument("streamalloc::add_free: " + hex(reinterpret_cast<std::uint64_t>(p)) +
                                  " is not memory of a live streamalloc pool");
    }
    CUgraphNode node = nullptr;
    check(cu::cuGraphAddEmptyNode_nothrow(&node, g.graph_, deps.data(), deps.size()), "cuGraphAddEmptyNode",
          [] { return std::string("adding a streamalloc free node"); });
    // The empty node stays in the graph if the free is refused: harmless, it does nothing.
    st->free_in_graph(p, identity(g), node);
    take_new_ties(g);
    ++g.frees_;
    return node;
  }
};

}  // namespace detail

/**
 * @brief Adds to graph `g` an allocation of `bytes` from pool `p`, ordered after
 * `dependencies`: an empty node, and memory of the pool held for the graph's life.
 *
 * Memory a free node of `g` freed is reused when this allocation depends on that free node
 * (directly or through other nodes); otherwise it is memory no work uses. Work using it must
 * depend on `node()`; a free added with `add_free` must depend on that work. An allocation
 * never freed in the graph stays valid after each launch, as a captured one does
 * (docs/graphs.md: relaunch rules through `graph_exec`).
 *
 * `access` names the peer devices whose work uses the memory, read-write, as the access
 * descriptors of the driver's allocation node: they have it for the graph's life whatever
 * the pool's own access (`pool::set_access`) is meanwhile. The pool's device needs no
 * descriptor (it is accepted). The grant covers the graph's own memory, not only this
 * allocation: other allocations of the graph may be reachable from those devices too, which
 * nothing may rely on (the driver's graph memory is mapped so at times as well).
 * @throws std::invalid_argument for an empty graph, 0 bytes, or a descriptor that is not
 *   a device with read_write, or a device that does not exist
 * @throws not_supported for a device that cannot access the pool's memory (not its peer)
 * @throws out_of_memory as `pool::allocate`
 * @throws cuda_error when the driver refuses a node (a dependency of another graph, ...)
 */
[[nodiscard]] inline graph_allocation add_allocation(captured_graph& g, pool_ref p, std::size_t bytes,
                                                     std::span<const CUgraphNode> dependencies = {},
                                                     std::span<const access_descriptor> access = {}) {
  return detail::graph_building::add_allocation(g, p, bytes, dependencies, access);
}

/**
 * @brief Adds to graph `g` a free of `a`, ordered after `dependencies` (the work using it);
 * returns the free node. Allocations added later that depend on it may reuse the memory.
 * @throws std::invalid_argument when `a` was freed in the graph already, belongs to another
 *   graph, or `g` is empty
 */
inline CUgraphNode add_free(captured_graph& g, const graph_allocation& a,
                            std::span<const CUgraphNode> dependencies = {}) {
  return detail::graph_building::add_free(g, a.get(), dependencies);
}

/**
 * @brief Adds to graph `g` a free of `p`: memory allocated outside any graph (a launch frees
 * it, as a captured free of it does), or one of `g`'s own allocations by address.
 * @throws std::invalid_argument for a pointer no pool knows, not a live allocation, or memory
 *   of another graph
 */
inline CUgraphNode add_free(captured_graph& g, void* p, std::span<const CUgraphNode> dependencies = {}) {
  return detail::graph_building::add_free(g, p, dependencies);
}

/**
 * @brief The allocation starting at `p` that graph `g` made, by its capture or with
 * `add_allocation`, as a `graph_allocation` that holds the graph's memory while it lives.
 *
 * For a captured allocation this is what `add_allocation` returns for one added by hand: it
 * keeps the address valid for work after the last launch once the graph and its executables
 * are gone, and says its size and graph. Any allocation of the graph may be asked for, freed
 * in the graph or not.
 * @throws std::invalid_argument when `g` is empty, or `p` is not the start of an allocation `g`
 *   made (memory allocated outside the graph and freed in it included: that is the pool's)
 */
[[nodiscard]] inline graph_allocation allocation_of(const captured_graph& g, const void* p) {
  return detail::graph_building::allocation_of(g, p);
}

/**
 * @brief The allocations graph `g` leaves live after each launch (made in it, by capture or
 * `add_allocation`, and never freed in it: its outputs), by address, each as a
 * `graph_allocation`. Those freed since the last launch are included: the next launch makes
 * them again.
 * @throws std::invalid_argument when `g` is empty
 */
[[nodiscard]] inline std::vector<graph_allocation> unfreed_allocations(const captured_graph& g) {
  return detail::graph_building::unfreed_allocations(g);
}

/**
 * @brief The graph memory of a device's pools, in the terms of `cudaDeviceGetGraphMemAttribute`.
 *
 * streamalloc keeps no cache of graph memory apart from the pools: memory a gone graph held
 * goes back to its pool's free memory, where any allocation may use it. So what graphs use is
 * what is reserved for them (`used_*` equal `reserved_*`); the highs are the sums of each
 * pool's high, an upper bound of the device's.
 */
struct graph_memory_statistics {
  std::size_t used_current = 0;      ///< bytes live graphs hold (cudaGraphMemAttrUsedMemCurrent)
  std::size_t used_high = 0;         ///< (cudaGraphMemAttrUsedMemHigh)
  std::size_t reserved_current = 0;  ///< (cudaGraphMemAttrReservedMemCurrent)
  std::size_t reserved_high = 0;     ///< (cudaGraphMemAttrReservedMemHigh)
  std::size_t graphs = 0;            ///< graphs (and holders made from them) holding memory
  std::size_t allocations = 0;       ///< blocks they hold
};

/// The graph memory of every pool on `device`, closed pools that graphs keep included.
[[nodiscard]] inline graph_memory_statistics graph_memory(int device) {
  graph_memory_statistics out;
  for (const auto& core : detail::cores_by_device().of(device)) {
    const pool_statistics s = core->statistics();
    out.used_current += s.graph_reserved_current;
    out.used_high += s.graph_reserved_high;
    out.reserved_current += s.graph_reserved_current;
    out.reserved_high += s.graph_reserved_high;
    out.graphs += s.graphs;
    out.allocations += s.graph_allocations;
  }
  return out;
}

/// Resets the highs of `graph_memory(device)` to the current values (cudaGraphMemAttr*High).
inline void reset_graph_memory_high(int device) {
  for (const auto& core : detail::cores_by_device().of(device)) core->reset_graph_high();
}

/**
 * @brief Like `cudaDeviceGraphMemTrim`: gives the device back the free physical memory of
 * every pool on `device` whose frees are known complete, the memory of graphs that are gone
 * included. What live graphs hold stays.
 */
inline void trim_graph_memory(int device) {
  for (const auto& core : detail::cores_by_device().of(device)) core->trim_to(0);
}

}  // namespace streamalloc
