// logging_resource against the fake driver: every call through it is one line of the log, whose
// fields (parsed back from CSV and from JSON lines) are compared with what was done; failures are
// logged and rethrown unchanged; threads' lines never tear and keep each thread's order; an
// address is never allocated again before its free down the file. The GPU test runs kernels on
// the memory.

#include <streamalloc/logging_resource.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/resource.hpp>
#include <streamalloc/stream.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <memory_resource>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <streambuf>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <vector>

using namespace streamalloc;

// Every name at file scope is in this namespace: the fake-driver tests are one translation unit.
namespace logging_resource_test {

using streamalloc_test::MiB;

// --- what a line says, parsed back ------------------------------------------------------------

struct line {
  std::uint64_t time_ns = 0;
  std::uint32_t thread = 0;
  std::string operation;
  std::optional<std::uintptr_t> pointer;
  std::size_t bytes = 0;
  std::size_t alignment = 0;
  std::optional<std::uintptr_t> stream;
  std::string outcome, exception, message;
};

// What the test did: compared field by field with a parsed line.
struct expected {
  expected() = default;
  expected(std::string op, std::optional<std::uintptr_t> p, std::size_t n, std::size_t a, std::optional<std::uintptr_t> s,
           std::string result = "ok", std::string type = {}, std::string what = {})
      : operation(std::move(op)), pointer(p), bytes(n), alignment(a), stream(s), outcome(std::move(result)),
        exception(std::move(type)), message(std::move(what)) {}
  std::string operation;
  std::optional<std::uintptr_t> pointer;
  std::size_t bytes = 0;
  std::size_t alignment = 0;
  std::optional<std::uintptr_t> stream;
  std::string outcome = "ok", exception, message;
};

std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
std::uintptr_t handle_of(cudaStream_t s) { return reinterpret_cast<std::uintptr_t>(s); }

std::uint64_t to_u64(const std::string& s, int base = 10) {
  REQUIRE_MESSAGE(!s.empty(), "an empty number");
  std::size_t used = 0;
  const auto v = std::stoull(s, &used, base);
  REQUIRE_MESSAGE(used == s.size(), "not a number: " << s);
  return v;
}
std::uintptr_t from_hex(const std::string& s) {
  REQUIRE_MESSAGE(s.rfind("0x", 0) == 0, "a pointer or stream is written 0x...: " << s);
  return static_cast<std::uintptr_t>(to_u64(s.substr(2), 16));
}

// RFC 4180 fields of one line (no newline inside: the resource never writes one in a field).
std::vector<std::string> csv_fields(const std::string& text) {
  std::vector<std::string> out(1);
  bool quoted = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (quoted) {
      if (c == '"' && i + 1 < text.size() && text[i + 1] == '"') {
        out.back() += '"';
        ++i;
      } else if (c == '"') {
        quoted = false;
      } else {
        out.back() += c;
      }
    } else if (c == '"') {
      REQUIRE_MESSAGE(out.back().empty(), "a quote inside an unquoted field: " << text);
      quoted = true;
    } else if (c == ',') {
      out.emplace_back();
    } else {
      out.back() += c;
    }
  }
  REQUIRE_MESSAGE(!quoted, "an unterminated quoted field: " << text);
  return out;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at < text.size()) {
    const auto nl = text.find('\n', at);
    REQUIRE_MESSAGE(nl != std::string::npos, "the log ends inside a line: " << text.substr(at, 200));
    out.push_back(text.substr(at, nl - at));
    at = nl + 1;
  }
  return out;
}

const char* const csv_header = "time_ns,thread,operation,pointer,bytes,alignment,stream,outcome,exception,message";

std::vector<line> parse_csv(const std::string& text) {
  const auto rows = lines_of(text);
  REQUIRE(!rows.empty());
  CHECK(rows[0] == csv_header);
  std::vector<line> out;
  for (std::size_t i = 1; i < rows.size(); ++i) {
    const auto f = csv_fields(rows[i]);
    REQUIRE_MESSAGE(f.size() == 10, "line " << i << " has " << f.size() << " fields: " << rows[i]);
    line l;
    l.time_ns = to_u64(f[0]);
    l.thread = static_cast<std::uint32_t>(to_u64(f[1]));
    l.operation = f[2];
    if (!f[3].empty()) l.pointer = from_hex(f[3]);
    l.bytes = to_u64(f[4]);
    l.alignment = to_u64(f[5]);
    if (!f[6].empty()) l.stream = from_hex(f[6]);
    l.outcome = f[7];
    l.exception = f[8];
    l.message = f[9];
    out.push_back(std::move(l));
  }
  return out;
}

