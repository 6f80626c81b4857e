// How streamalloc's costs grow with the work, beside cudaMallocAsync in the same process:
//   1. ring    a hand-off ring over N streams: allocate on s[i], record an event, s[i+1] waits
//              on it, free on s[i+1]; ns per round at N = 2 .. 10,000, then split into the
//              allocator's calls and the ordering calls; 1b. the same ring at 2, 1,024 and
//              10,000 streams timed in alternating blocks, for ratios within one stretch of time
//   2. churn   streams made, used (allocate + free 4 KiB) and destroyed, one after another, a
//              million of them: us per stream over each block of 1,000, the records streamalloc
//              holds, and the host memory the process holds; then the driver's stream creation
//              and destruction alone, as many times, which is part of each of those streams
//   2b. raw    as 2 with raw handles (cudaStreamCreate), which CUDA never says are destroyed:
//              us per stream, the pool's reserved memory and the records held
//   3. live    L live blocks (256 B .. 4 KiB, one stream): ns per allocate, then per free,
//              at L = 1,000 .. 1,000,000, and the floor under a coalescing free at each L
//              (free_floor.hpp): how much of the growth the memory hierarchy alone makes; then
//              the allocates again on the grown pools, apart from the growth's driver calls
//   4. pools   pools made one after another, each allocating and growing a buffer in place,
//              until 4,096 or the first failure
//
//   bench_scale [--quick] [--json FILE] [--only ring,churn,raw,live,pools]

#include <streamalloc/detail/driver/capture.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include "bench_common.hpp"
#include "free_floor.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

using bench::clk;
using bench::seconds_since;
constexpr std::size_t KiB = 1024, MiB = 1024 * KiB;
bool quick = false;
bench::json_rows rows;

void json_row(const std::string& name, const std::string& fields) { rows.add(name, fields); }

/// Resident host memory of this process, in KiB (from /proc/self/statm).
long resident_kib() {
  std::ifstream f("/proc/self/statm");
  long pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * 4;  // 4 KiB pages
}



// --- 1. the hand-off ring ---------------------------------------------------------------------

// Where a round's time goes: the allocator's two calls (allocate + free) and the two ordering
// calls between them (record + wait), timed one by one in a second pass. The clock's own cost
// (back-to-back reads) is taken off each interval.
struct round_split {
  double alloc_free_ns = 0;
  double record_wait_ns = 0;
};

double clock_read_ns() {
  constexpr int n = 100000;
  const auto t = clk::now();
  for (int i = 0; i < n; ++i) (void)clk::now();
  return seconds_since(t) * 1e9 / n;
}

