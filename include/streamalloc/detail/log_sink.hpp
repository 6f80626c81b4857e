#pragma once

// Where a `logging_resource`'s lines go (<streamalloc/logging_resource.hpp>): `log_sink`, shared
// by every resource writing to one log and by the pool's other users made from one
// (allocation_log.hpp), and the formatting of a line, CSV or JSON, straight into its ring.

#include <streamalloc/resource.hpp>  // and detail/allocation_log.hpp: log_op, allocation_log
#include <streamalloc/logging_options.hpp>

#include <cuda_runtime_api.h>

#include <fcntl.h>
#include <unistd.h>

#if __has_include(<cxxabi.h>)
#include <cxxabi.h>  // the type of the exception being handled, demangled
#endif

#include <fcntl.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <typeinfo>
#include <utility>

namespace streamalloc::detail {


/// The calling thread's number in logs: 1, 2, 3, ... in the order threads first write a line, for
/// the whole process (the same thread has the same number in every log), never reused.
inline std::uint32_t log_thread_id() noexcept {
  static std::atomic<std::uint32_t> next{0};
  thread_local const std::uint32_t id = next.fetch_add(1, std::memory_order_relaxed) + 1;
  return id;
}

/**
 * Where a log's lines go: a file it opened, or a std::ostream its caller owns; shared by every
 * `logging_resource` writing to that log.
 *
 * The log is one sequence whose order is part of what it says: a free takes its place in it
 * before the upstream frees, an allocation after the upstream returned, so down the file an
 * address is always freed before another allocation gets it, whichever threads did each, and a
 * converter or a replay can trust the file's order. That order is a ticket: one atomic
 * fetch_add per line on a counter all threads share. The line, formatted beforehand on the
 * caller's stack, is copied into the ring slot its ticket names and published with a release
 * store of the slot's stamp (a bounded queue in the manner of D. Vyukov's). No lock is taken on
 * the way: the first design appended under a mutex, and 8 threads logging at once queued on it
 * (a futex convoy: 0.68 M pairs a second in all, 11.7 us a pair for each thread, on an H100
 * host); with the ticket they share only the counter's cache line (5.0 M pairs a second).
 *
 * Whoever takes the ticket that completes a quarter of the ring (and any thread that finds its
 * slot still taken: the ring is full) drains the ring, in ticket order, into a staging buffer
 * and writes that to the sink, under `drain_mutex_`, which producers never wait for otherwise:
 * a busy drainer is left alone (try_lock). A drain stops at the first slot not yet published (its
 * thread is between its ticket and its store); the next drain goes on from there.
 *
 * Times are read before the ticket is taken, so lines of two threads that log within a few
 * nanoseconds of each other may show their times in the other order; each thread's own times
 * never decrease, and the order of the lines is the order of the calls.
 */
class log_sink final : public allocation_log {
 public:
  /// The longest line (a failure with a long message is cut to fit).
  static constexpr std::size_t max_line = 4096;

  log_sink(const std::filesystem::path& file, const logging_options& o) : log_sink(o) {
    fd_ = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      throw std::system_error(errno, std::generic_category(),
                              "streamalloc::logging_resource: cannot open the log file '" + file.string() + "'");
    }
  }
  log_sink(std::ostream& out, const logging_options& o) : log_sink(o) { out_ = &out; }
  log_sink(const log_sink&) = delete;
  log_sink& operator=(const log_sink&) = delete;
  ~log_sink() {
    flush_noexcept();
    if (fd_ >= 0) ::close(fd_);
  }

  [[nodiscard]] log_format format() const noexcept { return format_; }

  // allocation_log: a line for an operation, formatted straight into the ring; a failure's
  // line (the exception being handled, its type and message) on the stack first, it may span
  // several slots.
  void ok(log_op op, const void* p, std::size_t bytes, std::size_t alignment,
          const cudaStream_t* stream) noexcept override;
  void failed(log_op op, std::size_t bytes, std::size_t alignment, const cudaStream_t* stream) noexcept override;