// A flat JSON object of strings, unsigned numbers and nulls: what the resource writes, read
// strictly (anything else fails the test).
struct json_value {
  enum kind { string, number, null } k = null;
  std::string text;
};

std::map<std::string, json_value> json_object(const std::string& text) {
  std::size_t i = 0;
  auto fail = [&](const char* why) { FAIL(why << " at " << i << " in " << text); };
  auto expect = [&](char c) {
    if (i >= text.size() || text[i] != c) fail("unexpected character");
    ++i;
  };
  auto string = [&] {
    expect('"');
    std::string s;
    while (true) {
      if (i >= text.size()) fail("unterminated string");
      const char c = text[i++];
      if (c == '"') break;
      if (static_cast<unsigned char>(c) < 0x20) fail("a raw control character in a string");
      if (c != '\\') {
        s += c;
        continue;
      }
      const char e = text.at(i++);
      switch (e) {
        case '"': s += '"'; break;
        case '\\': s += '\\'; break;
        case '/': s += '/'; break;
        case 'n': s += '\n'; break;
        case 'r': s += '\r'; break;
        case 't': s += '\t'; break;
        case 'b': s += '\b'; break;
        case 'f': s += '\f'; break;
        case 'u': {
          const auto v = to_u64(text.substr(i, 4), 16);
          if (v >= 0x80) fail("\\u escape above ASCII (the resource writes UTF-8 as is)");
          s += static_cast<char>(v);
          i += 4;
          break;
        }
        default: fail("a bad escape");
      }
    }
    return s;
  };
  std::map<std::string, json_value> out;
  expect('{');
  while (true) {
    const std::string key = string();
    expect(':');
    json_value v;
    if (text.compare(i, 4, "null") == 0) {
      i += 4;
    } else if (i < text.size() && text[i] == '"') {
      v = {json_value::string, string()};
    } else {
      const std::size_t start = i;
      while (i < text.size() && text[i] >= '0' && text[i] <= '9') ++i;
      if (i == start) fail("a value that is not a string, an unsigned number or null");
      v = {json_value::number, text.substr(start, i - start)};
    }
    if (!out.emplace(key, v).second) fail("a key twice");
    if (i < text.size() && text[i] == ',') {
      ++i;
      continue;
    }
    expect('}');
    break;
  }
  if (i != text.size()) fail("text after the object");
  return out;
}

std::vector<line> parse_json(const std::string& text) {
  std::vector<line> out;
  for (const auto& row : lines_of(text)) {
    const auto o = json_object(row);
    auto get = [&](const char* key, json_value::kind k, bool nullable = false) -> std::optional<std::string> {
      const auto it = o.find(key);
      REQUIRE_MESSAGE(it != o.end(), "no " << key << " in " << row);
      if (nullable && it->second.k == json_value::null) return std::nullopt;
      REQUIRE_MESSAGE(it->second.k == k, key << " has the wrong type in " << row);
      return it->second.text;
    };
    line l;
    l.time_ns = to_u64(*get("time_ns", json_value::number));
    l.thread = static_cast<std::uint32_t>(to_u64(*get("thread", json_value::number)));
    l.operation = *get("operation", json_value::string);
    if (auto p = get("pointer", json_value::string, true)) l.pointer = from_hex(*p);
    l.bytes = to_u64(*get("bytes", json_value::number));
    l.alignment = to_u64(*get("alignment", json_value::number));
    if (auto s = get("stream", json_value::string, true)) l.stream = from_hex(*s);
    l.outcome = *get("outcome", json_value::string);
    if (l.outcome == "ok") {
      CHECK_MESSAGE(o.size() == 8, "an ok line has 8 keys: " << row);
    } else {
      l.exception = *get("exception", json_value::string);
      l.message = *get("message", json_value::string);
      CHECK_MESSAGE(o.size() == 10, "a failed line has 10 keys: " << row);
    }
    out.push_back(std::move(l));
  }
  return out;
}