void ring() {
  std::printf("\n1. hand-off ring: allocate 64 KiB on s[i], record, s[i+1] waits, free on s[i+1]: ns per round;\n"
              "   then the round split: allocate + free, and record + wait (timed call by call); and the\n"
              "   driver's capture query that allocate and free each make, alone on the same two streams;\n"
              "   last, the ring's ordering alone (record + wait, no allocation; untimed calls as in the\n"
              "   round): through streamalloc's event and stream, and as raw cudaEventRecord +\n"
              "   cudaStreamWaitEvent, the part of a round no allocator can remove\n");
  std::printf("%8s %12s %12s %10s %14s %14s %14s %14s %14s %14s %14s\n", "streams", "streamalloc", "MallocAsync",
              "ratio", "ours a+f", "driver a+f", "ours rec+wait", "driver rec+w", "capture query", "order alone",
              "raw order");
  const double clock_ns = clock_read_ns();
  std::vector<int> sizes = {2, 16, 128, 1024};
  if (!quick) sizes.push_back(10000);  // thousands of streams alive at once, as servers keep
  for (int n : sizes) {
    streamalloc::pool pool(bench::kept());
    std::vector<streamalloc::stream> s;
    std::vector<streamalloc::event> e(n);
    s.reserve(n);
    for (int i = 0; i < n; ++i) s.emplace_back(0);
    std::vector<cudaEvent_t> re(n);
    for (auto& x : re) BENCH_CHECK(cudaEventCreateWithFlags(&x, cudaEventDisableTiming));
    cudaMemPool_t dp = bench::make_driver_pool();
    // Every stream takes part several times; at most 40,000 rounds (the driver's ring at
    // 10,000 streams costs about 0.1 ms a round).
    const int rounds = std::min(std::max(quick ? 4 * n : 16 * n, quick ? 5000 : 40000), 40000);
    auto time_rounds = [&](auto&& round, int count = 0) {
      if (count == 0) count = rounds;
      for (int r = 0; r < std::min(count, 2 * n + 1000); ++r) round(r);
      BENCH_CHECK(cudaDeviceSynchronize());
      const auto t = clk::now();
      for (int r = 0; r < count; ++r) round(r);
      const double ns = seconds_since(t) * 1e9 / count;
      BENCH_CHECK(cudaDeviceSynchronize());
      return ns;
    };
    auto ours_round = [&](int r, auto&& mark) {
      const int i = r % n, j = (i + 1) % n;
      void* p = pool.allocate(64 * KiB, s[i]);
      mark(1);
      e[i].record(s[i]);
      s[j].wait(e[i]);
      mark(2);
      pool.deallocate(p, s[j]);
    };
    auto driver_round = [&](int r, auto&& mark) {
      const int i = r % n, j = (i + 1) % n;
      void* p;
      BENCH_CHECK(cudaMallocFromPoolAsync(&p, 64 * KiB, dp, s[i].get()));
      mark(1);
      BENCH_CHECK(cudaEventRecord(re[i], s[i].get()));
      BENCH_CHECK(cudaStreamWaitEvent(s[j].get(), re[i], 0));
      mark(2);
      BENCH_CHECK(cudaFreeAsync(p, s[j].get()));
    };
    auto no_marks = [](int) {};
    // The split: the same rounds again, the clock read at each mark.
    auto split_rounds = [&](auto&& round) {
      round_split out;
      BENCH_CHECK(cudaDeviceSynchronize());
      clk::time_point a, b, c;
      for (int r = 0; r < rounds; ++r) {
        a = clk::now();
        round(r, [&](int m) { (m == 1 ? b : c) = clk::now(); });
        const auto d = clk::now();
        out.alloc_free_ns += std::chrono::duration<double, std::nano>((b - a) + (d - c)).count() - 2 * clock_ns;
        out.record_wait_ns += std::chrono::duration<double, std::nano>(c - b).count() - clock_ns;
      }
      BENCH_CHECK(cudaDeviceSynchronize());
      out.alloc_free_ns /= rounds;
      out.record_wait_ns /= rounds;
      return out;
    };
    const double ours = time_rounds([&](int r) { ours_round(r, no_marks); });
    const double async = time_rounds([&](int r) { driver_round(r, no_marks); });
    const round_split ours_split = split_rounds(ours_round);
    const round_split async_split = split_rounds(driver_round);
    // What the pool's allocate and free ask the driver on every call, whether their stream is
    // being captured, made alone on the same two streams per round: the driver's share of
    // `ours a+f`, which grows as its own stream objects fall out of the caches.
    const double query = time_rounds([&](int r) {
      const int i = r % n, j = (i + 1) % n;
      (void)streamalloc::detail::capture_of(s[i].get(), "bench");
      (void)streamalloc::detail::capture_of(s[j].get(), "bench");
    });
    // The ordering alone, timed the same way as the rounds: what the round costs without its
    // allocate and free. Through streamalloc it includes the ordering records' clocks; raw, it
    // is the driver's record and wait and nothing else. At most 10,000 rounds: from 1,024
    // streams on these cost tens of microseconds a round (docs/pool.md, "The ring's sizes
    // timed in turn").
    const double order_alone = time_rounds([&](int r) {
      const int i = r % n, j = (i + 1) % n;
      e[i].record(s[i]);
      s[j].wait(e[i]);
    }, std::min(rounds, 10000));
    const double raw_order = time_rounds([&](int r) {
      const int i = r % n, j = (i + 1) % n;
      BENCH_CHECK(cudaEventRecord(re[i], s[i].get()));
      BENCH_CHECK(cudaStreamWaitEvent(s[j].get(), re[i], 0));
    }, std::min(rounds, 10000));
    std::printf("%8d %12.0f %12.0f %9.2fx %14.0f %14.0f %14.0f %14.0f %14.0f %14.0f %14.0f\n", n, ours, async,
                async / ours, ours_split.alloc_free_ns, async_split.alloc_free_ns, ours_split.record_wait_ns,
                async_split.record_wait_ns, query, order_alone, raw_order);
    json_row("ring_" + std::to_string(n),
             "\"streams\": " + std::to_string(n) + ", \"streamalloc_ns\": " + std::to_string(ours) +
                 ", \"cudaMallocAsync_ns\": " + std::to_string(async) + ", \"streamalloc_alloc_free_ns\": " +
                 std::to_string(ours_split.alloc_free_ns) + ", \"cudaMallocAsync_alloc_free_ns\": " +
                 std::to_string(async_split.alloc_free_ns) + ", \"streamalloc_record_wait_ns\": " +
                 std::to_string(ours_split.record_wait_ns) + ", \"driver_record_wait_ns\": " +
                 std::to_string(async_split.record_wait_ns) + ", \"capture_query_ns\": " + std::to_string(query) +
                 ", \"streamalloc_order_alone_ns\": " + std::to_string(order_alone) +
                 ", \"raw_order_alone_ns\": " + std::to_string(raw_order));
    for (auto& x : re) BENCH_CHECK(cudaEventDestroy(x));
    BENCH_CHECK(cudaMemPoolDestroy(dp));
  }
}

