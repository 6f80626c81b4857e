// logging_resource on a real GPU: memory allocated through it on streams is written and read by
// kernels (and by host code over a host pool), through the resource itself and through CCCL's
// type-erased reference, from one thread and from several; the log holds exactly one line per
// call, each field what was done. The CPU test (tests/cpu/logging_resource_test.cpp) parses the
// formats in full; here each line is compared as text, all but its time and thread number.

#include <streamalloc/device_arena.hpp>
#include <streamalloc/logging_resource.hpp>
#include <streamalloc/resource.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <doctest/doctest.h>

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <cuda/memory_resource>
#include <cuda_runtime.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace streamalloc;
using namespace streamalloc_test;

// Every GPU test file is one translation unit with the others: names here are this file's own.
namespace logging_resource_gpu_test {

std::string hex(const void* p) {
  char b[32];
  std::snprintf(b, sizeof b, "0x%jx", static_cast<std::uintmax_t>(reinterpret_cast<std::uintptr_t>(p)));
  return b;
}

/// A line as the resource writes it, after its thread number: what the test did.
std::string fields(log_format f, const char* op, const void* p, std::size_t bytes, std::size_t alignment,
                   std::optional<cudaStream_t> s) {
  const std::string n = std::to_string(bytes), a = std::to_string(alignment);
  if (f == log_format::csv) {
    return std::string(op) + "," + hex(p) + "," + n + "," + a + "," + (s ? hex(*s) : "") + ",ok,,";
  }
  return std::string("\"operation\":\"") + op + "\",\"pointer\":\"" + hex(p) + "\",\"bytes\":" + n +
         ",\"alignment\":" + a + ",\"stream\":" + (s ? "\"" + hex(*s) + "\"" : std::string("null")) +
         ",\"outcome\":\"ok\"}";
}

/// `s` as the inside of a JSON string.
std::string json_text(const std::string& s) {
  std::string o;
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (c == '\n') {
      o += "\\n";
    } else if (c == '\r') {
      o += "\\r";
    } else if (c == '\t') {
      o += "\\t";
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char u[8];
      std::snprintf(u, sizeof u, "\\u%04x", static_cast<unsigned>(c));
      o += u;
    } else {
      o += c;
    }
  }
  return o;
}

struct split_line {
  unsigned long long time_ns = 0;
  unsigned thread = 0;
  std::string rest;  // what `fields` gives
};

/// The time, the thread and the rest of each line of a log; fails the test on a malformed line.
std::vector<split_line> split(const std::string& log, log_format f) {
  std::vector<split_line> out;
  std::istringstream in(log);
  std::string row;
  bool first = true;
  while (std::getline(in, row)) {
    if (f == log_format::csv && first) {
      CHECK(row == "time_ns,thread,operation,pointer,bytes,alignment,stream,outcome,exception,message");
      first = false;
      continue;
    }
    split_line l;
    int used = 0;
    const int got = f == log_format::csv ? std::sscanf(row.c_str(), "%llu,%u,%n", &l.time_ns, &l.thread, &used)
                                         : std::sscanf(row.c_str(), "{\"time_ns\":%llu,\"thread\":%u,%n", &l.time_ns,
                                                       &l.thread, &used);
    REQUIRE_MESSAGE((got == 2 && used > 0), "a malformed line: " << row);
    l.rest = row.substr(static_cast<std::size_t>(used));
    out.push_back(std::move(l));
  }
  return out;
}

struct temp_log {
  temp_log() {
    path = std::filesystem::temp_directory_path() / ("streamalloc_logging_gpu_" + std::to_string(::getpid()) + ".csv");
  }
  ~temp_log() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
  temp_log(const temp_log&) = delete;
  temp_log& operator=(const temp_log&) = delete;
  [[nodiscard]] std::string read() const {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::filesystem::path path;
};

/// Each thread takes 64 bytes from the arena and writes its index there; a refusal counts.
__global__ void arena_fill_kernel(device_arena_view arena, unsigned* refused) {
  const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  auto* p = static_cast<unsigned*>(arena.allocate(64, 16));
  if (p == nullptr) {
    atomicAdd(refused, 1u);
    return;
  }
  for (int k = 0; k < 16; ++k) p[k] = i;
}

}  // namespace logging_resource_gpu_test

