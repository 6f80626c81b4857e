// What logging every allocation costs: ns per allocate + free pair of 4 KiB on one stream,
// through the bare pool_resource and through logging_resource writing CSV and JSON lines to a
// file, and to a stream that discards what it is given (formatting and the lock alone, no write);
// one thread, then 2 and 8 threads on their own streams over one pool and one log.
//
//   bench_logging_resource [--quick] [--json FILE] [--dir DIR]     (logs go to DIR, default /tmp)

#include <streamalloc/logging_resource.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/resource.hpp>
#include <streamalloc/stream.hpp>

#include "bench_common.hpp"
#include "thread_rate.hpp"

#include <cuda_runtime.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <ostream>
#include <streambuf>
#include <string>
#include <vector>

namespace {
using bench::clk;
using bench::seconds_since;
constexpr std::size_t KiB = 1024;
bool quick = false;
bench::json_rows rows;
std::filesystem::path dir = "/tmp";

/// Takes everything and keeps nothing: the log's cost without the write.
struct discard_buffer : std::streambuf {
  int_type overflow(int_type c) override { return traits_type::not_eof(c); }
  std::streamsize xsputn(const char*, std::streamsize n) override { return n; }
};
discard_buffer discarded;
std::ostream nowhere(&discarded);

enum class sink { none, file, discard };
struct setting {
  const char* name;
  sink where;
  streamalloc::log_format format;
};
const setting settings[] = {
    {"pool_resource", sink::none, streamalloc::log_format::csv},
    {"csv_file", sink::file, streamalloc::log_format::csv},
    {"json_file", sink::file, streamalloc::log_format::json_lines},
    {"csv_discard", sink::discard, streamalloc::log_format::csv},
    {"json_discard", sink::discard, streamalloc::log_format::json_lines},
};

std::filesystem::path log_path(const setting& s) {
  return dir / ("streamalloc_bench_log_" + std::to_string(::getpid()) + "_" + s.name + ".log");
}

/// Lines in a file, and its size.
std::pair<std::size_t, std::size_t> count_lines(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::size_t lines = 0, bytes = 0;
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    const auto n = static_cast<std::size_t>(in.gcount());
    bytes += n;
    for (std::size_t i = 0; i < n; ++i) lines += buf[i] == '\n';
  }
  return {lines, bytes};
}

/// Calls `run(resource)` with the resource of setting `s` over `pool`: the bare pool_resource,
/// or a logging_resource over it writing where `s` says.
template <class Run>
void with_resource(const setting& s, streamalloc::pool& pool, Run&& run) {
  streamalloc::device_resource bare(pool);
  if (s.where == sink::none) {
    run(bare);
    return;
  }
  std::optional<streamalloc::logging_resource<streamalloc::device_resource>> logged;
  if (s.where == sink::file) {
    logged.emplace(bare, log_path(s), s.format);
  } else {
    logged.emplace(bare, nowhere, s.format);
  }
  run(*logged);
  logged->flush();
}

// --- 1. one thread ----------------------------------------------------------------------------

void one_thread() {
  std::printf("\n1. allocate + free of 4 KiB on one stream, one thread: ns per pair (median of 5 runs of %d)\n",
              quick ? 20000 : 200000);
  std::printf("%16s %10s %12s %10s %14s\n", "through", "ns/pair", "added ns", "vs bare", "bytes/line");
  streamalloc::pool pool(bench::kept());
  streamalloc::stream s(0);
  const int n = quick ? 20000 : 200000;
  {
    // Each line reads the clock once: what that costs here (a VM's clock may cost more).
    std::int64_t sum = 0;
    const auto t = clk::now();
    for (int i = 0; i < n; ++i) sum += clk::now().time_since_epoch().count();
    const double clock_ns = seconds_since(t) * 1e9 / n;
    std::printf("   (std::chrono::steady_clock::now(): %.1f ns a call%s)\n", clock_ns, sum == 42 ? " " : "");
    rows.add("steady_clock_now", "\"ns\": " + std::to_string(clock_ns));
  }
  double bare_ns = 0;
  for (const setting& set : settings) {
    std::vector<double> runs;
    std::size_t lines = 0, bytes = 0;
    for (int r = 0; r < 5; ++r) {
      with_resource(set, pool, [&](auto& mr) {
        for (int i = 0; i < 1000; ++i) mr.deallocate_async(mr.allocate_async(4 * KiB, 256, s), 4 * KiB, 256, s);  // warm
        const auto t = clk::now();
        for (int i = 0; i < n; ++i) mr.deallocate_async(mr.allocate_async(4 * KiB, 256, s), 4 * KiB, 256, s);
        runs.push_back(seconds_since(t) * 1e9 / n);
      });
      if (set.where == sink::file) {
        const auto [l, b] = count_lines(log_path(set));
        const std::size_t want = 2 * (static_cast<std::size_t>(n) + 1000) + (set.format == streamalloc::log_format::csv);
        if (l != want) {
          std::fprintf(stderr, "%s: %zu lines in the log, %zu expected\n", set.name, l, want);
          std::exit(1);
        }
        lines = l, bytes = b;
        std::filesystem::remove(log_path(set));
      }
    }
    const double ns = bench::median(runs);
    if (set.where == sink::none) bare_ns = ns;
    std::printf("%16s %10.1f %12.1f %9.2fx %14s\n", set.name, ns, ns - bare_ns, ns / bare_ns,
                lines ? std::to_string(static_cast<double>(bytes) / static_cast<double>(lines)).substr(0, 5).c_str() : "-");
    rows.add(std::string("one_thread_") + set.name,
             "\"ns_per_pair\": " + std::to_string(ns) + ", \"added_ns\": " + std::to_string(ns - bare_ns) +
                 (lines ? ", \"bytes_per_line\": " + std::to_string(static_cast<double>(bytes) / static_cast<double>(lines))
                        : std::string()));
  }
  s.synchronize();
}