  /// Nanoseconds since the log was made.
  [[nodiscard]] std::uint64_t now_ns() const noexcept {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - start_).count());
  }

  /// Appends the line `format(text, time_ns)` writes at `text` (at most `line_room` bytes,
  /// ending in a newline; it returns its end), formatted straight into the ring with the time
  /// read once the line has its place.
  template <class Format>
  void append_formatted(Format&& format) noexcept {
    const std::uint64_t t = ticket_.fetch_add(1, std::memory_order_relaxed);
    slot& s = slots_[t & mask_];
    wait_until_free(s, t);
    s.size = static_cast<std::uint32_t>(format(s.text, now_ns()) - s.text);
    s.stamp.store(t + 1, std::memory_order_release);
    after_append(t, 1);
  }

  /// Appends a whole line (ending in a newline, at most max_line bytes), over as many slots as
  /// it needs.
  void append(const char* line, std::size_t n) noexcept {
    const std::uint64_t k = (n + slot_text - 1) / slot_text;
    const std::uint64_t t = ticket_.fetch_add(k, std::memory_order_relaxed);
    for (std::uint64_t i = 0; i < k; ++i) {
      slot& s = slots_[(t + i) & mask_];
      wait_until_free(s, t + i);
      const std::size_t part = std::min<std::size_t>(n, slot_text);
      std::memcpy(s.text, line, part);
      s.size = static_cast<std::uint32_t>(part);
      s.stamp.store(t + i + 1, std::memory_order_release);
      line += part;
      n -= part;
    }
    after_append(t, k);
  }

  /// Writes every line appended before the call and flushes a std::ostream sink. Throws if any
  /// write to the sink has failed since the sink was made.
  void flush() {
    std::lock_guard lock(drain_mutex_);
    drain(ticket_.load(std::memory_order_relaxed), true);
    if (failed_) {
      throw std::runtime_error("streamalloc::logging_resource: writing the log failed (" + first_error_ + "); " +
                               std::to_string(bytes_lost_) + " bytes of it are lost");
    }
  }
  void flush_noexcept() noexcept {
    std::lock_guard lock(drain_mutex_);
    drain(ticket_.load(std::memory_order_relaxed), true);
  }
  [[nodiscard]] bool good() const noexcept {
    std::lock_guard lock(drain_mutex_);
    return !failed_;
  }

 private:
  using clock = std::chrono::steady_clock;

  // 384 bytes: any line but a failure's fits one (a line of CSV is about 70 bytes, of JSON 160;
  // only the cache lines it uses are touched); a failure with a long message takes several
  // consecutive tickets.
  struct alignas(64) slot {
    std::atomic<std::uint64_t> stamp{0};  // t: free for ticket t; t + 1: holds ticket t's text
    std::uint32_t size = 0;
    char text[384 - 16];
  };

 public:
  /// The room `append_formatted` gives a line.
  static constexpr std::size_t line_room = sizeof(slot::text);

 private:
  static constexpr std::size_t slot_text = sizeof(slot::text);
  // Drains gather lines here and write them once half of it is full (or at a flush): a write
  // per about 500 lines of CSV, whatever the ring's size.
  static constexpr std::size_t staging_bytes = std::size_t{64} << 10;

  void after_append(std::uint64_t t, std::uint64_t k) noexcept {
    if (every_line_) {
      std::lock_guard lock(drain_mutex_);
      drain(t + k, true);
    } else if (((t + k) & ~(batch_ - 1)) != (t & ~(batch_ - 1))) {
      try_drain();  // this line completed a quarter of the ring
    }
  }

  explicit log_sink(const logging_options& o) : format_(o.format), every_line_(o.flush_every_line) {
    if (o.format != log_format::csv && o.format != log_format::json_lines) {
      throw std::invalid_argument("streamalloc::logging_resource: logging_options::format is neither csv nor json_lines");
    }
    if (o.buffer_bytes == 0 || o.buffer_bytes > (std::size_t{1} << 30)) {
      throw std::invalid_argument("streamalloc::logging_resource: logging_options::buffer_bytes " +
                                  std::to_string(o.buffer_bytes) + " is not between 1 and 1 GiB");
    }
    const std::size_t slots = std::bit_ceil(std::max<std::size_t>(16, o.buffer_bytes / sizeof(slot)));
    mask_ = slots - 1;
    batch_ = slots / 4;
    slots_ = std::make_unique<slot[]>(slots);
    for (std::size_t i = 0; i < slots; ++i) slots_[i].stamp.store(i, std::memory_order_relaxed);
    staging_ = std::make_unique_for_overwrite<char[]>(staging_bytes + max_line);
    if (format_ == log_format::csv) {
      constexpr std::string_view header = "time_ns,thread,operation,pointer,bytes,alignment,stream,outcome,exception,message\n";
      std::memcpy(staging_.get(), header.data(), header.size());
      staged_ = header.size();
    }
    start_ = clock::now();
  }

  // The slot is still held by the ticket one ring earlier: the ring is full. Drain it (or let
  // the thread draining it finish) rather than wait idle.
  void wait_until_free(slot& s, std::uint64_t t) noexcept {
    for (unsigned spins = 0; s.stamp.load(std::memory_order_acquire) != t; ++spins) {
      if (try_drain()) continue;
      if (spins < 64) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

  bool try_drain() noexcept {
    std::unique_lock lock(drain_mutex_, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    drain(0, false);
    return true;
  }

  // Under drain_mutex_: moves published lines, in ticket order, to the staging buffer (freeing
  // their slots for the ticket one ring later) and writes it out. Stops at the first slot not yet
  // published, unless `until` is past it: then waits for its thread to publish (it is between its
  // ticket and its store, never blocked on anything of ours). A pass goes no further than the
  // tickets given out when it began: producers that keep the ring full would otherwise keep the
  // draining thread at it, its own call not returning (the likely cause of one of 8 threads
  // doing a twelfth of the mean's work in an H100 run, JSON to a file).
  void drain(std::uint64_t until, bool flush_sink) noexcept {
    const std::uint64_t ring = mask_ + 1;
    const std::uint64_t end = std::max(until, ticket_.load(std::memory_order_relaxed));
    while (read_ < end) {
      slot& s = slots_[read_ & mask_];
      if (s.stamp.load(std::memory_order_acquire) != read_ + 1) {
        if (read_ >= until) break;
        std::this_thread::yield();
        continue;
      }
      std::memcpy(staging_.get() + staged_, s.text, s.size);
      staged_ += s.size;
      s.stamp.store(read_ + ring, std::memory_order_release);
      ++read_;
      if (staged_ >= staging_bytes) write_out(false);
    }
    if (flush_sink || staged_ >= staging_bytes / 2) write_out(flush_sink);
  }

  // Under drain_mutex_. Never throws: a log that cannot be written must not fail the program's
  // allocations; the failure is kept for flush() to report.
  void write_out(bool flush_sink) noexcept {
    const char* p = staging_.get();
    std::size_t n = std::exchange(staged_, 0);
    if (out_ == nullptr && fd_ < 0) return;  // the file could not be opened: the constructor threw
    if (out_ != nullptr) {
      try {
        if (n != 0) out_->write(p, static_cast<std::streamsize>(n));
        if (flush_sink) out_->flush();
        if (!*out_) failed(n, "the std::ostream is in a failed state");
      } catch (const std::exception& e) {
        failed(n, e.what());
      } catch (...) {
        failed(n, "the std::ostream threw");
      }
      return;
    }
    while (n != 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        failed(n, w < 0 ? std::strerror(errno) : "write wrote nothing");
        return;
      }
      p += w;
      n -= static_cast<std::size_t>(w);
    }
  }
  void failed(std::size_t bytes, const char* why) noexcept {
    bytes_lost_ += bytes;
    if (!failed_) {
      try {
        first_error_ = why;
      } catch (...) {  // out of memory: the byte count still tells
      }
      failed_ = true;
    }
  }

  log_format format_;
  bool every_line_;
  clock::time_point start_;
  std::ostream* out_ = nullptr;
  int fd_ = -1;

  std::uint64_t mask_ = 0;   // slots - 1 (a power of two)
  std::uint64_t batch_ = 1;  // a quarter of the ring: who completes one drains it
  std::unique_ptr<slot[]> slots_;
  alignas(64) std::atomic<std::uint64_t> ticket_{0};  // the next line's place in the log

  alignas(64) mutable std::mutex drain_mutex_;  // guards what follows and the sink
  std::uint64_t read_ = 0;                      // the next ticket to drain
  std::unique_ptr<char[]> staging_;
  std::size_t staged_ = 0;
  bool failed_ = false;
  std::string first_error_;
  std::size_t bytes_lost_ = 0;
};

// --- formatting ---------------------------------------------------------------------------------
// A whole line, formatted on the caller's stack before it takes its place in the log.

/// The most a line of the hot path may take: the longest JSON form, every number at its
/// longest, is 220 bytes.
inline constexpr std::size_t log_fields_room = 352;
static_assert(log_sink::line_room >= log_fields_room, "a line of the hot path must fit a slot of the ring");

inline char* put(char* w, std::string_view s) noexcept {
  std::memcpy(w, s.data(), s.size());
  return w + s.size();
}
inline char* put_number(char* w, std::uint64_t v) noexcept { return std::to_chars(w, w + 24, v).ptr; }
inline char* put_hex(char* w, std::uintptr_t v) noexcept {
  w = put(w, "0x");
  return std::to_chars(w, w + 24, v, 16).ptr;
}

/// The fields from the time to the stream. `has_pointer` is false for a failed allocation (an
/// empty field / null), `stream` null for a synchronous operation.
inline char* put_fields(char* w, log_format f, std::uint64_t time_ns, log_op op, const void* p, bool has_pointer,
                        std::size_t bytes, std::size_t alignment, const cudaStream_t* stream) noexcept {
  const auto address = reinterpret_cast<std::uintptr_t>(p);
  if (f == log_format::json_lines) w = put(w, "{\"time_ns\":");
  w = put_number(w, time_ns);
  if (f == log_format::csv) {
    w = put(w, ",");
    w = put_number(w, log_thread_id());
    w = put(w, ",");
    w = put(w, log_op_name(op));
    w = put(w, ",");
    if (has_pointer) w = put_hex(w, address);
    w = put(w, ",");
    w = put_number(w, bytes);
    w = put(w, ",");
    w = put_number(w, alignment);
    w = put(w, ",");
    if (stream != nullptr) w = put_hex(w, reinterpret_cast<std::uintptr_t>(*stream));
    return w;
  }
  w = put(w, ",\"thread\":");
  w = put_number(w, log_thread_id());
  w = put(w, ",\"operation\":\"");
  w = put(w, log_op_name(op));
  w = put(w, "\",\"pointer\":");
  if (has_pointer) {
    w = put(w, "\"");
    w = put_hex(w, address);
    w = put(w, "\"");
  } else {
    w = put(w, "null");
  }
  w = put(w, ",\"bytes\":");
  w = put_number(w, bytes);
  w = put(w, ",\"alignment\":");
  w = put_number(w, alignment);
  w = put(w, ",\"stream\":");
  if (stream != nullptr) {
    w = put(w, "\"");
    w = put_hex(w, reinterpret_cast<std::uintptr_t>(*stream));
    w = put(w, "\"");
  } else {
    w = put(w, "null");
  }
  return w;
}

/// Writes `s` as the inside of a quoted CSV field (quotes doubled; control characters, which
/// would break the one-line-per-operation shape, become spaces) or JSON string (escaped), up
/// to `end`; cut with "..." where it does not fit, never inside a UTF-8 sequence.
inline char* put_text(char* w, char* end, log_format f, std::string_view s) noexcept {
  constexpr std::size_t cut_mark = 3;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    char esc[8];
    std::size_t n = 0;
    if (f == log_format::csv) {
      if (c == '"') {
        esc[n++] = '"';
        esc[n++] = '"';
      } else {
        esc[n++] = c < 0x20 || c == 0x7f ? ' ' : static_cast<char>(c);
      }
    } else if (c == '"' || c == '\\') {
      esc[n++] = '\\';
      esc[n++] = static_cast<char>(c);
    } else if (c == '\n' || c == '\r' || c == '\t') {
      esc[n++] = '\\';
      esc[n++] = c == '\n' ? 'n' : c == '\r' ? 'r' : 't';
    } else if (c < 0x20) {
      constexpr char hex[] = "0123456789abcdef";
      for (char x : {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]}) esc[n++] = x;
    } else {
      esc[n++] = static_cast<char>(c);
    }
    if (static_cast<std::size_t>(end - w) < n + cut_mark) {
      // Back up to the start of a UTF-8 sequence, so that what is kept is valid text.
      if ((c & 0xC0) == 0x80) {
        // The field's opening quote, before any of its text, ends the search.
        while ((static_cast<unsigned char>(w[-1]) & 0xC0) == 0x80) --w;
        if ((static_cast<unsigned char>(w[-1]) & 0xC0) == 0xC0) --w;
      }
      return put(w, "...");
    }
    std::memcpy(w, esc, n);
    w += n;
  }
  return w;
}