TEST_CASE("logging_resource: kernels use memory allocated through it on two streams; the log says what was done") {
  using namespace logging_resource_gpu_test;
  for (const log_format f : {log_format::csv, log_format::json_lines}) {
    CAPTURE(static_cast<int>(f));
    pool p;
    stream a(0), b(0);
    std::ostringstream out;
    std::vector<std::string> did;
    {
      logging_resource mr(device_resource(p), out, f);
      static_assert(device_memory_resource<decltype(mr)>);
      std::uint32_t seed = 7;
      // Sizes from a word to a chunk of its own, alignments to 64 KiB, on alternating streams;
      // each buffer filled by a kernel on its stream and checked there, all live at once.
      struct held {
        void* p;
        std::size_t bytes, alignment;
        stream* s;
        std::uint32_t seed;
      };
      std::vector<held> live;
      const std::size_t sizes[] = {4, 4096, 1 * MiB + 100, 96 * MiB};
      const std::size_t aligns[] = {256, 4096, 65536, 256};
      for (int i = 0; i < 4; ++i) {
        stream& s = i % 2 == 0 ? a : b;
        void* q = mr.allocate_async(sizes[i], aligns[i], s);
        REQUIRE(q != nullptr);
        CHECK(reinterpret_cast<std::uintptr_t>(q) % aligns[i] == 0);
        did.push_back(fields(f, "allocate_async", q, sizes[i], aligns[i], s.get()));
        fill_async(q, sizes[i], seed, s.get());
        live.push_back({q, sizes[i], aligns[i], &s, seed++});
      }
      for (const auto& h : live) CHECK(mismatches_on(h.p, h.bytes, h.seed, h.s->get()) == 0);
      // Freed on their streams, then reused at once on the same stream: fresh contents checked.
      for (const auto& h : live) {
        mr.deallocate_async(h.p, h.bytes, h.alignment, *h.s);
        did.push_back(fields(f, "free_async", h.p, h.bytes, h.alignment, h.s->get()));
      }
      for (const auto& h : live) {
        void* q = mr.allocate_async(h.bytes, h.alignment, *h.s);
        did.push_back(fields(f, "allocate_async", q, h.bytes, h.alignment, h.s->get()));
        fill_async(q, h.bytes, seed, h.s->get());
        CHECK(mismatches_on(q, h.bytes, seed, h.s->get()) == 0);
        ++seed;
        mr.deallocate_async(q, h.bytes, h.alignment, *h.s);
        did.push_back(fields(f, "free_async", q, h.bytes, h.alignment, h.s->get()));
      }
      // Through CCCL's type-erased reference, with cuda::stream_ref.
      ::cuda::mr::async_resource_ref<::cuda::mr::device_accessible> ref(mr);
      void* r = ref.allocate_async(8 * MiB, 256, ::cuda::stream_ref(b.get()));
      did.push_back(fields(f, "allocate_async", r, 8 * MiB, 256, b.get()));
      fill_async(r, 8 * MiB, 99, b.get());
      CHECK(mismatches_on(r, 8 * MiB, 99, b.get()) == 0);
      ref.deallocate_async(r, 8 * MiB, 256, ::cuda::stream_ref(b.get()));
      did.push_back(fields(f, "free_async", r, 8 * MiB, 256, b.get()));
      // Synchronous: usable by every stream at once.
      void* y = mr.allocate(2 * MiB, 512);
      did.push_back(fields(f, "allocate", y, 2 * MiB, 512, std::nullopt));
      fill_async(y, 2 * MiB, 5, a.get());
      CHECK(mismatches_on(y, 2 * MiB, 5, a.get()) == 0);
      SA_CUDA_REQUIRE(cudaStreamSynchronize(a.get()));
      mr.deallocate(y, 2 * MiB, 512);
      did.push_back(fields(f, "free", y, 2 * MiB, 512, std::nullopt));
      SA_CUDA_REQUIRE(cudaGetLastError());
    }
    (void)a.synchronize();
    (void)b.synchronize();
    CHECK(p.statistics().live_allocations == 0);
    const auto got = split(out.str(), f);
    REQUIRE(got.size() == did.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      CAPTURE(i);
      CHECK(got[i].rest == did[i]);
      CHECK(got[i].thread == got[0].thread);
      if (i > 0) CHECK(got[i].time_ns >= got[i - 1].time_ns);
    }
  }
}

