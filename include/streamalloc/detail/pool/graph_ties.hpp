#pragma once

// What holds the memory a capture's graph has of a pool, and how the hold ends.
//
// A pool ties that memory to a CUDA user object retained by the graph being captured
// (cuUserObjectCreate + cuGraphRetainUserObject): the graph, each clone and each executable the
// driver instantiates from it hold a reference, and the driver runs the object's destructor
// once the last one is released and the device has finished their launches.
//
// An executable holding a user object launches much slower on the host (measured on an H100:
// a graph of 256 kernels 70 us a launch against 3 us, as if submitted node by node). So a
// `graph_exec` made from a `captured_graph` instantiates a clone of the graph with streamalloc's
// user objects released from it and holds the ties itself: a `graph_tie` has several holders,
// the user object and each `captured_graph` and `graph_exec`, and the memory goes back when the
// last lets go. `end_capture` finds the ties of the capture it ends in the registry here, by
// capture id. Not by graph handle: the driver reuses a destroyed graph's handle, and releasing
// a user object from a graph that does not hold it is not refused (found on the GPU: it
// corrupts the count and crashes later), so a graph must never be mistaken for another.

#include <streamalloc/detail/config.hpp>
#include <streamalloc/detail/pool/graph_reaper.hpp>

#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace streamalloc::detail {

/// A hold on the memory one capture's graph has of one pool. Starts with one holder, the user
/// object; more are taken with `hold()`, each given back with `let_go()`.
struct graph_tie : reaper_job {
  explicit graph_tie(std::uint64_t capture_id) noexcept : capture(capture_id) {}

  /// Takes the graph's memory back. Runs once, on the reaper's thread.
  virtual void release() noexcept = 0;
  /// Why an executable instantiated from the graph may not be launched now (empty when it may),
  /// as pool_core::graph_launch_refusal.
  virtual std::string launch_refusal(bool auto_free) = 0;
  /// It is being launched (pool_core::graph_launched).
  virtual void launched() noexcept = 0;
  /// It is about to be launched or uploaded into the stream whose id plus one is `stream` by
  /// the one graph_exec that holds it alone (`launched_only_by_one_exec`): its memory may move
  /// onto pages shared by the graphs of that stream (pool_core::bind_graph_memory). 0: the
  /// stream's id could not be learned, and nothing moves. `last`: the event recorded after that
  /// executable's last launch. False when the graph's memory is lost
  /// (pool_core::bind_graph_memory): the graph must not run.
  virtual bool bind(std::uint64_t stream, CUevent last) noexcept = 0;
  /// The size of the allocation starting at `p` that the graph made of this pool; 0 if none
  /// (pool_core::graph_block_size).
  [[nodiscard]] virtual std::uint64_t allocation_size(std::uint64_t p) = 0;
  /// The graph's allocations of this pool left live after each launch, (address, size) by
  /// address (pool_core::graph_unfreed).
  [[nodiscard]] virtual std::vector<std::pair<std::uint64_t, std::uint64_t>> unfreed() = 0;
  /// The pool core whose memory it holds (to tell ties apart).
  [[nodiscard]] virtual const void* pool_core_address() const noexcept = 0;

  void hold() noexcept { holders.fetch_add(1, std::memory_order_relaxed); }
  /// A hold by a graph_exec, which launches only through `graph_exec::launch`.
  void hold_for_launches() noexcept {
    launchers.fetch_add(1, std::memory_order_relaxed);
    hold();
  }
  void let_go_of_launches() noexcept {
    launchers.fetch_sub(1, std::memory_order_acq_rel);
    let_go();
  }
  /// Is one graph_exec all that holds the memory? Then no graph, clone or raw executable that
  /// could launch it behind streamalloc's back is left, and none can be made again (the graph
  /// is gone). Holders only decrease once that is true.
  [[nodiscard]] bool launched_only_by_one_exec() const noexcept {
    return launchers.load(std::memory_order_acquire) == 1 && holders.load(std::memory_order_acquire) == 1;
  }
  /// Gives back one hold; the last releases the memory (unless cancelled) and deletes the tie.
  void let_go() noexcept {
    if (holders.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    if (!cancelled) release();
    // Counted as released only once deleted: deleting may drop the last reference to a closed
    // pool's core, which unmaps its memory, and whoever waits for `outstanding() == 0` (tests,
    // statistics) must see that done.
    delete this;
    graph_reaper::instance().note_released();
  }

  /// The user object's end, as a reaper job: nothing the driver made from the graph is left.
  void run() noexcept override;

  std::uint64_t capture;          ///< the capture's id, unique in the process
  CUuserObject object = nullptr;  ///< the user object holding it, once the graph retained it
  /// Set when the user object could not be given to the graph: the last let_go releases nothing.
  bool cancelled = false;
  std::atomic<int> holders{1};
  std::atomic<int> launchers{0};  ///< holders that are graph_execs
};

/// The ties of each capture whose user objects live and that no `end_capture` took yet, by
/// capture id.
class graph_tie_registry {
 public:
  static graph_tie_registry& instance() {
    static graph_tie_registry* r = new graph_tie_registry;  // ties outlive static destruction
    return *r;
  }

  void add(graph_tie* t) {
    std::lock_guard lock(mutex_);
    by_capture_[t->capture].push_back(t);
  }
  void forget(graph_tie* t) noexcept {
    std::lock_guard lock(mutex_);
    const auto it = by_capture_.find(t->capture);
    if (it == by_capture_.end()) return;
    std::erase(it->second, t);
    if (it->second.empty()) by_capture_.erase(it);
  }
  /// Removes the ties of `capture` and returns them, each with a hold taken for the caller.
  /// Called when the capture has ended and its graph holds every one of them: their user
  /// objects live.
  std::vector<graph_tie*> take(std::uint64_t capture) {
    std::lock_guard lock(mutex_);
    const auto it = by_capture_.find(capture);
    if (it == by_capture_.end()) return {};
    std::vector<graph_tie*> ties = std::move(it->second);
    by_capture_.erase(it);
    for (graph_tie* t : ties) t->hold();
    return ties;
  }

 private:
  graph_tie_registry() = default;
  std::mutex mutex_;
  std::unordered_map<std::uint64_t, std::vector<graph_tie*>> by_capture_;
};

inline void graph_tie::run() noexcept {
  graph_tie_registry::instance().forget(this);
  let_go();
}

/// The user object's destructor (CUhostFn), on a driver thread or inline in the call that
/// released the last reference: no CUDA call, no lock, no waiting.
inline void CUDA_CB on_graph_gone(void* tie) noexcept { graph_reaper::instance().push(static_cast<graph_tie*>(tie)); }

}  // namespace streamalloc::detail
