#pragma once

// Recorded allocation traces (bench/traces/*.trace.gz, written by bench/traces/record.py), read
// and checked for bench_trace_replay (on the GPU) and bench_trace_sim (on the CPU), and
// PyTorch's own peaks for the same steps (bench/traces/pytorch_peaks.json). No GPU, CUDA or
// zlib needed: a name ending in .gz is read through `gzip -dc`, anything else as plain text.
//
// The format (bench/traces/README.md), one operation a line:
//   # streamalloc trace v1 <name> ops=<n> peak_live=<bytes>     the first line
//   # ...                                                        provenance, "# step k" marks
//   a <id> <bytes> <stream>     allocate <bytes> on <stream>; ids are 0, 1, 2, ... in order
//   f <id> <stream>             free <id> on <stream>
// Each id is allocated once and freed at most once, after its allocation; allocations never
// freed are live at the end. Streams are small numbers, 0..k-1.

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <sys/wait.h>

namespace bench {

struct recorded_op {
  bool alloc;
  std::uint32_t id;
  std::size_t size;
  std::uint32_t stream;
};

struct recorded_trace {
  std::string path;
  std::string name;                     ///< from the header, else the file name
  std::vector<std::string> notes;       ///< the '#' lines after the header, without the '#'
  std::vector<recorded_op> ops;
  std::vector<std::size_t> step_starts; ///< the index in `ops` of each "# step" mark's first operation
  std::vector<std::size_t> size_of;     ///< by id
  std::vector<std::uint32_t> stream_of; ///< by id: the stream it was allocated on
  std::uint32_t streams = 0;            ///< 1 + the largest stream number used
  std::size_t frees = 0;
  std::size_t peak_live = 0;            ///< the most bytes live at once
  std::size_t live_at_end = 0;          ///< allocations never freed
  [[nodiscard]] std::size_t allocations() const { return size_of.size(); }
  /// The provenance line that starts with `key` ("workload:"), or "".
  [[nodiscard]] std::string note(std::string_view key) const {
    for (const auto& n : notes) {
      std::string_view v(n);
      while (!v.empty() && v.front() == ' ') v.remove_prefix(1);
      if (v.substr(0, key.size()) == key) return std::string(v);
    }
    return {};
  }
};

/// A trace that cannot be read or is not consistent; what() names the file and line.
class trace_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace trace_detail {

constexpr std::uint32_t max_streams = 1024;

inline bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

inline std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

/// Reads the next unsigned decimal number at `p`, skipping blanks before it; false when there
/// is none or it does not fit in 64 bits.
inline bool read_number(const char*& p, std::uint64_t& out) {
  while (*p == ' ' || *p == '\t') ++p;
  if (*p < '0' || *p > '9') return false;
  std::uint64_t v = 0;
  while (*p >= '0' && *p <= '9') {
    const std::uint64_t d = static_cast<std::uint64_t>(*p - '0');
    if (v > (UINT64_MAX - d) / 10) return false;
    v = v * 10 + d;
    ++p;
  }
  out = v;
  return true;
}

inline bool only_blanks(const char* p) {
  while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') ++p;
  return *p == '\0';
}

/// The lines of a file, from gzip -dc for *.gz. Closing reports gzip's failure.
class line_source {
 public:
  explicit line_source(const std::string& path) : path_(path) {
    // Opened first on its own, so that a missing file is said plainly rather than by gzip.
    if (FILE* probe = std::fopen(path.c_str(), "rb")) {
      std::fclose(probe);
    } else {
      throw trace_error(path + ": cannot open: " + std::strerror(errno));
    }
    if (ends_with(path, ".gz")) {
      const std::string cmd = "gzip -dc -- " + shell_quote(path);
      f_ = ::popen(cmd.c_str(), "r");
      piped_ = true;
      if (f_ == nullptr) throw trace_error(path + ": cannot run '" + cmd + "': " + std::strerror(errno));
    } else {
      f_ = std::fopen(path.c_str(), "r");
      if (f_ == nullptr) throw trace_error(path + ": cannot open: " + std::strerror(errno));
    }
  }
  line_source(const line_source&) = delete;
  line_source& operator=(const line_source&) = delete;
  ~line_source() {
    std::free(buf_);
    if (f_ != nullptr) piped_ ? (void)::pclose(f_) : (void)std::fclose(f_);
  }
  /// The next line without its newline, or nullptr at the end.
  const char* next() {
    const ssize_t n = ::getline(&buf_, &cap_, f_);
    if (n < 0) return nullptr;
    ++line_;
    if (n > 0 && buf_[n - 1] == '\n') buf_[n - 1] = '\0';
    return buf_;
  }
  [[nodiscard]] std::size_t line() const { return line_; }
  /// Before reporting bad content from gzip: reads to the end and throws gzip's own failure if
  /// it had one (a truncated file shows up as a cut last line first).
  void throw_if_gzip_failed() {
    if (!piped_ || f_ == nullptr) return;
    const std::size_t at = line_;
    while (next() != nullptr) {
    }
    line_ = at;
    finish();
  }
  /// Ends the read; throws when gzip failed (a damaged or truncated file, or no gzip).
  void finish() {
    if (f_ == nullptr) return;
    const bool read_error = std::ferror(f_) != 0;
    int status = 0;
    if (piped_) status = ::pclose(f_);
    else std::fclose(f_);
    f_ = nullptr;
    if (read_error) throw trace_error(path_ + ": read error after line " + std::to_string(line_));
    if (piped_ && status != 0) {
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      throw trace_error(path_ + ": 'gzip -dc' failed (" +
                        (code == 127 ? std::string("gzip not found") : "exit status " + std::to_string(code)) +
                        ") after line " + std::to_string(line_) + ": the file is damaged, truncated or not gzip");
    }
  }