std::vector<line> parse(const std::string& text, log_format f) {
  return f == log_format::csv ? parse_csv(text) : parse_json(text);
}

bool same(const line& l, const expected& e) {
  return l.operation == e.operation && l.pointer == e.pointer && l.bytes == e.bytes && l.alignment == e.alignment &&
         l.stream == e.stream && l.outcome == e.outcome && l.exception == e.exception && l.message == e.message;
}

std::string describe(const line& l) {
  std::ostringstream o;
  o << l.operation << " p=" << (l.pointer ? std::to_string(*l.pointer) : "-") << " bytes=" << l.bytes
    << " align=" << l.alignment << " stream=" << (l.stream ? std::to_string(*l.stream) : "-") << " " << l.outcome
    << " [" << l.exception << "] [" << l.message << "]";
  return o.str();
}
std::string describe(const expected& e) {
  line l;
  l.operation = e.operation;
  l.pointer = e.pointer;
  l.bytes = e.bytes;
  l.alignment = e.alignment;
  l.stream = e.stream;
  l.outcome = e.outcome;
  l.exception = e.exception;
  l.message = e.message;
  return describe(l);
}

/// Every line equal, in order, to what was done; one thread; times that never decrease and lie
/// within the resource's life.
void check_lines(const std::vector<line>& got, const std::vector<expected>& want, std::uint64_t lifetime_ns) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(i);
    CHECK_MESSAGE(same(got[i], want[i]), "logged: " << describe(got[i]) << "\n   did: " << describe(want[i]));
    CHECK(got[i].thread == got[0].thread);
    CHECK(got[i].thread >= 1);
    if (i > 0) CHECK(got[i].time_ns >= got[i - 1].time_ns);
    CHECK(got[i].time_ns <= lifetime_ns);
  }
}

std::uint64_t ns_since(std::chrono::steady_clock::time_point t) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t).count());
}

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

/// A property with a value, to see that the wrapper forwards those too.
struct numa_node_property {
  using value_type = int;
};

/// A synchronous-only resource over host memory, with a stateful property.
struct host_only_resource {
  int node = 3;
  void* allocate(std::size_t bytes, std::size_t alignment) { return ::operator new(bytes, std::align_val_t(alignment)); }
  void deallocate(void* p, std::size_t, std::size_t alignment) noexcept { ::operator delete(p, std::align_val_t(alignment)); }
  friend bool operator==(const host_only_resource&, const host_only_resource&) { return true; }
  friend void get_property(const host_only_resource&, host_accessible) noexcept {}
  friend int get_property(const host_only_resource& r, numa_node_property) noexcept { return r.node; }
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
using device_ref = ::cuda::mr::async_resource_ref<device_accessible>;
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

/// A resource whose free hands the address to another thread and returns only once that thread
/// has allocated it again, through the logging resource: what a pool does when another thread
/// reuses a block at once, made certain. The log must still show the free first.
struct handoff_resource {
  struct state {
    std::mutex m;
    std::condition_variable cv;
    void* handed = nullptr;      // freed, not yet taken
    bool reallocated = false;    // the taker's allocation through the logging resource returned
    std::uintptr_t next = 0x10000;
  };
  std::shared_ptr<state> st = std::make_shared<state>();
  void* take_or_new() {
    std::lock_guard lock(st->m);
    if (void* p = std::exchange(st->handed, nullptr)) return p;
    return reinterpret_cast<void*>(st->next += 0x1000);
  }
  void hand_over(void* p) {
    std::unique_lock lock(st->m);
    st->handed = p;
    st->reallocated = false;
    st->cv.notify_all();
    st->cv.wait(lock, [&] { return st->reallocated; });
  }
  void* allocate(std::size_t, std::size_t) { return take_or_new(); }
  void deallocate(void* p, std::size_t, std::size_t) { hand_over(p); }
  void* allocate_async(std::size_t, std::size_t, ::cuda::stream_ref) { return take_or_new(); }
  void deallocate_async(void* p, std::size_t, std::size_t, ::cuda::stream_ref) { hand_over(p); }
  friend bool operator==(const handoff_resource& a, const handoff_resource& b) { return a.st == b.st; }
  friend void get_property(const handoff_resource&, device_accessible) noexcept {}
};

/// A streambuf that refuses every write, as a full disk does.
struct refusing_buffer : std::streambuf {
  int_type overflow(int_type) override { return traits_type::eof(); }
  std::streamsize xsputn(const char*, std::streamsize) override { return 0; }
};

/// A file name of its own under the temporary directory, removed at the end of the scope.
struct temp_file {
  temp_file() {
    static std::atomic<int> n{0};
    path = std::filesystem::temp_directory_path() /
           ("streamalloc_logging_test_" + std::to_string(::getpid()) + "_" + std::to_string(n++) + ".log");
  }
  ~temp_file() {
    std::error_code ec;
    std::filesystem::remove(path, ec);
  }
  temp_file(const temp_file&) = delete;
  temp_file& operator=(const temp_file&) = delete;
  [[nodiscard]] std::string read() const {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::filesystem::path path;
};

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
  using csv_format = std::integral_constant<log_format, log_format::csv>;
  using json_format = std::integral_constant<log_format, log_format::json_lines>;
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

