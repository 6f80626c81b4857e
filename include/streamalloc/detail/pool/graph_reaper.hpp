#pragma once

// Taking a graph's memory back when the graph is gone.
//
// A pool ties the memory a capture's graph holds to a CUDA user object retained by the graph
// (cuUserObjectCreate + cuGraphRetainUserObject): the graph, each executable instantiated from
// it and each clone hold a reference, and the driver runs the object's destructor once the last
// one is released and the device has finished the launches. That destructor runs on a driver
// thread and may make no CUDA call, nor wait for anything that might: it only hands the tie to
// the reaper, a thread of streamalloc's own, which takes the memory back (and may unmap it,
// when the pool was closed meanwhile and this graph was the last thing holding it).

#include <streamalloc/detail/config.hpp>

#include <cuda.h>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <thread>

namespace streamalloc::detail {

/// A graph's hold on a pool's memory: the payload of the user object.
struct graph_tie {
  virtual ~graph_tie() = default;
  /// Takes the graph's memory back. Runs on the reaper's thread, never concurrently with
  /// another tie's release.
  virtual void release() noexcept = 0;

  /// Set when the user object could not be given to the graph: its release then does nothing.
  bool cancelled = false;
  graph_tie* next = nullptr;  ///< in the reaper's list
};

/// The thread that releases ties. One per process, started with the first tie, never stopped:
/// the driver may run destructors until the process ends, so neither the reaper nor its
/// thread may be destroyed before (the object is deliberately never freed).
class graph_reaper {
 public:
  static graph_reaper& instance() {
    static graph_reaper* r = new graph_reaper;
    return *r;
  }

  /// The user object's destructor (CUhostFn). On a driver thread: no CUDA call, no blocking.
  static void CUDA_CB on_graph_gone(void* tie) noexcept { instance().push(static_cast<graph_tie*>(tie)); }

  /// Starts the thread, once; call before the first tie is handed to the driver.
  void start() {
    std::call_once(started_, [this] { std::thread([this] { run(); }).detach(); });
  }

  /// Ties handed over and not yet released (for tests and statistics).
  [[nodiscard]] std::size_t outstanding() const noexcept { return outstanding_.load(std::memory_order_acquire); }
  void note_handed_over() noexcept { outstanding_.fetch_add(1, std::memory_order_relaxed); }

 private:
  graph_reaper() = default;

  void push(graph_tie* t) noexcept {
    graph_tie* head = head_.load(std::memory_order_relaxed);
    do {
      t->next = head;
    } while (!head_.compare_exchange_weak(head, t, std::memory_order_release, std::memory_order_relaxed));
    head_.notify_one();
  }

  [[noreturn]] void run() noexcept {
    for (;;) {
      head_.wait(nullptr, std::memory_order_acquire);
      graph_tie* t = head_.exchange(nullptr, std::memory_order_acquire);
      while (t != nullptr) {
        graph_tie* next = t->next;
        if (!t->cancelled) t->release();
        delete t;
        outstanding_.fetch_sub(1, std::memory_order_release);
        t = next;
      }
    }
  }

  std::once_flag started_;
  std::atomic<graph_tie*> head_{nullptr};
  std::atomic<std::size_t> outstanding_{0};
};

}  // namespace streamalloc::detail
