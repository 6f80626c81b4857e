// logging_resource against the fake driver, what its log says: every call is one line whose fields
// (parsed back from CSV and from JSON lines) are what was done; failures are logged and rethrown
// unchanged; a log file; bad options. Threads and the rest: logging_resource_threads_test.cpp.

#include <streamalloc/logging_resource.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/resource.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "logging_resource_support.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace logging_resource_test {

// One of each call the resource has, on two streams, sizes and alignments varied; returns what
// was done. Leaves nothing allocated.
template <class R>
std::vector<expected> each_call(R& mr, stream& a, stream& b) {
  std::vector<expected> did;
  const auto ha = handle_of(a.get()), hb = handle_of(b.get());
  void* p1 = mr.allocate(1000);
  did.push_back({"allocate", address(p1), 1000, 256, std::nullopt});
  void* p2 = mr.allocate(5000, 4096);
  CHECK(address(p2) % 4096 == 0);
  did.push_back({"allocate", address(p2), 5000, 4096, std::nullopt});
  void* p3 = mr.allocate_async(300, 512, ::cuda::stream_ref(a.get()));
  did.push_back({"allocate_async", address(p3), 300, 512, ha});
  void* p4 = mr.allocate_async(4096, stream_ref(b));
  did.push_back({"allocate_async", address(p4), 4096, 256, hb});
  void* p5 = mr.allocate_async(3 * MiB, 65536, a);
  CHECK(address(p5) % 65536 == 0);
  did.push_back({"allocate_async", address(p5), 3 * MiB, 65536, ha});
  void* p0 = mr.allocate_async(0, 256, a);  // the pool gives nullptr for 0 bytes
  CHECK(p0 == nullptr);
  did.push_back({"allocate_async", 0, 0, 256, ha});
  mr.deallocate_async(p3, 300, 512, ::cuda::stream_ref(a.get()));
  did.push_back({"free_async", address(p3), 300, 512, ha});
  mr.deallocate_async(p4, 4096, stream_ref(b));
  did.push_back({"free_async", address(p4), 4096, 256, hb});
  mr.deallocate_async(p5, 3 * MiB, 65536, a);
  did.push_back({"free_async", address(p5), 3 * MiB, 65536, ha});
  mr.deallocate(p2, 5000, 4096);
  did.push_back({"free", address(p2), 5000, 4096, std::nullopt});
  mr.deallocate(p1, 1000);
  did.push_back({"free", address(p1), 1000, 256, std::nullopt});
  mr.deallocate_async(p0, 0, 256, a);
  did.push_back({"free_async", 0, 0, 256, ha});
  return did;
}

// --- resources for the generic parts ------------------------------------------------------------

/// What throwing_resource throws: a type of the test's own, with a payload that must survive.
struct upstream_failure : std::runtime_error {
  upstream_failure(const std::string& what, int code) : std::runtime_error(what), code(code) {}
  int code;
};

/// A stream-ordered resource that fails as told: for failures no pool gives.
struct throwing_resource {
  enum mode { std_exception, custom, not_an_exception, long_message } what = custom;
  std::string message;
  [[noreturn]] void fail() const {
    switch (what) {
      case std_exception: throw std::length_error(message);
      case custom: throw upstream_failure(message, 42);
      case not_an_exception: throw 7;
      case long_message: throw std::runtime_error(message);
    }
    throw 0;
  }
  void* allocate(std::size_t, std::size_t) { fail(); }
  void deallocate(void*, std::size_t, std::size_t) noexcept {}
  void* allocate_async(std::size_t, std::size_t, ::cuda::stream_ref) { fail(); }
  void deallocate_async(void*, std::size_t, std::size_t, ::cuda::stream_ref) noexcept {}
  friend bool operator==(const throwing_resource&, const throwing_resource&) { return true; }
  friend void get_property(const throwing_resource&, device_accessible) noexcept {}
};