  TEST_CASE_TEMPLATE_DEFINE("threads: exactly the lines expected, none torn, each thread's in its order", F,
                            logging_threads) {
    constexpr log_format format = F::value;
    constexpr int threads = 8;
    constexpr int rounds = 8000;
    pool p;
    std::vector<stream> streams;
    for (int t = 0; t < threads; ++t) streams.emplace_back(0);
    // The smallest ring for CSV (16 slots: threads wait for slots and drain the ring themselves
    // all the time, which is what is under test), the default for JSON.
    temp_file file;
    std::ostringstream out;
    std::vector<std::vector<expected>> did(threads);
    std::vector<std::uint32_t> ids(threads);
    {
      std::optional<logging_resource<device_resource>> mr;
      if (format == log_format::csv) {
        mr.emplace(device_resource(p), file.path, logging_options{.format = format, .buffer_bytes = 512});
      } else {
        mr.emplace(device_resource(p), out, logging_options{.format = format});
      }
      std::atomic<int> ready{0};
      std::vector<std::thread> pool_threads;
      for (int t = 0; t < threads; ++t) {
        pool_threads.emplace_back([&, t] {
          ids[t] = detail::log_thread_id();
          const auto h = handle_of(streams[t].get());
          std::mt19937 rng(static_cast<unsigned>(t) + 1);
          std::vector<std::pair<void*, std::size_t>> live;
          ready.fetch_add(1);
          while (ready.load() < threads) std::this_thread::yield();
          for (int i = 0; i < rounds; ++i) {
            const bool sync = rng() % 8 == 0;
            if (live.size() < 6 && (live.empty() || rng() % 2 == 0)) {
              const std::size_t bytes = 256 * (1 + rng() % 64);
              void* q = sync ? mr->allocate(bytes) : mr->allocate_async(bytes, 256, streams[t]);
              did[t].push_back({sync ? "allocate" : "allocate_async", address(q), bytes, 256,
                                sync ? std::nullopt : std::optional<std::uintptr_t>(h)});
              live.emplace_back(q, bytes);
            } else {
              const std::size_t k = rng() % live.size();
              const auto [q, bytes] = live[k];
              live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
              if (sync) {
                streams[t].synchronize();
                mr->deallocate(q, bytes);
              } else {
                mr->deallocate_async(q, bytes, 256, streams[t]);
              }
              did[t].push_back({sync ? "free" : "free_async", address(q), bytes, 256,
                                sync ? std::nullopt : std::optional<std::uintptr_t>(h)});
            }
          }
          for (const auto& [q, bytes] : live) {
            mr->deallocate_async(q, bytes, 256, streams[t]);
            did[t].push_back({"free_async", address(q), bytes, 256, h});
          }
        });
      }
      for (auto& th : pool_threads) th.join();
      CHECK(mr->good());
    }
    CHECK(p.statistics().live_allocations == 0);
    const auto got = parse(format == log_format::csv ? file.read() : out.str(), format);
    std::size_t total = 0;
    for (const auto& d : did) total += d.size();
    REQUIRE(got.size() == total);
    CHECK(std::set<std::uint32_t>(ids.begin(), ids.end()).size() == threads);
    // Each thread's lines, in file order, are what it did, in its order.
    std::map<std::uint32_t, std::vector<const line*>> by_thread;
    for (const auto& l : got) by_thread[l.thread].push_back(&l);
    REQUIRE(by_thread.size() == threads);
    for (int t = 0; t < threads; ++t) {
      CAPTURE(t);
      const auto& mine = by_thread[ids[t]];
      REQUIRE(mine.size() == did[t].size());
      int wrong = 0;
      for (std::size_t i = 0; i < mine.size(); ++i) {
        if (!same(*mine[i], did[t][i]) && wrong++ < 3) {
          FAIL_CHECK("line " << i << ": logged " << describe(*mine[i]) << ", did " << describe(did[t][i]));
        }
      }
      CHECK(wrong == 0);
    }
    // Each thread's times never decrease (two threads' lines may show theirs a few ns out of
    // order: a time is read before the line takes its place).
    for (const auto& [id, mine] : by_thread) {
      for (std::size_t i = 1; i < mine.size(); ++i) CHECK(mine[i]->time_ns >= mine[i - 1]->time_ns);
    }
    // Down the file an address is never allocated while live: its free comes first, whichever
    // thread freed it and whichever allocated it again.
    std::map<std::uintptr_t, std::uint32_t> live;  // address -> the thread that allocated it
    std::size_t reused_by_another = 0, misordered = 0;
    std::map<std::uintptr_t, std::uint32_t> last_owner;
    for (std::size_t i = 0; i < got.size(); ++i) {
      const auto& l = got[i];
      REQUIRE(l.pointer.has_value());
      if (l.operation.rfind("allocate", 0) == 0) {
        if (!live.emplace(*l.pointer, l.thread).second) ++misordered;
        const auto before = last_owner.find(*l.pointer);
        if (before != last_owner.end() && before->second != l.thread) ++reused_by_another;
        last_owner[*l.pointer] = l.thread;
      } else if (live.erase(*l.pointer) != 1) {
        ++misordered;
      }
    }
    CHECK(misordered == 0);
    CHECK(live.empty());
    // The check above means something only if threads did get each other's addresses.
    CHECK(reused_by_another > 0);
    MESSAGE(got.size() << " lines; " << reused_by_another << " allocations of an address another thread had");
  }
  TEST_CASE_TEMPLATE_INVOKE(logging_threads, csv_format, json_format);

