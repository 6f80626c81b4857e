#pragma once

// What logging_resource_test.cpp and logging_resource_threads_test.cpp share: a parser of the
// log's lines (CSV and JSON lines) and the checks on them, and the resources and files both use.
// Those files are compiled as one translation unit with the other fake-driver tests
// (tests/CMakeLists.txt), so what they share is defined here once, and a name at file scope must
// not be defined by two of them.

#include <streamalloc/logging_resource.hpp>
#include <streamalloc/resource.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
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

inline std::uintptr_t address(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }
inline std::uintptr_t handle_of(cudaStream_t s) { return reinterpret_cast<std::uintptr_t>(s); }

inline std::uint64_t to_u64(const std::string& s, int base = 10) {
  REQUIRE_MESSAGE(!s.empty(), "an empty number");
  std::size_t used = 0;
  const auto v = std::stoull(s, &used, base);
  REQUIRE_MESSAGE(used == s.size(), "not a number: " << s);
  return v;
}
inline std::uintptr_t from_hex(const std::string& s) {
  REQUIRE_MESSAGE(s.rfind("0x", 0) == 0, "a pointer or stream is written 0x...: " << s);
  return static_cast<std::uintptr_t>(to_u64(s.substr(2), 16));
}

// RFC 4180 fields of one line (no newline inside: the resource never writes one in a field).
inline std::vector<std::string> csv_fields(const std::string& text) {
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

inline std::vector<std::string> lines_of(const std::string& text) {
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

inline std::vector<line> parse_csv(const std::string& text) {
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

inline std::map<std::string, json_value> json_object(const std::string& text) {
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

inline std::vector<line> parse_json(const std::string& text) {
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

inline std::vector<line> parse(const std::string& text, log_format f) {
  return f == log_format::csv ? parse_csv(text) : parse_json(text);
}

inline bool same(const line& l, const expected& e) {
  return l.operation == e.operation && l.pointer == e.pointer && l.bytes == e.bytes && l.alignment == e.alignment &&
         l.stream == e.stream && l.outcome == e.outcome && l.exception == e.exception && l.message == e.message;
}

inline std::string describe(const line& l) {
  std::ostringstream o;
  o << l.operation << " p=" << (l.pointer ? std::to_string(*l.pointer) : "-") << " bytes=" << l.bytes
    << " align=" << l.alignment << " stream=" << (l.stream ? std::to_string(*l.stream) : "-") << " " << l.outcome
    << " [" << l.exception << "] [" << l.message << "]";
  return o.str();
}
inline std::string describe(const expected& e) {
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
inline void check_lines(const std::vector<line>& got, const std::vector<expected>& want, std::uint64_t lifetime_ns) {
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

inline std::uint64_t ns_since(std::chrono::steady_clock::time_point t) {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t).count());
}

// --- resources, files and formats of both files -----------------------------------------------

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

// CCCL's type-erased reference to a stream-ordered resource of device memory.
using device_ref = ::cuda::mr::async_resource_ref<device_accessible>;

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

// The two formats, as the types the template test cases run over.
using csv_format = std::integral_constant<log_format, log_format::csv>;
using json_format = std::integral_constant<log_format, log_format::json_lines>;

}  // namespace logging_resource_test