// The wrapper models what its upstream models, and claims what it claims.
static_assert(::cuda::mr::async_resource_with<logging_resource<device_resource>, device_accessible>);
static_assert(!::cuda::mr::resource_with<logging_resource<device_resource>, host_accessible>);
static_assert(::cuda::mr::async_resource_with<logging_resource<host_device_resource>, host_accessible, device_accessible>);
static_assert(device_memory_resource<logging_resource<device_resource>>);
static_assert(!device_memory_resource<logging_resource<host_resource>>);
static_assert(host_memory_resource<logging_resource<host_resource>>);
static_assert(logging_resource<device_resource>::is_device_accessible && !logging_resource<device_resource>::is_host_accessible);
static_assert(::cuda::mr::resource_with<logging_resource<host_only_resource>, host_accessible>);
static_assert(!::cuda::mr::async_resource<logging_resource<host_only_resource>>);
static_assert(::cuda::has_property_with<logging_resource<host_only_resource>, numa_node_property, int>);
static_assert(::cuda::mr::async_resource_with<logging_resource<throwing_resource>, device_accessible>);
static_assert(::cuda::mr::async_resource_with<logging_resource<device_ref>, device_accessible>);
static_assert(::cuda::mr::async_resource_with<logging_resource<logging_resource<device_resource>>, device_accessible>);
// Move-only; moves do not throw over a pool_resource.
static_assert(!std::is_copy_constructible_v<logging_resource<device_resource>>);
static_assert(!std::is_copy_assignable_v<logging_resource<device_resource>>);
static_assert(std::is_nothrow_move_constructible_v<logging_resource<device_resource>>);
static_assert(std::is_nothrow_move_assignable_v<logging_resource<device_resource>>);
// Frees never throw over a resource whose frees never throw.
static_assert(noexcept(std::declval<logging_resource<device_resource>&>().deallocate(nullptr, 1, 256)));
static_assert(noexcept(std::declval<logging_resource<device_resource>&>().deallocate_async(
    nullptr, 1, 256, std::declval<::cuda::stream_ref>())));

}  // namespace logging_resource_test

