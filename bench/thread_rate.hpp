#pragma once

// Throughput of n threads running the same operation, each on a core of its own: the shared
// harness of bench_pool section 3 and bench_threads_sim.
//
// Every thread runs the operation for the same wall-clock window and counts; the rate is the
// sum of the counts over the window (the system's throughput). The slowest thread's share is
// reported beside it: on a VM whose vCPUs run at different speeds (other tenants on the host
// cores, as seen on the H200 machines: 6 to 12 M pairs/s between processes run at once), a
// rate taken as "threads x the slowest thread" measures the slowest vCPU, not the allocator.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <pthread.h>
#include <sched.h>
#include <string>
#include <thread>
#include <vector>

namespace bench {

/// One CPU per physical core, from sysfs (the first of each core's hardware threads), so that
/// n threads run on n cores rather than share some through SMT; empty if unknown.
inline std::vector<int> one_cpu_per_core() {
  std::vector<int> cpus;
  std::vector<std::string> seen;
  for (int c = 0; c < 1024; ++c) {
    std::ifstream f("/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/thread_siblings_list");
    if (!f) break;
    std::string siblings;
    std::getline(f, siblings);
    if (std::find(seen.begin(), seen.end(), siblings) != seen.end()) continue;
    seen.push_back(siblings);
    cpus.push_back(c);
  }
  return cpus;
}

inline void pin_to(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  (void)pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

/// Work of about the allocator's fast path's length that touches nothing another thread
/// touches: a chain of dependent shifts over a table of the thread's own. How this scales is
/// what the machine gives independent threads.
struct alignas(64) cpu_only_work {
  std::uint64_t table[512] = {};
  std::uint64_t x = 0x9E3779B97F4A7C15ULL;
  void operator()() noexcept {
    for (int i = 0; i < 48; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      table[x & 511] += x;
    }
  }
};

struct thread_rate {
  double total = 0;           ///< million operations per second, all threads together
  double slowest_share = 0;   ///< the slowest thread's count / the mean count (1: all equal)
};

/// Runs `op(t)` on `threads` threads (thread t pinned to cores[t] when there are enough
/// cores) for `window` after `setup(t)` and a warm-up, and returns the throughput.
template <class Setup, class Op>
thread_rate run_threads(int threads, const std::vector<int>& cores, std::chrono::duration<double> window, Setup&& setup,
                        Op&& op) {
  struct alignas(128) counter {
    std::uint64_t n = 0;
  };
  std::vector<counter> counts(threads);
  std::atomic<int> ready{0};
  std::atomic<bool> go{false}, stop{false};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      if (threads <= static_cast<int>(cores.size())) pin_to(cores[t]);
      setup(t);
      for (int i = 0; i < 1000; ++i) op(t);
      ++ready;
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      std::uint64_t n = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        for (int i = 0; i < 256; ++i) op(t);
        n += 256;
      }
      counts[t].n = n;
    });
  }
  while (ready < threads) std::this_thread::yield();
  const auto start = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  std::this_thread::sleep_for(window);
  stop = true;
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (auto& t : ts) t.join();
  std::uint64_t sum = 0, least = UINT64_MAX;
  for (const counter& c : counts) sum += c.n, least = std::min(least, c.n);
  return {static_cast<double>(sum) / secs / 1e6, static_cast<double>(least) * threads / static_cast<double>(sum)};
}

}  // namespace bench