// --- 1b. the ring's sizes in turn -------------------------------------------------------------

// The ring's cost at 2 streams moves by up to 2x from one run to the next on the same machine
// (every column at once, the driver's capture query included: the machine's speed, not the
// allocator's), and section 1 times each size seconds apart. Here rings of 2, 1,024 and
// 10,000 streams are built side by side and timed in alternating blocks of rounds, so that each
// turn compares sizes timed within a fraction of a second of each other; the ratios the
// targets ask for are the median of the turns' ratios.
void ring_interleaved() {
  const std::vector<int> sizes = quick ? std::vector<int>{2, 1024} : std::vector<int>{2, 1024, 10000};
  const int turns = quick ? 5 : 11;
  const int block = quick ? 4000 : 20000;  // 10,000 streams: each stream twice a block
  std::printf("\n1b. the ring again, sizes timed in turn (%d turns; a block of %d rounds of each size per turn;\n"
              "    a pool and streams of their own for each size): ns per round, and each turn's ratio\n"
              "    to the 2-stream block of the same turn\n",
              turns, block);
  struct ring_setup {
    int n;
    streamalloc::pool pool{bench::kept()};
    std::vector<streamalloc::stream> s;
    std::vector<streamalloc::event> e;
    int next = 0;
    explicit ring_setup(int count) : n(count), e(count) {
      s.reserve(count);
      for (int i = 0; i < count; ++i) s.emplace_back(0);
    }
    void rounds(int count) {
      for (int c = 0; c < count; ++c, next = (next + 1) % n) {
        const int i = next, j = (next + 1) % n;
        void* p = pool.allocate(64 * KiB, s[i]);
        e[i].record(s[i]);
        s[j].wait(e[i]);
        pool.deallocate(p, s[j]);
      }
    }
  };
  std::vector<std::unique_ptr<ring_setup>> rings;
  for (int n : sizes) {
    rings.push_back(std::make_unique<ring_setup>(n));
    rings.back()->rounds(2 * n + 1000);
  }
  BENCH_CHECK(cudaDeviceSynchronize());
  std::vector<std::vector<double>> ns(sizes.size());
  for (int t = 0; t < turns; ++t) {
    for (std::size_t k = 0; k < rings.size(); ++k) {
      BENCH_CHECK(cudaDeviceSynchronize());
      const auto start = clk::now();
      rings[k]->rounds(block);
      ns[k].push_back(seconds_since(start) * 1e9 / block);
    }
  }
  BENCH_CHECK(cudaDeviceSynchronize());
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("%8s %10s %10s %10s %16s %16s\n", "streams", "median", "min", "max", "ratio to 2, med", "ratio min..max");
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    std::vector<double> ratio;
    for (int t = 0; t < turns; ++t) ratio.push_back(ns[k][t] / ns[0][t]);
    const auto [lo, hi] = std::minmax_element(ns[k].begin(), ns[k].end());
    const auto [rlo, rhi] = std::minmax_element(ratio.begin(), ratio.end());
    std::printf("%8d %10.0f %10.0f %10.0f %15.2fx %9.2f..%.2f\n", sizes[k], median(ns[k]), *lo, *hi, median(ratio), *rlo,
                *rhi);
    std::string turns_json;
    for (int t = 0; t < turns; ++t) turns_json += (t ? ", " : "") + std::to_string(ns[k][t]);
    json_row("ring_interleaved_" + std::to_string(sizes[k]),
             "\"streams\": " + std::to_string(sizes[k]) + ", \"median_ns\": " + std::to_string(median(ns[k])) +
                 ", \"median_ratio_to_2\": " + std::to_string(median(ratio)) + ", \"turns_ns\": [" + turns_json + "]");
  }
}