  TEST_CASE("a free is in the log before its address can be allocated again, by any thread") {
    // The upstream's free returns only after another thread got the address again through the
    // logging resource: a free logged after the upstream returned would come after that
    // allocation in the log, every time.
    handoff_resource up;
    std::ostringstream out;
    const stream s(0);
    constexpr int rounds = 50;
    {
      logging_resource mr(up, out, log_format::json_lines);
      std::thread taker([&] {
        for (int i = 0; i < 2 * rounds; ++i) {
          {
            std::unique_lock lock(up.st->m);
            up.st->cv.wait(lock, [&] { return up.st->handed != nullptr; });
          }
          void* q = i % 2 == 0 ? mr.allocate_async(64, 256, s) : mr.allocate(64, 256);
          std::lock_guard lock(up.st->m);
          CHECK(up.st->handed == nullptr);  // it took the handed address
          (void)q;
          up.st->reallocated = true;
          up.st->cv.notify_all();
        }
      });
      for (int i = 0; i < rounds; ++i) {
        void* q = mr.allocate_async(64, 256, s);
        mr.deallocate_async(q, 64, 256, s);  // returns once the taker has q again
        void* r = mr.allocate(64, 256);
        mr.deallocate(r, 64, 256);
      }
      taker.join();
    }
    const auto got = parse_json(out.str());
    REQUIRE(got.size() == 6 * rounds);  // 4 calls a round here, 2 by the taker
    std::set<std::uintptr_t> live;
    std::size_t misordered = 0;
    for (const auto& l : got) {
      const bool allocation = l.operation.rfind("allocate", 0) == 0;
      misordered += allocation ? !live.insert(*l.pointer).second : live.erase(*l.pointer) != 1;
    }
    CHECK(misordered == 0);
    // Every free was of an address that was then allocated again by the other thread.
    std::size_t reallocated_elsewhere = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (got[i].operation.rfind("free", 0) != 0) continue;
      for (std::size_t j = i + 1; j < got.size(); ++j) {
        if (got[j].pointer == got[i].pointer && got[j].operation.rfind("allocate", 0) == 0) {
          reallocated_elsewhere += got[j].thread != got[i].thread;
          break;
        }
      }
    }
    CHECK(reallocated_elsewhere == 2 * rounds);
  }