 private:
  std::string path_;
  FILE* f_ = nullptr;
  bool piped_ = false;
  char* buf_ = nullptr;
  std::size_t cap_ = 0;
  std::size_t line_ = 0;
};

}  // namespace trace_detail

/**
 * @brief Reads and checks a trace: every id allocated once, in order 0, 1, 2, ...; freed at most
 * once, after its allocation; sizes above 0; streams below 1024; the header's ops and peak_live
 * (when there is a header) equal to what the file holds.
 * @throws trace_error naming the file and the line
 */
inline recorded_trace load_trace(const std::string& path) {
  using trace_detail::read_number;
  recorded_trace t;
  t.path = path;
  t.name = std::filesystem::path(path).filename().string();
  for (const char* ext : {".gz", ".trace", ".txt"}) {
    if (trace_detail::ends_with(t.name, ext)) t.name.resize(t.name.size() - std::strlen(ext));
  }
  trace_detail::line_source in(path);
  auto fail = [&](const std::string& why) -> trace_error {
    in.throw_if_gzip_failed();
    return trace_error(path + ":" + std::to_string(in.line()) + ": " + why);
  };
  std::optional<std::uint64_t> declared_ops, declared_peak;
  std::vector<std::uint32_t> freed_at;  // by id: the line of its free, 0 while live
  std::size_t live = 0;
  bool first = true;
  while (const char* line = in.next()) {
    const char* p = line;
    while (*p == ' ' || *p == '\t') ++p;
    if (*p == '\0' || *p == '\r') continue;
    if (*p == '#') {
      std::string_view text(p + 1);
      if (!text.empty() && text.back() == '\r') text.remove_suffix(1);
      const std::string_view magic = " streamalloc trace v";
      if (first && text.substr(0, magic.size()) == magic) {
        std::istringstream h{std::string(text.substr(magic.size()))};
        std::string version;
        h >> version;
        if (version != "1") throw fail("trace format version " + version + ", this reader knows version 1");
        std::string word;
        if (h >> word) t.name = word;
        while (h >> word) {
          const auto eq = word.find('=');
          if (eq == std::string::npos) continue;
          const std::string key = word.substr(0, eq), value = word.substr(eq + 1);
          const char* v = value.c_str();
          std::uint64_t n = 0;
          if (key != "ops" && key != "peak_live") continue;
          if (!read_number(v, n) || *v != '\0') throw fail("header: " + key + "=" + value + " is not a number");
          (key == "ops" ? declared_ops : declared_peak) = n;
        }
      } else {
        if (text.substr(0, 6) == " step ") t.step_starts.push_back(t.ops.size());
        t.notes.emplace_back(text);
      }
      first = false;
      continue;
    }
    first = false;
    const char kind = *p++;
    if ((kind != 'a' && kind != 'f') || (*p != ' ' && *p != '\t')) {
      throw fail(std::string("expected 'a <id> <bytes> <stream>' or 'f <id> <stream>', found '") +
                 std::string(line).substr(0, 60) + "'");
    }
    std::uint64_t id = 0, size = 0, stream = 0;
    if (kind == 'a') {
      if (!read_number(p, id) || !read_number(p, size) || !read_number(p, stream) || !trace_detail::only_blanks(p)) {
        throw fail("bad allocation line '" + std::string(line).substr(0, 60) + "': expected 'a <id> <bytes> <stream>'");
      }
      if (id != t.size_of.size()) {
        throw fail("allocation of id " + std::to_string(id) + " out of order: expected id " + std::to_string(t.size_of.size()) +
                   " (ids are numbered 0, 1, 2, ... in order of allocation, each allocated once)");
      }
      if (size == 0) throw fail("allocation of id " + std::to_string(id) + " asks for 0 bytes");
      if (stream >= trace_detail::max_streams) {
        throw fail("stream " + std::to_string(stream) + " (streams are numbered from 0, fewer than " +
                   std::to_string(trace_detail::max_streams) + ")");
      }
      if (id >= UINT32_MAX) throw fail("more than 2^32 - 1 allocations");
      t.size_of.push_back(size);
      t.stream_of.push_back(static_cast<std::uint32_t>(stream));
      freed_at.push_back(0);
      live += size;
      t.peak_live = std::max(t.peak_live, live);
    } else {
      if (!read_number(p, id) || !read_number(p, stream) || !trace_detail::only_blanks(p)) {
        throw fail("bad free line '" + std::string(line).substr(0, 60) + "': expected 'f <id> <stream>'");
      }
      if (id >= t.size_of.size()) throw fail("free of id " + std::to_string(id) + ", which is not allocated before it");
      if (freed_at[id] != 0) {
        throw fail("id " + std::to_string(id) + " freed twice (first at line " + std::to_string(freed_at[id]) + ")");
      }
      if (stream >= trace_detail::max_streams) {
        throw fail("stream " + std::to_string(stream) + " (streams are numbered from 0, fewer than " +
                   std::to_string(trace_detail::max_streams) + ")");
      }
      freed_at[id] = static_cast<std::uint32_t>(std::min<std::size_t>(in.line(), UINT32_MAX));
      live -= t.size_of[id];
      ++t.frees;
    }
    t.streams = std::max(t.streams, static_cast<std::uint32_t>(stream) + 1);
    t.ops.push_back({kind == 'a', static_cast<std::uint32_t>(id), static_cast<std::size_t>(size),
                     static_cast<std::uint32_t>(stream)});
  }
  in.finish();
  if (t.ops.empty()) throw trace_error(path + ": no operations");
  if (declared_ops && *declared_ops != t.ops.size()) {
    throw trace_error(path + ": the header says ops=" + std::to_string(*declared_ops) + " but the file has " +
                      std::to_string(t.ops.size()) + " (truncated or edited?)");
  }
  if (declared_peak && *declared_peak != t.peak_live) {
    throw trace_error(path + ": the header says peak_live=" + std::to_string(*declared_peak) +
                      " but the operations give " + std::to_string(t.peak_live));
  }
  t.live_at_end = t.size_of.size() - t.frees;
  return t;
}

/// The traces in `dir` (*.trace.gz and *.trace), sorted by name; empty when there are none or
/// `dir` cannot be read.
inline std::vector<std::string> trace_files_in(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (it->is_regular_file(ec) && (trace_detail::ends_with(name, ".trace.gz") || trace_detail::ends_with(name, ".trace"))) {
      out.push_back(it->path().string());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// Files as given, folders replaced by the traces in them.
inline std::vector<std::string> expand_trace_paths(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (const auto& a : args) {
    std::error_code ec;
    if (std::filesystem::is_directory(a, ec)) {
      for (auto& f : trace_files_in(a)) out.push_back(f);
    } else {
      out.push_back(a);
    }
  }
  return out;
}

// --- PyTorch's peaks (pytorch_peaks.json) ----------------------------------------------------

/// What PyTorch's own caching allocator reached over the steps of a trace, one setting.
struct pytorch_peak {
  double max_reserved = 0;      ///< torch.cuda.max_memory_reserved()
  double max_allocated = 0;     ///< torch.cuda.max_memory_allocated()
  double device_used_peak = 0;  ///< total - free from torch.cuda.mem_get_info, whole process
  double step_time_s = 0;       ///< median step time
};

struct pytorch_peaks {
  std::optional<pytorch_peak> standard;    ///< PYTORCH_CUDA_ALLOC_CONF unset
  std::optional<pytorch_peak> expandable;  ///< expandable_segments:True
  std::string torch;                       ///< the torch version that measured them
};

namespace trace_detail {

/// Just enough JSON for pytorch_peaks.json: objects, arrays, strings, numbers, true/false/null.
struct json {
  enum class kind { null, boolean, number, string, array, object } k = kind::null;
  double num = 0;
  std::string str;
  std::vector<json> items;
  std::vector<std::pair<std::string, json>> members;
  [[nodiscard]] const json* get(std::string_view key) const {
    if (k != kind::object) return nullptr;
    for (const auto& [name, v] : members) {
      if (name == key) return &v;
    }
    return nullptr;
  }
};

class json_parser {
 public:
  explicit json_parser(std::string_view s) : s_(s) {}
  json parse_document() {
    json v = value();
    space();
    if (i_ != s_.size()) error("text after the end");
    return v;
  }

 private:
  [[noreturn]] void error(const std::string& why) const {
    throw std::runtime_error("at byte " + std::to_string(i_) + ": " + why);
  }
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  bool eat(char c) {
    space();
    if (i_ < s_.size() && s_[i_] == c) return ++i_, true;
    return false;
  }
  json value() {
    if (++depth_ > 64) error("nested too deeply");
    space();
    if (i_ >= s_.size()) error("unexpected end");
    json v;
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.k = json::kind::object;
      if (!eat('}')) {
        do {
          space();
          std::string key = string();
          if (!eat(':')) error("expected ':'");
          v.members.emplace_back(std::move(key), value());
        } while (eat(','));
        if (!eat('}')) error("expected ',' or '}'");
      }
    } else if (c == '[') {
      ++i_;
      v.k = json::kind::array;
      if (!eat(']')) {
        do v.items.push_back(value());
        while (eat(','));
        if (!eat(']')) error("expected ',' or ']'");
      }
    } else if (c == '"') {
      v.k = json::kind::string;
      v.str = string();
    } else if (s_.substr(i_, 4) == "true" || s_.substr(i_, 5) == "false") {
      v.k = json::kind::boolean;
      v.num = s_[i_] == 't';
      i_ += s_[i_] == 't' ? 4 : 5;
    } else if (s_.substr(i_, 4) == "null") {
      i_ += 4;
    } else {
      const std::string rest(s_.substr(i_, 64));
      char* end = nullptr;
      v.num = std::strtod(rest.c_str(), &end);
      if (end == rest.c_str()) error("unexpected character '" + std::string(1, c) + "'");
      v.k = json::kind::number;
      i_ += static_cast<std::size_t>(end - rest.c_str());
    }
    --depth_;
    return v;
  }
  std::string string() {
    if (i_ >= s_.size() || s_[i_] != '"') error("expected a string");
    ++i_;
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c == '\\' && i_ < s_.size()) {
        const char e = s_[i_++];
        if (e == 'u') {  // kept as '?': no names here need more than ASCII
          i_ += 4;
          c = '?';
        } else {
          c = e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e == 'b' ? '\b' : e == 'f' ? '\f' : e;
        }
      }
      out += c;
    }
    if (i_ >= s_.size()) error("unterminated string");
    ++i_;
    return out;
  }
  std::string_view s_;
  std::size_t i_ = 0;
  int depth_ = 0;
};

}  // namespace trace_detail