// --- 2. stream churn --------------------------------------------------------------------------

// What streamalloc itself holds for streams: ordering records and their clock entries.
streamalloc::detail::ordering_registry::census_counts library_held() {
  return streamalloc::detail::ordering().census();
}

void churn() {
  // A million streams for streamalloc (a long-running server's day); the driver's loop, which
  // the first rows compare with, stops at 16,000.
  const int total = quick ? 4000 : 1000000, driver_total = quick ? 4000 : 16000, block = 1000;
  std::printf("\n2. streams made, used (allocate + free 4 KiB) and destroyed: us per stream over blocks of %d\n",
              block);
  std::printf("%10s %12s %10s %14s %12s %14s\n", "made so far", "streamalloc", "records", "host KiB held", "driver",
              "host KiB held");
  streamalloc::pool pool(bench::kept());
  cudaMemPool_t dp = bench::make_driver_pool();
  const auto held0 = library_held();
  const long rss0 = resident_kib();
  std::vector<double> ours, async;
  std::vector<long> rss_ours, rss_async;
  std::vector<std::size_t> records;
  for (int done = 0; done < total; done += block) {
    auto t = clk::now();
    for (int i = 0; i < block; ++i) {
      streamalloc::stream s(0);
      pool.deallocate(pool.allocate(4 * KiB, s), s);
    }
    ours.push_back(seconds_since(t) * 1e6 / block);
    rss_ours.push_back(resident_kib() - rss0);
    records.push_back(library_held().records);
  }
  const auto held1 = library_held();
  const long rss1 = resident_kib();
  // What the driver's cudaStreamCreate + cudaStreamDestroy cost alone, the same number of times:
  // a stream's time above includes them, so a growth there may be the driver's own.
  std::vector<double> bare;
  for (int done = 0; done < total; done += block) {
    auto t = clk::now();
    for (int i = 0; i < block; ++i) {
      cudaStream_t s;
      BENCH_CHECK(cudaStreamCreate(&s));
      BENCH_CHECK(cudaStreamDestroy(s));
    }
    bare.push_back(seconds_since(t) * 1e6 / block);
  }
  for (int done = 0; done < driver_total; done += block) {
    auto t = clk::now();
    for (int i = 0; i < block; ++i) {
      cudaStream_t s;
      BENCH_CHECK(cudaStreamCreate(&s));
      void* p;
      BENCH_CHECK(cudaMallocFromPoolAsync(&p, 4 * KiB, dp, s));
      BENCH_CHECK(cudaFreeAsync(p, s));
      BENCH_CHECK(cudaStreamDestroy(s));
    }
    async.push_back(seconds_since(t) * 1e6 / block);
    rss_async.push_back(resident_kib() - rss1);
  }
  for (std::size_t k = 0; k < ours.size(); ++k) {
    const int made = static_cast<int>(k + 1) * block;
    // Every row while the driver's loop runs beside; then at each doubling, and the last.
    const int m = made / block;
    if (k >= async.size() && (m & (m - 1)) != 0 && k + 1 != ours.size()) continue;
    const bool drv = k < async.size();
    std::printf("%10d %12.1f %10zu %14ld", made, ours[k], records[k], rss_ours[k]);
    if (drv) std::printf(" %12.1f %14ld", async[k], rss_async[k]);
    std::printf("\n");
    std::string fields = "\"streams_made\": " + std::to_string(made) + ", \"streamalloc_us\": " + std::to_string(ours[k]) +
                         ", \"streamalloc_records\": " + std::to_string(records[k]) +
                         ", \"streamalloc_host_kib\": " + std::to_string(rss_ours[k]);
    if (drv) {
      fields += ", \"cudaMallocAsync_us\": " + std::to_string(async[k]) +
                ", \"driver_host_kib\": " + std::to_string(rss_async[k]);
    }
    json_row("churn_" + std::to_string(made), fields);
  }
  std::printf("   last block / first block: streamalloc %.2fx over %d streams, driver %.2fx over %d\n",
              ours.back() / ours.front(), total, async.back() / async.front(), driver_total);
  // One block of 1,000 is a few milliseconds: a preempted block moves the ratio above by itself.
  auto ends = [](const std::vector<double>& v, bool last) {
    const std::size_t k = std::min<std::size_t>(10, v.size());
    return bench::median(last ? std::vector<double>(v.end() - k, v.end()) : std::vector<double>(v.begin(), v.begin() + k));
  };
  std::printf("   median of the last 10 blocks / the first 10: streamalloc %.2fx (%.1f / %.1f us); the driver's stream\n"
              "   create + destroy alone %.2fx (%.1f / %.1f us)\n",
              ends(ours, true) / ends(ours, false), ends(ours, true), ends(ours, false), ends(bare, true) / ends(bare, false),
              ends(bare, true), ends(bare, false));
  std::printf("   streamalloc's records: %zu before, %zu after (clock entries %zu, %zu); process memory %+ld KiB\n",
              held0.records, held1.records, held0.clock_entries, held1.clock_entries, rss1 - rss0);
  json_row("churn_summary", "\"streams_made\": " + std::to_string(total) + ", \"last_over_first\": " +
                                std::to_string(ours.back() / ours.front()) + ", \"median_last10_over_first10\": " +
                                std::to_string(ends(ours, true) / ends(ours, false)) +
                                ", \"driver_create_destroy_median_last10_over_first10\": " +
                                std::to_string(ends(bare, true) / ends(bare, false)) + ", \"records_before\": " +
                                std::to_string(held0.records) + ", \"records_after\": " + std::to_string(held1.records) +
                                ", \"clock_entries_before\": " + std::to_string(held0.clock_entries) +
                                ", \"clock_entries_after\": " + std::to_string(held1.clock_entries) +
                                ", \"host_kib_after\": " + std::to_string(rss1 - rss0));
  BENCH_CHECK(cudaMemPoolDestroy(dp));
}