TEST_CASE("logging_resource over a host pool: host code and kernels use the memory; failures logged and rethrown") {
  using namespace logging_resource_gpu_test;
  pool hp(pool_properties{.location = memory_location::host_numa(0), .max_size = 64 * MiB});
  stream s(0);
  std::ostringstream out;
  std::string said;
  void* q = nullptr;
  {
    logging_resource mr(host_device_resource(hp), out, log_format::json_lines);
    static_assert(device_memory_resource<decltype(mr)> && host_memory_resource<decltype(mr)>);
    q = mr.allocate_async(1 * MiB, 256, s);
    fill_async(q, 1 * MiB, 11, s.get());
    SA_CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
    auto* w = static_cast<std::uint32_t*>(q);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < MiB / 4; ++i) wrong += w[i] != pattern(i, 11) ? 1 : 0;
    CHECK(wrong == 0);
    for (std::size_t i = 0; i < MiB / 4; ++i) w[i] = pattern(i, 12);
    CHECK(mismatches_on(q, 1 * MiB, 12, s.get()) == 0);
    try {
      (void)mr.allocate_async(128 * MiB, 256, s);
      FAIL("no exception");
    } catch (const out_of_memory& e) {
      said = e.what();
    }
    mr.deallocate_async(q, 1 * MiB, 256, s);
  }
  (void)s.synchronize();
  const auto got = split(out.str(), log_format::json_lines);
  REQUIRE(got.size() == 3);
  CHECK(got[0].rest == fields(log_format::json_lines, "allocate_async", q, 1 * MiB, 256, s.get()));
  REQUIRE(!said.empty());
  CHECK(got[1].rest == "\"operation\":\"allocate_async\",\"pointer\":null,\"bytes\":134217728,\"alignment\":256,"
                       "\"stream\":\"" + hex(s.get()) + "\",\"outcome\":\"failed\",\"exception\":\"streamalloc::out_of_memory\","
                       "\"message\":\"" + json_text(said) + "\"}");
  CHECK(got[2].rest == fields(log_format::json_lines, "free_async", q, 1 * MiB, 256, s.get()));
  CHECK(hp.statistics().live_allocations == 0);
}

TEST_CASE("logging_resource from four threads on their own streams: one line per call, none lost or torn") {
  using namespace logging_resource_gpu_test;
  constexpr int threads = 4, rounds = 200;
  pool p;
  temp_log file;
  std::vector<std::vector<std::string>> did(threads);
  std::vector<unsigned long long> wrong(threads, 0);
  {
    logging_resource mr(device_resource(p), file.path, logging_options{.format = log_format::csv, .buffer_bytes = 1024});
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&, t] {
        if (cudaSetDevice(0) != cudaSuccess) ++wrong[t];  // no doctest assertion off the main thread
        stream s(0);
        for (int i = 0; i < rounds; ++i) {
          const std::size_t bytes = 4096 * static_cast<std::size_t>(1 + (i * 7 + t) % 32);
          void* q = mr.allocate_async(bytes, 256, s);
          did[t].push_back(fields(log_format::csv, "allocate_async", q, bytes, 256, s.get()));
          const auto seed = static_cast<std::uint32_t>(t * 1000 + i);
          fill_async(q, bytes, seed, s.get());
          if (i % 20 == 0) wrong[t] += mismatches_on(q, bytes, seed, s.get());
          mr.deallocate_async(q, bytes, 256, s);
          did[t].push_back(fields(log_format::csv, "free_async", q, bytes, 256, s.get()));
        }
        (void)s.synchronize();
      });
    }
    for (auto& w : workers) w.join();
    mr.flush();
    CHECK(mr.good());
  }
  for (int t = 0; t < threads; ++t) CHECK(wrong[t] == 0);
  const auto got = split(file.read(), log_format::csv);
  REQUIRE(got.size() == static_cast<std::size_t>(threads * rounds * 2));
  // Each thread's lines, in the file's order, are its calls in its order.
  std::map<unsigned, std::vector<std::string>> by_thread;
  for (const auto& l : got) by_thread[l.thread].push_back(l.rest);
  REQUIRE(by_thread.size() == static_cast<std::size_t>(threads));
  for (const auto& [id, lines] : by_thread) {
    const auto it = std::find_if(did.begin(), did.end(), [&](const auto& d) { return d.front() == lines.front(); });
    REQUIRE(it != did.end());
    CHECK(lines == *it);
  }
  // Each thread's times never decrease (across threads they may, by a few ns: a time is read
  // before its line takes its place in the log).
  std::map<unsigned, unsigned long long> last_time;
  for (const auto& l : got) {
    CHECK(l.time_ns >= last_time[l.thread]);
    last_time[l.thread] = l.time_ns;
  }
  CHECK(p.statistics().live_allocations == 0);
}