// --- 2. threads at once -----------------------------------------------------------------------

void threads_at_once(int threads) {
  std::vector<int> cores = bench::one_cpu_per_core();
  std::printf("\n%d threads on their own streams, one pool, one log: all threads together over a %d ms window\n"
              "   (median of 5), and ns per pair seen by each thread (%zu cores seen)\n",
              threads, quick ? 10 : 50, cores.size());
  std::printf("%16s %12s %14s %12s %10s\n", "through", "M pairs/s", "ns/pair/thread", "added ns", "vs bare");
  streamalloc::pool pool(bench::kept());
  std::vector<streamalloc::stream> streams;
  for (int i = 0; i < threads; ++i) streams.emplace_back(0);
  const auto window = std::chrono::milliseconds(quick ? 10 : 50);
  const auto on_device = [](int) { BENCH_CHECK(cudaSetDevice(0)); };
  double bare_per_thread = 0, bare_rate = 0;
  for (const setting& set : settings) {
    std::vector<double> rates, slowest;
    for (int r = 0; r < 5; ++r) {
      with_resource(set, pool, [&](auto& mr) {
        const bench::thread_rate o = bench::run_threads(threads, cores, window, on_device, [&](int t) {
          mr.deallocate_async(mr.allocate_async(4 * KiB, 256, streams[t]), 4 * KiB, 256, streams[t]);
        });
        rates.push_back(o.total);
        slowest.push_back(o.slowest_share);
      });
      if (set.where == sink::file) std::filesystem::remove(log_path(set));
    }
    const double rate = bench::median(rates);
    const double per_thread = 1e3 * threads / rate;  // ns a thread waits for one pair
    if (set.where == sink::none) bare_per_thread = per_thread, bare_rate = rate;
    std::printf("%16s %12.2f %14.1f %12.1f %9.2fx\n", set.name, rate, per_thread, per_thread - bare_per_thread,
                bare_rate / rate);
    rows.add("threads_" + std::to_string(threads) + "_" + set.name,
             "\"mpairs_per_s\": " + std::to_string(rate) + ", \"ns_per_pair_per_thread\": " + std::to_string(per_thread) +
                 ", \"slowest_share\": " + std::to_string(bench::median(slowest)));
  }
  for (auto& s : streams) s.synchronize();
}

}  // namespace

int main(int argc, char** argv) {
  bench::require_gpu("bench_logging_resource");
  std::string json;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (!std::strcmp(argv[i], "--dir") && i + 1 < argc) dir = argv[++i];
    else {
      std::fprintf(stderr, "usage: bench_logging_resource [--quick] [--json FILE] [--dir DIR]\n");
      return 2;
    }
  }
  BENCH_CHECK(cudaSetDevice(0));
  BENCH_CHECK(cudaFree(nullptr));
  const bench::gpu_info gpu = bench::describe_gpu();
  std::printf("logs written to %s\n", dir.c_str());
  one_thread();
  std::printf("\n2. threads at once");
  for (int threads : {2, 8}) threads_at_once(threads);
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"bench\": \"logging_resource\",\n  \"gpu\": \"" << bench::json_escape(gpu.name)
        << "\",\n  \"driver\": " << gpu.driver << ",\n  \"runtime\": " << gpu.runtime
        << ",\n  \"quick\": " << (quick ? "true" : "false") << ",\n  \"rows\": [\n"
        << rows.str() << "\n  ]\n}\n";
    std::printf("\nwrote %s\n", json.c_str());
  }
  return 0;
}