// --- 2b. raw stream churn ----------------------------------------------------------------------

// As 2, with raw handles (cudaStreamCreate, as CuPy and servers make them), which CUDA never
// says are destroyed. Each stream frees 4 KiB, and every third one 1 MiB too: what a destroyed
// stream's last frees leave waiting is bounded by the events the pool records while it has the
// handle, and a stream met under a destroyed one's handle retires that one (docs/pool.md).
void raw_churn() {
  const int total = quick ? 4000 : 200000, driver_total = quick ? 4000 : 16000, block = 1000;
  std::printf("\n2b. raw streams made, used (4 KiB, every third also 1 MiB) and destroyed: us per stream over blocks "
              "of %d\n",
              block);
  std::printf("%10s %12s %14s %10s %10s %12s %14s\n", "made so far", "streamalloc", "reserved MiB", "records",
              "handles", "driver", "reserved MiB");
  streamalloc::pool pool(bench::kept());
  cudaMemPool_t dp = bench::make_driver_pool();
  const auto held0 = library_held();
  std::vector<double> ours, async;
  std::vector<std::size_t> reserved, records, handles, reserved_async;
  const auto use = [](auto&& allocate, auto&& free, int i) {
    void* a = allocate(4 * KiB);
    void* b = i % 3 == 0 ? allocate(MiB) : nullptr;
    free(a);
    if (b != nullptr) free(b);
  };
  for (int done = 0; done < total; done += block) {
    auto t = clk::now();
    for (int i = 0; i < block; ++i) {
      cudaStream_t s;
      BENCH_CHECK(cudaStreamCreate(&s));
      const streamalloc::stream_ref r{s};
      use([&](std::size_t n) { return pool.allocate(n, r); }, [&](void* p) { pool.deallocate(p, r); }, i);
      BENCH_CHECK(cudaStreamDestroy(s));
    }
    ours.push_back(seconds_since(t) * 1e6 / block);
    reserved.push_back(pool.statistics().reserved_current);
    const auto held = library_held();
    records.push_back(held.records);
    handles.push_back(held.handles);
  }
  for (int done = 0; done < driver_total; done += block) {
    auto t = clk::now();
    for (int i = 0; i < block; ++i) {
      cudaStream_t s;
      BENCH_CHECK(cudaStreamCreate(&s));
      use(
          [&](std::size_t n) {
            void* p;
            BENCH_CHECK(cudaMallocFromPoolAsync(&p, n, dp, s));
            return p;
          },
          [&](void* p) { BENCH_CHECK(cudaFreeAsync(p, s)); }, i);
      BENCH_CHECK(cudaStreamDestroy(s));
    }
    async.push_back(seconds_since(t) * 1e6 / block);
    std::uint64_t r = 0;
    BENCH_CHECK(cudaMemPoolGetAttribute(dp, cudaMemPoolAttrReservedMemCurrent, &r));
    reserved_async.push_back(r);
  }
  std::size_t reserved_max = 0;
  for (std::size_t k = 0; k < ours.size(); ++k) {
    reserved_max = std::max(reserved_max, reserved[k]);
    const int made = static_cast<int>(k + 1) * block;
    const int m = made / block;
    if (k >= async.size() && (m & (m - 1)) != 0 && k + 1 != ours.size()) continue;
    const bool drv = k < async.size();
    std::printf("%10d %12.1f %14.1f %10zu %10zu", made, ours[k], static_cast<double>(reserved[k]) / MiB, records[k],
                handles[k]);
    if (drv) std::printf(" %12.1f %14.1f", async[k], static_cast<double>(reserved_async[k]) / MiB);
    std::printf("\n");
    std::string fields = "\"streams_made\": " + std::to_string(made) + ", \"streamalloc_us\": " + std::to_string(ours[k]) +
                         ", \"streamalloc_reserved\": " + std::to_string(reserved[k]) +
                         ", \"streamalloc_records\": " + std::to_string(records[k]) +
                         ", \"streamalloc_handles\": " + std::to_string(handles[k]);
    if (drv) {
      fields += ", \"cudaMallocAsync_us\": " + std::to_string(async[k]) +
                ", \"driver_reserved\": " + std::to_string(reserved_async[k]);
    }
    json_row("raw_churn_" + std::to_string(made), fields);
  }
  std::printf("   last block / first block: streamalloc %.2fx over %d streams, driver %.2fx over %d; streamalloc's "
              "reserved at most %.1f MiB; records %zu before, %zu after\n",
              ours.back() / ours.front(), total, async.back() / async.front(), driver_total,
              static_cast<double>(reserved_max) / MiB, held0.records, records.back());
  json_row("raw_churn_summary", "\"streams_made\": " + std::to_string(total) + ", \"last_over_first\": " +
                                    std::to_string(ours.back() / ours.front()) + ", \"reserved_max\": " +
                                    std::to_string(reserved_max) + ", \"records_before\": " +
                                    std::to_string(held0.records) + ", \"records_after\": " +
                                    std::to_string(records.back()));
  BENCH_CHECK(cudaMemPoolDestroy(dp));
}

