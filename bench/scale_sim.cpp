// bench_scale sections 1 and 3 on the CPU: the pool core on a simulated device, with the
// ordering records the front uses (no CUDA in the process at all), so that how the allocator's
// own costs grow with streams and live blocks can be profiled on any machine, apart from the
// driver's event record and stream wait:
//   ring   allocate 64 KiB on s[i], an event record on s[i] waited for by s[i+1] (the clock
//          capture and merge streamalloc's event and stream make), free on s[i+1]: ns per round
//          at N = 2 .. 10,000 streams, and the ordering calls alone
//   live   L live blocks of 256 B .. 4 KiB on one stream: ns per allocate, then per free in
//          random order, at L = 1,000 .. 1,000,000
//   churn  streams made, used (allocate + free 4 KiB) and retired one after another, as a
//          `stream`'s destructor retires its record: us per stream over blocks of 1,000, up to
//          1,000,000 streams. bench_scale's churn without the driver's stream creation and
//          destruction, so that a growth there can be told apart from the library's own
//
//   bench_scale_sim [ring [N...] | live | churn]

#include <streamalloc/detail/core/pool_core.hpp>

#include "../tests/support/sim_backend.hpp"
#include "free_floor.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

namespace {
using namespace streamalloc::detail;
using core = pool_core<streamalloc_test::sim_backend>;
using clk = std::chrono::steady_clock;

double ns_since(clk::time_point t, std::size_t n) {
  return std::chrono::duration<double, std::nano>(clk::now() - t).count() / static_cast<double>(n);
}

std::unique_ptr<core> make_core(std::shared_ptr<streamalloc_test::sim_device> dev =
                                    std::make_shared<streamalloc_test::sim_device>()) {
  core_options o;
  o.release_threshold = ~0ull;
  o.address_space = 1ull << 40;
  return std::make_unique<core>(streamalloc_test::sim_backend{std::move(dev)}, o);
}

struct sim_stream {
  stream_key key;
  clock_snapshot point;  // the stream's event: its last record
};

std::vector<sim_stream> make_streams(int n) {
  static std::uint64_t next_id = 1ull << 56;
  static char handles[16384];
  std::vector<sim_stream> s(n);
  for (int i = 0; i < n; ++i) {
    stream_record& r = ordering().record(++next_id);
    r.mark_handle_stable();
    s[i].key = stream_key{&r, &handles[next_id % 16384]};
  }
  return s;
}

void ring(const std::vector<int>& sizes) {
  std::printf("ring: ns per round (allocate 64 KiB on s[i], record, s[i+1] waits, free on s[i+1]); ordering alone\n");
  std::printf("%8s %12s %14s\n", "streams", "round", "record+wait");
  for (int n : sizes) {
    auto pool = make_core();
    std::vector<sim_stream> s = make_streams(n);
    const int rounds = std::max(16 * n, 200000);
    auto round = [&](int r, bool allocate) {
      const int i = r % n, j = (i + 1) % n;
      std::uint64_t p = allocate ? pool->allocate(64 << 10, s[i].key) : 0;
      s[i].key.record->capture_into(s[i].point);
      s[j].key.record->wait_for(s[i].point);
      if (allocate) pool->deallocate(p, s[j].key);
    };
    for (int r = 0; r < 2 * n + 1000; ++r) round(r, true);
    auto t = clk::now();
    for (int r = 0; r < rounds; ++r) round(r, true);
    const double full = ns_since(t, rounds);
    t = clk::now();
    for (int r = 0; r < rounds; ++r) round(r, false);
    const double ordering_only = ns_since(t, rounds);
    std::printf("%8d %12.0f %14.0f\n", n, full, ordering_only);
    pool->shutdown();
  }
}

void live() {
  std::printf("live blocks of 256 B .. 4 KiB, one stream: ns per allocate, per free (random order), floor\n");
  std::printf("%10s %10s %10s %10s\n", "live", "allocate", "free", "floor");
  std::uint64_t sink = 0;
  for (std::size_t n : {1000u, 10000u, 100000u, 1000000u}) {
    std::mt19937_64 rng(42);
    std::vector<std::size_t> sizes(n), order(n);
    for (auto& z : sizes) z = std::size_t{256} << (rng() % 5);
    for (std::size_t i = 0; i < n; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    auto pool = make_core();
    std::vector<sim_stream> s = make_streams(1);
    std::vector<std::uint64_t> p(n);
    auto t = clk::now();
    for (std::size_t i = 0; i < n; ++i) p[i] = pool->allocate(sizes[i], s[0].key);
    const double a = ns_since(t, n);
    t = clk::now();
    for (std::size_t i : order) pool->deallocate(p[i], s[0].key);
    const double f = ns_since(t, n);
    std::printf("%10zu %10.0f %10.0f %10.1f\n", n, a, f, bench::free_floor_ns(order, sink));
    pool->shutdown();
  }
  if (sink == 0) std::printf("(no neighbour was ever seen free: the floor's model is broken)\n");
}

double median_of(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

void churn() {
  constexpr int total = 1000000, block = 1000;
  std::printf("churn: streams made, used (allocate + free 4 KiB) and retired: us per stream over blocks of %d\n", block);
  std::printf("%12s %10s %10s %10s\n", "made so far", "us", "records", "states");
  auto dev = std::make_shared<streamalloc_test::sim_device>();
  auto pool = make_core(dev);
  // The driver hands a destroyed stream's object to the next stream made; so does this, so the
  // simulated device's table of streams stays as small as the driver's.
  static char handles[16];
  static std::uint64_t next_id = 1ull << 57;
  const auto census0 = ordering().census();
  std::vector<double> us;
  for (int done = 0; done < total; done += block) {
    const auto t = clk::now();
    for (int i = 0; i < block; ++i) {
      const std::uint64_t id = ++next_id;
      stream_record& r = ordering().record(id);
      r.mark_handle_stable();
      const stream_key key{&r, &handles[id % 16]};
      pool->deallocate(pool->allocate(4096, key), key);
      dev->run(key.native);  // the stream's work ends before it is destroyed
      ordering().retire(id);  // as streamalloc's stream destructor does
    }
    us.push_back(ns_since(t, block) / 1000.0);
    const int m = done / block + 1;  // rows at each doubling, and the last
    if ((m & (m - 1)) == 0 || done + block == total) {
      std::printf("%12d %10.2f %10zu %10zu\n", done + block, us.back(), ordering().census().records,
                  pool->stream_states().in_use);
    }
  }
  const std::vector<double> first(us.begin(), us.begin() + 10), last(us.end() - 10, us.end());
  const auto census1 = ordering().census();
  std::printf("last block / first block: %.2fx; median of the last 10 blocks / the first 10: %.2fx; records %zu before, "
              "%zu after; clock entries %zu, %zu\n",
              us.back() / us.front(), median_of(last) / median_of(first), census0.records, census1.records,
              census0.clock_entries, census1.clock_entries);
  pool->shutdown();
}

}  // namespace

int main(int argc, char** argv) {
  const bool all = argc < 2;
  std::vector<int> sizes;
  for (int i = 2; i < argc; ++i) sizes.push_back(std::atoi(argv[i]));
  if (sizes.empty()) sizes = {2, 16, 128, 1024, 10000};
  if (all || !std::strcmp(argv[1], "ring")) ring(sizes);
  if (all || !std::strcmp(argv[1], "live")) live();
  if (all || !std::strcmp(argv[1], "churn")) churn();
  return 0;
}
