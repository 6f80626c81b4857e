#pragma once

// The thread that takes graph memory back when nothing may use it any more.
//
// Two things end a hold on graph memory, and neither may do the work itself. A CUDA user
// object's destructor runs on a driver thread and may make no CUDA call, nor wait for anything
// that might (graph_ties.hpp). A `graph_exec` destroyed while its last launch still runs must
// not let the memory go before that launch has finished, and should not make its owner wait
// for it. Both hand a job to the reaper, a thread of streamalloc's own, which does the work.

#include <streamalloc/detail/config.hpp>

#include <atomic>
#include <cstddef>
#include <mutex>
#include <thread>

namespace streamalloc::detail {

/// Work handed to the reaper. `run` is called once, on the reaper's thread, never concurrently
/// with another job's, and disposes of the job (deletes it, or leaves it to whoever still holds
/// it).
struct reaper_job {
  virtual ~reaper_job() = default;
  virtual void run() noexcept = 0;
  reaper_job* next = nullptr;  ///< in the reaper's list
};

/// One per process, started with the first job, never stopped: the driver may run destructors
/// until the process ends, so neither the reaper nor its thread may be destroyed before (the
/// object is deliberately never freed).
class graph_reaper {
 public:
  static graph_reaper& instance() {
    static graph_reaper* r = new graph_reaper;
    return *r;
  }

  /// Starts the thread, once; call before the first job may be handed over.
  void start() {
    std::call_once(started_, [this] { std::thread([this] { run(); }).detach(); });
  }

  /// Hands `job` over. Lock-free and never blocks: callable from a user object's destructor.
  void push(reaper_job* job) noexcept {
    reaper_job* head = head_.load(std::memory_order_relaxed);
    do {
      job->next = head;
    } while (!head_.compare_exchange_weak(head, job, std::memory_order_release, std::memory_order_relaxed));
    head_.notify_one();
  }

  /// Holds on graph memory not yet let go (graph_ties.hpp counts them): for tests and statistics.
  [[nodiscard]] std::size_t outstanding() const noexcept { return outstanding_.load(std::memory_order_acquire); }
  void note_held() noexcept { outstanding_.fetch_add(1, std::memory_order_relaxed); }
  void note_released() noexcept { outstanding_.fetch_sub(1, std::memory_order_release); }

 private:
  graph_reaper() = default;

  [[noreturn]] void run() noexcept {
    for (;;) {
      head_.wait(nullptr, std::memory_order_acquire);
      reaper_job* job = head_.exchange(nullptr, std::memory_order_acquire);
      while (job != nullptr) {
        reaper_job* next = job->next;
        job->run();  // may push more jobs (a release that ends a user object): the next round's
        job = next;
      }
    }
  }

  std::once_flag started_;
  std::atomic<reaper_job*> head_{nullptr};
  std::atomic<std::size_t> outstanding_{0};
};

}  // namespace streamalloc::detail