TEST_CASE("logging_resource's log also holds what stream_buffer, device_arena and pmr_resource take from its pool") {
  using namespace logging_resource_gpu_test;
  pool p;
  pool hp(pool_properties{.location = memory_location::host_numa(0)});
  stream s(0);
  std::ostringstream out;
  std::vector<std::string> did;
  const log_format f = log_format::csv;
  {
    logging_resource mr(device_resource(p), out, f);
    logging_resource host_mr(host_resource(hp), mr);  // the same log
    {
      // A buffer filled by a kernel, grown (in place, or moved and copied on its stream: the
      // log says which), its contents checked after the growth.
      stream_buffer<std::uint32_t> b(256 * 1024, s, mr);
      did.push_back(fields(f, "allocate_async", b.data(), MiB, 256, s.get()));
      fill_async(b.data(), MiB, 21, s.get());
      // A neighbour right behind it, so that the growth cannot happen in place.
      stream_buffer<std::uint32_t> behind(256 * 1024, s, mr);
      did.push_back(fields(f, "allocate_async", behind.data(), MiB, 256, s.get()));
      const void* before = b.data();
      const growth g = b.reserve(16 * 256 * 1024);
      if (g == growth::in_place) {
        CHECK(b.data() == before);
        did.push_back(fields(f, "resize_async", b.data(), b.capacity() * 4, 256, s.get()));
      } else {
        REQUIRE(g == growth::moved);
        CHECK(b.data() != before);
        did.push_back(fields(f, "allocate_async", b.data(), 16 * MiB, 256, s.get()));
        did.push_back(fields(f, "free_async", before, MiB, 256, s.get()));
      }
      CHECK(mismatches_on(b.data(), MiB, 21, s.get()) == 0);
      did.push_back(fields(f, "free_async", behind.data(), MiB, 256, s.get()));  // destroyed first
      did.push_back(fields(f, "free_async", b.data(), b.capacity() * 4, 256, s.get()));
    }
    {
      // An arena: its memory is one line when taken and one when freed; kernels allocate from it.
      device_arena arena(1 * MiB, s, mr);
      stream_buffer<unsigned> refused(1, s, p);  // from the pool itself: not logged
      SA_CUDA_REQUIRE(cudaMemsetAsync(refused.data(), 0, sizeof(unsigned), s.get()));
      arena_fill_kernel<<<64, 256, 0, s.get()>>>(arena.view(), refused.data());
      SA_CUDA_REQUIRE(cudaGetLastError());
      const device_arena_usage u = arena.usage();
      CHECK(u.used >= 64 * 256 * 64);
      CHECK(u.failures == 0);
      unsigned host_refused = 1;
      SA_CUDA_REQUIRE(cudaMemcpyAsync(&host_refused, refused.data(), sizeof host_refused, cudaMemcpyDeviceToHost, s.get()));
      SA_CUDA_REQUIRE(cudaStreamSynchronize(s.get()));
      CHECK(host_refused == 0);
      // The arena's memory starts with its counters; the line names the whole allocation.
      const auto found = p.find_allocation(arena.view().base());
      REQUIRE(found.has_value());
      const std::size_t taken = detail::arena_header_bytes + 1 * MiB;
      CHECK(found->second >= taken);
      did.push_back(fields(f, "allocate_async", found->first, taken, 256, s.get()));
      did.push_back(fields(f, "free_async", found->first, taken, 256, s.get()));
    }
    {
      // A std::pmr vector over the host pool, through the same log: host code fills and reads it.
      pmr_resource pmr(host_mr);
      std::pmr::vector<std::uint64_t> v(&pmr);
      v.reserve(1000);
      did.push_back(fields(f, "allocate", v.data(), 8000, alignof(std::uint64_t), std::nullopt));
      for (std::uint64_t i = 0; i < 1000; ++i) v.push_back(i * i);
      std::uint64_t wrong = 0;
      for (std::uint64_t i = 0; i < 1000; ++i) wrong += v[i] != i * i ? 1 : 0;
      CHECK(wrong == 0);
      did.push_back(fields(f, "free", v.data(), 8000, alignof(std::uint64_t), std::nullopt));
    }
  }
  (void)s.synchronize();
  CHECK(p.statistics().live_allocations == 0);
  CHECK(hp.statistics().live_allocations == 0);
  const auto got = split(out.str(), f);
  REQUIRE(got.size() == did.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK(got[i].rest == did[i]);
  }
}