/**
 * @brief PyTorch's peaks for workload `name` from `json_path` (record.py's pytorch_peaks.json).
 * @return nothing when the file is missing or has no entry for `name`; `why` then says which
 * @throws trace_error when the file exists but is not valid JSON
 */
inline std::optional<pytorch_peaks> load_pytorch_peaks(const std::string& json_path, const std::string& name,
                                                       std::string& why) {
  using trace_detail::json;
  std::ifstream f(json_path);
  if (!f) {
    why = json_path + " not found";
    return std::nullopt;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  json doc;
  try {
    doc = trace_detail::json_parser(ss.str()).parse_document();
  } catch (const std::runtime_error& e) {
    throw trace_error(json_path + ": not valid JSON " + e.what());
  }
  const json* all = doc.get("workloads");
  const json* w = all ? all->get(name) : nullptr;
  if (w == nullptr) {
    why = json_path + " has no entry for " + name;
    return std::nullopt;
  }
  pytorch_peaks out;
  if (const json* v = doc.get("torch"); v && v->k == json::kind::string) out.torch = v->str;
  auto one = [&](const char* key) -> std::optional<pytorch_peak> {
    const json* e = w->get(key);
    if (e == nullptr || e->k != json::kind::object) return std::nullopt;
    auto num = [&](const char* k) {
      const json* v = e->get(k);
      return v && v->k == json::kind::number ? v->num : 0.0;
    };
    pytorch_peak p;
    p.max_reserved = num("max_reserved");
    p.max_allocated = num("max_allocated");
    p.device_used_peak = num("device_used_peak");
    p.step_time_s = num("step_time_s");
    if (p.max_reserved <= 0) return std::nullopt;
    return p;
  };
  out.standard = one("default");
  out.expandable = one("expandable");
  if (!out.standard && !out.expandable) {
    why = json_path + ": the entry for " + name + " has no measurements";
    return std::nullopt;
  }
  return out;
}

/// pytorch_peaks.json beside the trace, else in `fallback_dir` (may be empty); "" if neither.
inline std::string peaks_file_for(const std::string& trace_path, const std::string& fallback_dir) {
  std::error_code ec;
  const auto beside = std::filesystem::path(trace_path).parent_path() / "pytorch_peaks.json";
  if (std::filesystem::exists(beside, ec)) return beside.string();
  if (!fallback_dir.empty()) {
    const auto other = std::filesystem::path(fallback_dir) / "pytorch_peaks.json";
    if (std::filesystem::exists(other, ec)) return other.string();
  }
  return {};
}

}  // namespace bench
