// bench_pool section 3 on the CPU: threads allocating and freeing 4 KiB on their own streams,
// through the pool core on a simulated device (no CUDA in the process at all), beside the
// same threads with pools of their own and a CPU-only loop. Tells the pool's code apart from
// the CUDA runtime when the in-process scaling of bench_pool falls short.
//
//   bench_threads_sim [window ms]

#include <streamalloc/detail/core/pool_core.hpp>

#include "../tests/support/sim_backend.hpp"
#include "thread_rate.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

namespace {
using namespace streamalloc::detail;
using core = pool_core<streamalloc_test::sim_backend>;

std::unique_ptr<core> make_core() {
  core_options o;
  o.release_threshold = ~0ull;
  o.address_space = 64ull << 30;
  return std::make_unique<core>(streamalloc_test::sim_backend{std::make_shared<streamalloc_test::sim_device>()}, o);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
}  // namespace

int main(int argc, char** argv) {
  const double window_ms = argc > 1 ? std::atof(argv[1]) : 50;
  const std::vector<int> cores = bench::one_cpu_per_core();
  const int max_threads = static_cast<int>(std::min<std::size_t>(16, cores.size()));
  auto shared = make_core();
  std::vector<std::unique_ptr<core>> own;
  std::vector<stream_key> keys;
  static char handles[16];
  for (int i = 0; i < 16; ++i) {
    own.push_back(make_core());
    keys.push_back(stream_key{&ordering().record((1ull << 60) + i), &handles[i]});
  }
  std::vector<bench::cpu_only_work> work(16);
  std::printf("million pairs/s, all threads over the same window\n");
  std::printf("%8s %12s %9s %8s %12s %9s %12s %9s\n", "threads", "shared pool", "scaling", "slowest", "own pools", "scaling",
              "CPU-only", "scaling");
  const std::chrono::duration<double, std::milli> window(window_ms);
  const auto none = [](int) {};
  double s1 = 0, o1 = 0, c1 = 0;
  for (int threads = 1; threads <= max_threads; threads *= 2) {
    std::vector<double> s, o, c, slow;
    for (int r = 0; r < 5; ++r) {
      const auto x = bench::run_threads(threads, cores, window, none,
                                        [&](int t) { shared->deallocate(shared->allocate(4096, keys[t]), keys[t]); });
      s.push_back(x.total);
      slow.push_back(x.slowest_share);
      o.push_back(bench::run_threads(threads, cores, window, none, [&](int t) {
                    own[t]->deallocate(own[t]->allocate(4096, keys[t]), keys[t]);
                  }).total);
      c.push_back(bench::run_threads(threads, cores, window, none, [&](int t) { work[t](); }).total);
    }
    const double sm = median(s), om = median(o), cm = median(c);
    if (threads == 1) s1 = sm, o1 = om, c1 = cm;
    std::printf("%8d %12.2f %8.2fx %8.2f %12.2f %8.2fx %12.2f %8.2fx\n", threads, sm, sm / s1, median(slow), om, om / o1, cm,
                cm / c1);
  }
  shared->shutdown();
  for (auto& p : own) p->shutdown();
  return 0;
}