// --- 3. live blocks ---------------------------------------------------------------------------

void live_blocks() {
  std::printf("\n3. L live blocks of 256 B .. 4 KiB on one stream: ns per allocate, then per free (random order)\n");
  std::printf("   (then again on the pools the first pass grew: what an allocate costs without the growth)\n");
  std::printf("%10s %12s %12s %12s %12s %12s %12s %12s\n", "live", "alloc ours", "alloc driver", "free ours",
              "free driver", "free floor", "grown: ours", "grown: drv");
  std::uint64_t sink = 0;
  std::vector<std::size_t> counts = {1000, 10000, 100000};
  if (!quick) counts.push_back(1000000);
  for (std::size_t n : counts) {
    std::mt19937_64 rng(42);
    std::vector<std::size_t> sizes(n);
    for (auto& z : sizes) z = std::size_t{256} << (rng() % 5);  // 256 .. 4096
    std::vector<std::size_t> order(n);
    for (std::size_t i = 0; i < n; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    streamalloc::stream s(0);
    std::vector<void*> p(n);
    double a_ours, f_ours, a_drv, f_drv, a_ours_grown, a_drv_grown;
    {
      streamalloc::pool pool(bench::kept());
      auto t = clk::now();
      for (std::size_t i = 0; i < n; ++i) p[i] = pool.allocate(sizes[i], s);
      a_ours = seconds_since(t) * 1e9 / n;
      t = clk::now();
      for (std::size_t i : order) pool.deallocate(p[i], s);
      f_ours = seconds_since(t) * 1e9 / n;
      s.synchronize();
      t = clk::now();
      for (std::size_t i = 0; i < n; ++i) p[i] = pool.allocate(sizes[i], s);
      a_ours_grown = seconds_since(t) * 1e9 / n;
      for (std::size_t i : order) pool.deallocate(p[i], s);
      s.synchronize();
    }
    {
      cudaMemPool_t dp = bench::make_driver_pool();
      auto t = clk::now();
      for (std::size_t i = 0; i < n; ++i) BENCH_CHECK(cudaMallocFromPoolAsync(&p[i], sizes[i], dp, s.get()));
      a_drv = seconds_since(t) * 1e9 / n;
      t = clk::now();
      for (std::size_t i : order) BENCH_CHECK(cudaFreeAsync(p[i], s.get()));
      f_drv = seconds_since(t) * 1e9 / n;
      s.synchronize();
      t = clk::now();
      for (std::size_t i = 0; i < n; ++i) BENCH_CHECK(cudaMallocFromPoolAsync(&p[i], sizes[i], dp, s.get()));
      a_drv_grown = seconds_since(t) * 1e9 / n;
      for (std::size_t i : order) BENCH_CHECK(cudaFreeAsync(p[i], s.get()));
      s.synchronize();
      BENCH_CHECK(cudaMemPoolDestroy(dp));
    }
    const double floor_ns = bench::free_floor_ns(order, sink);
    std::printf("%10zu %12.0f %12.0f %12.0f %12.0f %12.1f %12.0f %12.0f\n", n, a_ours, a_drv, f_ours, f_drv, floor_ns,
                a_ours_grown, a_drv_grown);
    json_row("live_" + std::to_string(n),
             "\"live\": " + std::to_string(n) + ", \"streamalloc_allocate_ns\": " + std::to_string(a_ours) +
                 ", \"cudaMallocAsync_allocate_ns\": " + std::to_string(a_drv) + ", \"streamalloc_free_ns\": " +
                 std::to_string(f_ours) + ", \"cudaFreeAsync_ns\": " + std::to_string(f_drv) +
                 ", \"free_floor_ns\": " + std::to_string(floor_ns) + ", \"streamalloc_allocate_grown_ns\": " +
                 std::to_string(a_ours_grown) + ", \"cudaMallocAsync_allocate_grown_ns\": " +
                 std::to_string(a_drv_grown));
  }
  if (sink == 0) std::printf("   (no neighbour was ever seen free: the floor's model is broken)\n");
}

// --- 4. many pools ----------------------------------------------------------------------------

void many_pools() {
  const std::size_t target = 4096;
  std::printf("\n4. pools made one after another, each allocating 1 MiB and growing it in place to 4 MiB\n");
  std::vector<std::unique_ptr<streamalloc::pool>> pools;
  streamalloc::stream s(0);
  std::vector<void*> bufs;
  std::string failure;
  std::size_t grown = 0;
  const auto t = clk::now();
  try {
    while (pools.size() < target) {
      // 2 MiB chunks, so 4,096 pools hold 16 GiB: what limits them is addresses, not memory.
      auto p = std::make_unique<streamalloc::pool>(streamalloc::pool_properties{.chunk_size = 2 * MiB});
      void* b = p->allocate(MiB, s);
      if (p->grow_in_place(b, 4 * MiB, s) >= 4 * MiB) ++grown;
      bufs.push_back(b);
      pools.push_back(std::move(p));
    }
  } catch (const std::exception& e) {
    failure = e.what();
  }
  const double us = seconds_since(t) * 1e6 / std::max<std::size_t>(pools.size(), 1);
  std::printf("   %zu pools made (%zu grew in place), %.0f us each%s%s\n", pools.size(), grown, us,
              failure.empty() ? "" : "; then: ", failure.c_str());
  json_row("pools", "\"pools\": " + std::to_string(pools.size()) + ", \"grown_in_place\": " + std::to_string(grown) +
                        ", \"us_per_pool\": " + std::to_string(us) + ", \"failed\": " +
                        (failure.empty() ? "false" : "true"));
  for (std::size_t i = 0; i < pools.size(); ++i) pools[i]->deallocate(bufs[i], s);
  s.synchronize();
}

}  // namespace

int main(int argc, char** argv) {
  bench::require_gpu("bench_scale");
  std::string json, only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
  }
  const bench::gpu_info gpu = bench::describe_gpu();
  auto want = [&](const char* k) { return only.empty() || only.find(k) != std::string::npos; };
  // Churn last: the driver's own allocator slows down after a million streams were made and
  // destroyed (its allocate took 55 us on the H100 afterwards), which would skew what follows.
  if (want("live")) live_blocks();
  if (want("ring")) ring();
  if (want("ring")) ring_interleaved();
  if (want("pools")) many_pools();
  if (want("raw")) raw_churn();
  if (want("churn")) churn();
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"bench\": \"scale\",\n  \"gpu\": \"" << bench::json_escape(gpu.name) << "\",\n  \"driver\": " << gpu.driver
        << ",\n  \"quick\": " << (quick ? "true" : "false") << ",\n  \"rows\": [\n" << rows.str() << "\n  ]\n}\n";
    std::printf("\nwrote %s\n", json.c_str());
  }
  return 0;
}