  TEST_CASE("equal when writing to the same log over equal upstreams; lines of both in one log") {
    pool p, other;
    stream s(0);
    std::ostringstream out, elsewhere;
    logging_resource first(device_resource(p), out);
    logging_resource second(device_resource(p), first);                    // the same log
    logging_resource third(device_resource(p), elsewhere);                 // another log
    logging_resource fourth(device_resource(other), first);                // the same log, another pool
    logging_resource<host_only_resource> host_side(host_only_resource{}, first);  // any upstream type
    CHECK(first == first);
    CHECK(first == second);
    CHECK(first != third);
    CHECK(first != fourth);
    CHECK(second.format() == log_format::csv);
    // Through CCCL's type erasure, the same answers.
    CHECK(device_ref(first) == device_ref(second));
    CHECK(device_ref(first) != device_ref(third));
    // Allocated through one, freed through the other: both in the one log, in order.
    // Addresses are kept as numbers before the frees: a freed pointer's value is not to be used.
    void* q = first.allocate_async(1000, 256, s);
    const std::uintptr_t qa = address(q);
    second.deallocate_async(q, 1000, 256, s);
    void* r = fourth.allocate(2000);
    const std::uintptr_t ra = address(r);
    void* h = host_side.allocate(64, 64);
    const std::uintptr_t ha = address(h);
    host_side.deallocate(h, 64, 64);
    fourth.deallocate(r, 2000);
    first.flush();
    const auto hs = handle_of(s.get());
    check_lines(parse_csv(out.str()), {{"allocate_async", qa, 1000, 256, hs},
                                       {"free_async", qa, 1000, 256, hs},
                                       {"allocate", ra, 2000, 256, std::nullopt},
                                       {"allocate", ha, 64, 64, std::nullopt},
                                       {"free", ha, 64, 64, std::nullopt},
                                       {"free", ra, 2000, 256, std::nullopt}},
                UINT64_MAX);
    CHECK(elsewhere.str().empty());  // third logged nothing
    CHECK(p.statistics().live_allocations == 0);
    CHECK(other.statistics().live_allocations == 0);
  }

  TEST_CASE("moves: the log goes with the resource; a moved-from one refuses allocations, passes frees on") {
    pool p;
    stream s(0);
    std::ostringstream out;
    logging_resource a(device_resource(p), out, log_format::json_lines);
    void* q = a.allocate_async(512, 256, s);
    logging_resource b(std::move(a));
    CHECK(b.good());
    CHECK_FALSE(a.good());  // NOLINT(bugprone-use-after-move): what a moved-from resource does is the point
    CHECK_THROWS_WITH_AS((void)a.allocate_async(512, 256, s), doctest::Contains("allocate_async: the resource was moved from"),
                         std::logic_error);
    CHECK_THROWS_WITH_AS((void)a.allocate(512), doctest::Contains("allocate: the resource was moved from"), std::logic_error);
    CHECK_THROWS_AS((void)a.format(), std::logic_error);
    CHECK_THROWS_AS(logging_resource(device_resource(p), a), std::invalid_argument);
    CHECK_NOTHROW(a.flush());
    void* r = b.allocate(1024);
    a.deallocate(r, 1024);  // reaches the pool, unlogged
    CHECK(p.statistics().live_allocations == 1);
    // Move assignment: the target's own log is flushed before it takes the other's.
    std::ostringstream out2;
    logging_resource c(device_resource(p), out2, log_format::json_lines);
    void* t = c.allocate(256);
    c.deallocate(t, 256);
    CHECK(out2.str().empty());
    c = std::move(b);
    CHECK(parse_json(out2.str()).size() == 2);
    c.deallocate_async(q, 512, 256, s);
    c.flush();
    const auto hs = handle_of(s.get());
    check_lines(parse_json(out.str()), {{"allocate_async", address(q), 512, 256, hs},
                                        {"allocate", address(r), 1024, 256, std::nullopt},
                                        {"free_async", address(q), 512, 256, hs}},
                UINT64_MAX);
    CHECK(p.statistics().live_allocations == 0);
  }

