#pragma once

// The thread that takes graph memory back when nothing may use it any more.
//
// Two things end a hold on graph memory, and neither may do the work itself. A CUDA user
// object's destructor runs on a driver thread and may make no CUDA call, nor wait for anything
// that might (graph_ties.hpp). A `graph_exec` destroyed while its last launch still runs must
// not let the memory go before that launch has finished, and should not make its owner wait
// for it. Both hand a job to the reaper, a thread of streamalloc's own, which does the work.
//
// At exit the reaper is given a short while to finish (drain): a program that drops its
// last graph just before returning from main would otherwise exit while the reaper still
// unmaps that graph's memory, racing the process's static destructors, and tools such as
// compute-sanitizer would count the memory as leaked.

#include <streamalloc/detail/config.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdlib>
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

/// How long graph_reaper::drain waits: for the jobs handed over, at most `jobs`; for holds the
/// driver may still end, until none has ended for `quiet`.
struct reaper_drain_limits {
  std::chrono::milliseconds jobs{2000};
  std::chrono::milliseconds quiet{50};
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

  /// Starts the thread, once; call before the first job may be handed over. Also has `drain()`
  /// run at exit: registered after the CUDA runtime's own exit handler (CUDA is in use by the
  /// time a graph holds pool memory), it runs before that handler tears the runtime down.
  void start() {
    std::call_once(started_, [this] {
      std::thread([this] { run(); }).detach();
      std::atexit([] { (void)instance().drain(); });
    });
  }

  /// Hands `job` over. Lock-free and never blocks: callable from a user object's destructor.
  void push(reaper_job* job) noexcept {
    reaper_job* head = head_.load(std::memory_order_relaxed);
    unfinished_.fetch_add(1, std::memory_order_relaxed);
    do {
      job->next = head;
    } while (!head_.compare_exchange_weak(head, job, std::memory_order_release, std::memory_order_relaxed));
    head_.notify_one();
  }

  /// Waits for the jobs handed over to be run (up to `limits.jobs` in all), and for holds the
  /// driver may still end (a graph destroyed just before exit whose user object's destructor
  /// has not run yet) for as long as they keep ending (one at least every `limits.quiet`). A
  /// hold on a graph the program never destroyed never ends: at exit that costs
  /// `limits.quiet` once. Returns whether nothing was left outstanding.
  bool drain(reaper_drain_limits limits = {}) noexcept {
    using clock = std::chrono::steady_clock;
    const auto give_up = clock::now() + limits.jobs;
    auto last_change = clock::now();
    std::size_t seen = outstanding();
    for (;;) {
      const std::size_t now_outstanding = outstanding();
      if (now_outstanding == 0 && unfinished_.load(std::memory_order_acquire) == 0) return true;
      const auto now = clock::now();
      if (now_outstanding != seen || unfinished_.load(std::memory_order_acquire) != 0) {
        seen = now_outstanding;
        last_change = now;
      }
      if (now >= give_up || now - last_change >= limits.quiet) return now_outstanding == 0;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
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
        unfinished_.fetch_sub(1, std::memory_order_release);
        job = next;
      }
    }
  }

  std::once_flag started_;
  std::atomic<reaper_job*> head_{nullptr};
  std::atomic<std::size_t> outstanding_{0};
  std::atomic<std::size_t> unfinished_{0};  ///< jobs handed over and not yet run to their end
};

}  // namespace streamalloc::detail