/// The type of the exception being handled, demangled where the C++ ABI allows.
inline std::string current_exception_type() {
#if __has_include(<cxxabi.h>)
  const std::type_info* t = abi::__cxa_current_exception_type();
  if (t == nullptr) return "unknown";
  int status = -1;
  char* name = abi::__cxa_demangle(t->name(), nullptr, nullptr, &status);
  std::string out = status == 0 && name != nullptr ? name : t->name();
  std::free(name);
  return out;
#else
  try {
    throw;
  } catch (const std::exception& e) {
    return typeid(e).name();
  } catch (...) {
    return "unknown";
  }
#endif
}

/// The message of the exception being handled: what() of a std::exception, else empty.
inline std::string current_exception_message() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return {};
  }
}

inline void log_sink::ok(log_op op, const void* p, std::size_t bytes, std::size_t alignment,
                         const cudaStream_t* stream) noexcept {
  const log_format f = format_;
  append_formatted([&](char* w, std::uint64_t time_ns) noexcept {
    w = put_fields(w, f, time_ns, op, p, true, bytes, alignment, stream);
    return put(w, f == log_format::csv ? std::string_view(",ok,,\n") : std::string_view(",\"outcome\":\"ok\"}\n"));
  });
}

// In the handler of what the allocation threw; must not throw itself (that exception is
// rethrown after it), so a failure to describe the exception leaves its fields empty.
inline void log_sink::failed(log_op op, std::size_t bytes, std::size_t alignment, const cudaStream_t* stream) noexcept {
  std::string type, message;
  try {
    type = current_exception_type();
    message = current_exception_message();
  } catch (...) {
  }
  const std::uint64_t time_ns = now_ns();
  char line[max_line];
  char* const end = line + sizeof line - 8;  // room for the closing quote(s), brace and newline
  const log_format f = format_;
  char* w = put_fields(line, f, time_ns, op, nullptr, false, bytes, alignment, stream);
  w = put(w, f == log_format::csv ? std::string_view(",failed,\"") : std::string_view(",\"outcome\":\"failed\",\"exception\":\""));
  w = put_text(w, std::min(end, w + 512), f, type);  // a type name is cut at 512 bytes
  w = put(w, f == log_format::csv ? std::string_view("\",\"") : std::string_view("\",\"message\":\""));
  w = put_text(w, end, f, message);
  w = put(w, f == log_format::csv ? std::string_view("\"\n") : std::string_view("\"}\n"));
  append(line, static_cast<std::size_t>(w - line));
}

}  // namespace streamalloc::detail