  TEST_CASE("a log that cannot be written never fails an allocation; flush() says what was lost") {
    pool p;
    stream s(0);
    refusing_buffer refusing;
    std::ostream broken(&refusing);
    for (const bool every_line : {true, false}) {
      CAPTURE(every_line);
      broken.clear();
      logging_resource mr(device_resource(p), broken, logging_options{.flush_every_line = every_line});
      CHECK(mr.good());
      void* q = nullptr;
      CHECK_NOTHROW(q = mr.allocate_async(4096, 256, s));
      CHECK(q != nullptr);
      CHECK_NOTHROW(mr.deallocate_async(q, 4096, 256, s));
      CHECK(mr.good() == !every_line);  // written (and failed) at once, or still waiting
      CHECK_THROWS_WITH_AS(mr.flush(), doctest::Contains("writing the log failed"), std::runtime_error);
      CHECK_FALSE(mr.good());
      CHECK_THROWS_WITH_AS(mr.flush(), doctest::Contains("bytes of it are lost"), std::runtime_error);
    }  // the destructors do not throw
    CHECK(p.statistics().live_allocations == 0);
  }

  TEST_CASE("flush_every_line: each line is in the stream as soon as the call returns") {
    pool p;
    stream s(0);
    std::ostringstream out;
    logging_resource mr(device_resource(p), out, logging_options{.format = log_format::json_lines, .flush_every_line = true});
    void* q = mr.allocate_async(300, 256, s);
    CHECK(parse_json(out.str()).size() == 1);
    mr.deallocate_async(q, 300, 256, s);
    const auto got = parse_json(out.str());
    REQUIRE(got.size() == 2);
    CHECK(got[1].operation == "free_async");
    CHECK(got[1].pointer == address(q));
  }

  TEST_CASE_TEMPLATE_DEFINE("the pool's other users write to the log: stream_buffer and pmr_resource", F, logging_users) {
    pool p;
    pool host_pool(pool_properties{.location = memory_location::host_numa(0)});
    stream s(0);
    const auto hs = handle_of(s.get());
    std::ostringstream out;
    const auto made = std::chrono::steady_clock::now();
    std::vector<expected> did;
    {
      logging_resource mr(device_resource(p), out, F::value);
      logging_resource host_mr(host_resource(host_pool), mr);  // the same log
      {
        stream_buffer<int> b(1000, s, mr);
        did.push_back({"allocate_async", address(b.data()), 4000, 256, hs});
        CHECK(p.owns(b.data()));
        CHECK(p.statistics().used_current >= 4000);
        // Growth in place is a resize of the same address; the capacity it reports is logged.
        REQUIRE(b.try_reserve_in_place(100000));
        CHECK(b.capacity() >= 100000);
        did.push_back({"resize_async", address(b.data()), b.capacity() * sizeof(int), 256, hs});
        b.shrink_to_fit();  // size 1000: back to what the elements need, in the pool's blocks
        CHECK(b.capacity() >= 1000);
        CHECK(b.capacity() < 100000);
        const std::size_t kept = b.capacity() * sizeof(int);
        did.push_back({"resize_async", address(b.data()), kept, 256, hs});
        // A moved buffer keeps the log; the moved-from one too (it allocates again on resize).
        stream_buffer<int> taken(std::move(b));
        (void)b.resize(10);
        did.push_back({"allocate_async", address(b.data()), 40, 256, hs});
        const void* first = taken.data();
        taken = stream_buffer<int>(0, s, mr);  // an empty buffer allocates nothing, logs nothing
        did.push_back({"free_async", address(first), kept, 256, hs});
        did.push_back({"free_async", address(b.data()), 40, 256, hs});  // b's destructor, below
      }
      CHECK(p.statistics().live_allocations == 0);
      {
        // A std::pmr resource over the host pool under a logging resource: synchronous...
        pmr_resource sync_mr(host_mr);
        std::pmr::memory_resource& base = sync_mr;
        void* x = base.allocate(3000, 512);
        did.push_back({"allocate", address(x), 3000, 512, std::nullopt});
        CHECK(host_pool.owns(x));
        base.deallocate(x, 3000, 512);
        did.push_back({"free", address(x), 3000, 512, std::nullopt});
        // Equal to another over the same pool writing to the same log, not to one without it.
        CHECK(sync_mr == pmr_resource(host_mr));
        CHECK(sync_mr != pmr_resource(host_resource(host_pool)));
        // ... and in the order of a stream.
        pmr_resource ordered_mr(host_mr, s);
        void* y = static_cast<std::pmr::memory_resource&>(ordered_mr).allocate(64, 8);
        did.push_back({"allocate_async", address(y), 64, 8, hs});
        static_cast<std::pmr::memory_resource&>(ordered_mr).deallocate(y, 64, 8);
        did.push_back({"free_async", address(y), 64, 8, hs});
        // A failure is logged with its exception, then thrown.
        host_pool.set_release_threshold(0);
        CHECK_THROWS_AS((void)base.allocate(std::size_t{1} << 61, 256), out_of_memory);
        did.push_back({"allocate", std::nullopt, std::size_t{1} << 61, 256, std::nullopt, "failed",
                       "streamalloc::out_of_memory", ""});
      }
      CHECK(host_pool.statistics().live_allocations == 0);
      // A moved-from logging resource has no log to give.
      logging_resource moved(std::move(mr));
      CHECK_THROWS_WITH_AS((stream_buffer<int>(10, s, mr)), doctest::Contains("moved from"), std::invalid_argument);
      logging_resource moved_host(std::move(host_mr));
      CHECK_THROWS_WITH_AS((pmr_resource(host_mr)), doctest::Contains("moved from"), std::invalid_argument);
    }
    auto got = parse(out.str(), F::value);
    // The failure's message is the pool's; the test checks that it names the request.
    REQUIRE(got.size() == did.size());
    CHECK(got.back().message.find(std::to_string(std::size_t{1} << 61)) != std::string::npos);
    did.back().message = got.back().message;
    check_lines(got, did, ns_since(made));
  }
  TEST_CASE_TEMPLATE_INVOKE(logging_users, csv_format, json_format);