TEST_SUITE("logging_resource") {
  using namespace logging_resource_test;

  TEST_CASE_TEMPLATE_DEFINE("every call is one line whose fields are what was done", F, logging_each_call) {
    constexpr log_format format = F::value;
    pool p;
    stream a(0), b(0);
    std::ostringstream out;
    const auto made = std::chrono::steady_clock::now();
    std::vector<expected> did;
    {
      logging_resource mr(device_resource(p), out, format);
      CHECK(mr.format() == format);
      did = each_call(mr, a, b);
      CHECK(p.statistics().live_allocations == 0);  // every call reached the pool
      // Lines (and the CSV header) wait in memory until the buffer fills, flush() or the end.
      CHECK(out.str().empty());
      mr.flush();
      check_lines(parse(out.str(), format), did, ns_since(made));
      void* q = mr.allocate_async(256, a);
      did.push_back({"allocate_async", address(q), 256, 256, handle_of(a.get())});
      mr.deallocate_async(q, 256, a);
      did.push_back({"free_async", address(q), 256, 256, handle_of(a.get())});
    }  // the destructor writes the rest
    check_lines(parse(out.str(), format), did, ns_since(made));
  }
  TEST_CASE_TEMPLATE_INVOKE(logging_each_call, csv_format, json_format);

  TEST_CASE("the exact text of each format") {
    pool p;
    stream s(0);
    for (const log_format f : {log_format::csv, log_format::json_lines}) {
      CAPTURE(static_cast<int>(f));
      std::ostringstream out;
      void* q = nullptr;
      {
        logging_resource mr(device_resource(p), out, f);
        q = mr.allocate_async(4096, 256, s);
        mr.deallocate(q, 4096);
      }
      char ptr[40], str[40];
      std::snprintf(ptr, sizeof ptr, "0x%jx", static_cast<std::uintmax_t>(address(q)));
      std::snprintf(str, sizeof str, "0x%jx", static_cast<std::uintmax_t>(handle_of(s.get())));
      const auto got = parse(out.str(), f);
      REQUIRE(got.size() == 2);
      const std::string thread = std::to_string(got[0].thread), t0 = std::to_string(got[0].time_ns),
                        t1 = std::to_string(got[1].time_ns);
      const auto rows = lines_of(out.str());
      if (f == log_format::csv) {
        REQUIRE(rows.size() == 3);
        CHECK(rows[1] == t0 + "," + thread + ",allocate_async," + ptr + ",4096,256," + str + ",ok,,");
        CHECK(rows[2] == t1 + "," + thread + ",free," + ptr + ",4096,256,,ok,,");
      } else {
        REQUIRE(rows.size() == 2);
        CHECK(rows[0] == "{\"time_ns\":" + t0 + ",\"thread\":" + thread + ",\"operation\":\"allocate_async\",\"pointer\":\"" +
                             ptr + "\",\"bytes\":4096,\"alignment\":256,\"stream\":\"" + str + "\",\"outcome\":\"ok\"}");
        CHECK(rows[1] == "{\"time_ns\":" + t1 + ",\"thread\":" + thread + ",\"operation\":\"free\",\"pointer\":\"" + ptr +
                             "\",\"bytes\":4096,\"alignment\":256,\"stream\":null,\"outcome\":\"ok\"}");
      }
    }
  }

  TEST_CASE_TEMPLATE_DEFINE("a failed allocation is logged with its exception and rethrown unchanged", F,
                            logging_failures) {
    constexpr log_format format = F::value;
    pool p(pool_properties{.max_size = 2 * MiB});
    stream s(0);
    const auto hs = handle_of(s.get());
    std::ostringstream out;
    std::vector<expected> did;
    const auto made = std::chrono::steady_clock::now();
    {
      logging_resource mr(device_resource(p), out, format);
      // The pool's out_of_memory, stream-ordered and synchronous.
      std::string said;
      try {
        (void)mr.allocate_async(4 * MiB, 256, s);
        FAIL("no exception");
      } catch (const out_of_memory& e) {
        said = e.what();
        CHECK(e.requested() == 4 * MiB);  // the pool's own exception object, not a copy by slicing
      }
      // CSV turns the control characters of a message into spaces; JSON keeps them.
      auto in_log = [&](std::string m) {
        if (format == log_format::csv) std::replace_if(m.begin(), m.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20; }, ' ');
        return m;
      };
      did.push_back({"allocate_async", std::nullopt, 4 * MiB, 256, hs, "failed", "streamalloc::out_of_memory", in_log(said)});
      try {
        (void)mr.allocate(3 * MiB, 512);
        FAIL("no exception");
      } catch (const out_of_memory& e) {
        said = e.what();
      }
      did.push_back({"allocate", std::nullopt, 3 * MiB, 512, std::nullopt, "failed", "streamalloc::out_of_memory", in_log(said)});
      // A bad alignment, refused by pool_resource with std::invalid_argument.
      try {
        (void)mr.allocate_async(1024, 3, s);
        FAIL("no exception");
      } catch (const std::invalid_argument& e) {
        said = e.what();
      }
      CHECK(said.find("alignment 3 is not a power of two") != std::string::npos);
      did.push_back({"allocate_async", std::nullopt, 1024, 3, hs, "failed", "std::invalid_argument", in_log(said)});
      // After failures it goes on as before.
      void* q = mr.allocate_async(1 * MiB, 256, s);
      did.push_back({"allocate_async", address(q), 1 * MiB, 256, hs});
      mr.deallocate_async(q, 1 * MiB, 256, s);
      did.push_back({"free_async", address(q), 1 * MiB, 256, hs});
    }
    check_lines(parse(out.str(), format), did, ns_since(made));
    CHECK(p.statistics().live_allocations == 0);
  }
  TEST_CASE_TEMPLATE_INVOKE(logging_failures, csv_format, json_format);

  TEST_CASE_TEMPLATE_DEFINE("any exception: its type, its payload, a message that needs escaping or is too long", F,
                            logging_any_exception) {
    constexpr log_format format = F::value;
    stream s(0);
    const auto hs = handle_of(s.get());
    std::ostringstream out;
    {
      throwing_resource up;
      // Commas, quotes, a backslash, a newline, a tab and UTF-8: each format must keep the line whole.
      up.message = "bad, \"really\" bad\\\nsecond line\tend \xC3\xA9t\xC3\xA9";
      logging_resource mr(up, out, format);
      try {
        (void)mr.allocate_async(64, 256, ::cuda::stream_ref(s.get()));
        FAIL("no exception");
      } catch (const upstream_failure& e) {
        CHECK(e.code == 42);
        CHECK(std::string(e.what()) == up.message);
      }
    }
    {
      throwing_resource up;
      up.what = throwing_resource::not_an_exception;
      logging_resource mr(up, out, format);
      CHECK_THROWS_AS((void)mr.allocate(64, 256), int);
    }
    {
      throwing_resource up;
      up.what = throwing_resource::long_message;
      // Cut inside the two-byte characters at the end, wherever the line's other fields end.
      up.message = std::string(3000, 'x') + std::string(200, '"');
      for (int i = 0; i < 1000; ++i) up.message += "\xC3\xA9";
      logging_resource mr(up, out, format);
      CHECK_THROWS_WITH_AS((void)mr.allocate_async(64, 256, stream_ref(s)), up.message.c_str(), std::runtime_error);
    }
    // Three resources wrote one after the other into one stream: split it where each began.
    std::string text = out.str();
    if (format == log_format::csv) {
      // Each CSV log starts with its header: keep the first, drop the others.
      const std::string header = std::string(csv_header) + "\n";
      for (auto at = text.find(header, 1); at != std::string::npos; at = text.find(header, 1)) text.erase(at, header.size());
    }
    const auto got = parse(text, format);
    REQUIRE(got.size() == 3);
    CHECK(got[0].operation == "allocate_async");
    CHECK(got[0].stream == hs);
    CHECK_FALSE(got[0].pointer.has_value());
    CHECK(got[0].outcome == "failed");
    CHECK(got[0].exception == "logging_resource_test::upstream_failure");
    CHECK(got[0].message == (format == log_format::csv ? "bad, \"really\" bad\\ second line end \xC3\xA9t\xC3\xA9"
                                                       : "bad, \"really\" bad\\\nsecond line\tend \xC3\xA9t\xC3\xA9"));
    CHECK(got[1].operation == "allocate");
    CHECK_FALSE(got[1].stream.has_value());
    CHECK(got[1].exception == "int");
    CHECK(got[1].message.empty());
    CHECK(got[2].exception == "std::runtime_error");
    // Cut to fit a line of 4 KiB, ending in "...", never inside a character: the 'x's and quotes
    // whole, then as many whole characters as fit.
    const std::string& cut = got[2].message;
    REQUIRE(cut.size() > 3200 + 3);
    CHECK(cut.substr(0, 3200) == std::string(3000, 'x') + std::string(200, '"'));
    CHECK(cut.substr(cut.size() - 3) == "...");
    const std::string tail = cut.substr(3200, cut.size() - 3200 - 3);
    CHECK(tail.size() % 2 == 0);
    CHECK(tail.size() > 100);
    for (std::size_t i = 0; i + 1 < tail.size(); i += 2) CHECK(tail.substr(i, 2) == "\xC3\xA9");
    for (const auto& row : lines_of(text)) CHECK(row.size() < detail::log_sink::max_line);
  }
  TEST_CASE_TEMPLATE_INVOKE(logging_any_exception, csv_format, json_format);


  TEST_CASE("a file: created, truncated, written when the buffer fills, at flush() and at the end") {
    pool p;
    stream s(0);
    temp_file file;
    {
      std::ofstream(file.path) << "what was there before\n";
    }
    std::vector<expected> did;
    const auto made = std::chrono::steady_clock::now();
    {
      logging_resource mr(device_resource(p), file.path, logging_options{.format = log_format::json_lines, .buffer_bytes = 4096});
      CHECK(file.read().empty());  // truncated; JSON lines have no header
      void* q = mr.allocate_async(100, 256, s);
      did.push_back({"allocate_async", address(q), 100, 256, handle_of(s.get())});
      CHECK(file.read().empty());  // waiting in memory
      mr.flush();
      check_lines(parse(file.read(), log_format::json_lines), did, ns_since(made));
      // 4 KiB: a ring of 16 slots, drained every 4 lines into the staging buffer, which is written
      // once 32 KiB wait in it (about 170 lines of JSON).
      for (int i = 0; i < 200; ++i) {
        const auto n = 100 + static_cast<std::size_t>(i);
        mr.deallocate_async(q, n, 256, s);
        did.push_back({"free_async", address(q), n, 256, handle_of(s.get())});
        q = mr.allocate_async(n + 1, 256, s);
        did.push_back({"allocate_async", address(q), n + 1, 256, handle_of(s.get())});
      }
      const std::string text = file.read();
      const auto written = parse(text, log_format::json_lines);  // whole lines only
      CHECK(text.size() >= 32 * 1024);
      CHECK(written.size() > 150);
      CHECK(written.size() < did.size());
      mr.deallocate_async(q, 300, 256, s);
      did.push_back({"free_async", address(q), 300, 256, handle_of(s.get())});
      CHECK(mr.good());
    }
    check_lines(parse(file.read(), log_format::json_lines), did, ns_since(made));
    CHECK(p.statistics().live_allocations == 0);
  }

  TEST_CASE("a file that cannot be opened is named; bad options are refused") {
    pool p;
    const std::string where = "/nonexistent-streamalloc-dir/allocations.csv";
    CHECK_THROWS_WITH_AS(logging_resource(device_resource(p), where),
                         doctest::Contains(("cannot open the log file '" + where + "'").c_str()), std::system_error);
    std::ostringstream out;
    CHECK_THROWS_WITH_AS(logging_resource(device_resource(p), out, logging_options{.buffer_bytes = 0}),
                         doctest::Contains("buffer_bytes 0 is not between 1 and 1 GiB"), std::invalid_argument);
    CHECK_THROWS_AS(logging_resource(device_resource(p), out, logging_options{.buffer_bytes = std::size_t{2} << 30}),
                    std::invalid_argument);
    CHECK_THROWS_AS(logging_resource(device_resource(p), out, logging_options{.format = static_cast<log_format>(7)}),
                    std::invalid_argument);
    CHECK(out.str().empty());
  }
}