  TEST_CASE("over any resource: CCCL's resource ref, another logging_resource, a synchronous-only one") {
    pool p;
    stream s(0);
    const auto hs = handle_of(s.get());
    std::ostringstream inner_log, outer_log, ref_log, host_log;
    void* chained = nullptr;
    {
      // A logging_resource over a logging_resource (moved in): each call in both logs.
      logging_resource<logging_resource<device_resource>> outer(logging_resource(device_resource(p), inner_log),
                                                               outer_log);
      chained = outer.allocate_async(700, 1024, s);
      outer.deallocate_async(chained, 700, 1024, s);
      outer.flush();
      CHECK(inner_log.str().empty());  // the inner one writes at its own pace
    }
    const std::vector<expected> both = {{"allocate_async", address(chained), 700, 1024, hs},
                                        {"free_async", address(chained), 700, 1024, hs}};
    check_lines(parse_csv(outer_log.str()), both, UINT64_MAX);
    check_lines(parse_csv(inner_log.str()), both, UINT64_MAX);
    {
      // Over CCCL's type-erased reference: the stream reaches it as a cuda::stream_ref.
      device_resource dr(p);
      logging_resource<device_ref> mr(device_ref(dr), ref_log, log_format::json_lines);
      void* q = mr.allocate_async(4096, 256, stream_ref(s));
      CHECK(p.owns(q));
      mr.deallocate_async(q, 4096, 256, stream_ref(s));
      mr.flush();
      check_lines(parse_json(ref_log.str()), {{"allocate_async", address(q), 4096, 256, hs},
                                              {"free_async", address(q), 4096, 256, hs}},
                  UINT64_MAX);
    }
    {
      // Synchronous only, with a property that has a value: forwarded.
      logging_resource mr(host_only_resource{}, host_log, log_format::json_lines);
      CHECK(get_property(mr, numa_node_property{}) == 3);
      void* q = mr.allocate(100, 128);
      const std::uintptr_t qa = address(q);
      CHECK(qa % 128 == 0);
      mr.deallocate(q, 100, 128);
      mr.flush();
      check_lines(parse_json(host_log.str()), {{"allocate", qa, 100, 128, std::nullopt},
                                               {"free", qa, 100, 128, std::nullopt}},
                  UINT64_MAX);
    }
    CHECK(p.statistics().live_allocations == 0);
  }
}
