#pragma once

/// @file
/// @brief `logging_resource<Upstream>`: a memory resource that writes every allocate and free it
/// passes to another resource as one line of CSV or JSON, to a file or a `std::ostream`.

#include <streamalloc/resource.hpp>  // and detail/allocation_log.hpp, the log as a pool's other users see it
#include <streamalloc/stream.hpp>

#include <cuda/memory_resource>
#include <cuda/stream_ref>
#include <cuda_runtime_api.h>

#include <fcntl.h>
#include <unistd.h>

#if __has_include(<cxxabi.h>)
#include <cxxabi.h>  // the type of the exception being handled, demangled
#endif

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

namespace streamalloc {

/// The format of a `logging_resource`'s lines (`docs/observability.md` shows both).
enum class log_format {
  csv,         ///< comma-separated values with a header line first; RFC 4180 quoting
  json_lines,  ///< one JSON object a line (JSON Lines)
};

/// How a `logging_resource` writes its lines.
struct logging_options {
  /// CSV or JSON lines.
  log_format format = log_format::csv;
  /// Memory for lines waiting to be written: a ring of slots of 384 bytes (a line takes one),
  /// rounded up to a power of two of them, at least 16 (the default: 1,024 slots, 384 KiB).
  /// Whoever completes a quarter of the ring moves what is waiting to a staging buffer, written
  /// to the sink once 32 KiB wait there; `flush()` and the end of the last resource writing to
  /// the log write the rest. From 1 byte to 1 GiB.
  std::size_t buffer_bytes = std::size_t{256} << 10;
  /// Writes each line to the sink as it is made (and flushes a `std::ostream`), for a program
  /// that may die before its resource is destroyed (a bad free that aborts, say). Costs a system
  /// call per line with a file.
  bool flush_every_line = false;
};

namespace detail {

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

/// A resource whose stream-ordered calls take streamalloc's stream_ref (pool_resource, and so
/// a logging_resource over one): given it as is, so that a resolved stream stays resolved.
template <class R>
concept takes_streamalloc_stream = requires(R& r, void* p, std::size_t n, stream_ref s) {
  { r.allocate_async(n, n, s) } -> std::same_as<void*>;
  r.deallocate_async(p, n, n, s);
};

}  // namespace detail

/**
 * @brief A memory resource that passes every allocate and free to `Upstream` and writes each
 * as one line, CSV or JSON lines, to a file it opens or a `std::ostream` its caller owns.
 *
 * It models what `Upstream` models of CCCL's `cuda::mr` concepts (`resource`, and
 * `async_resource` when the upstream has stream-ordered calls) and carries the upstream's
 * properties (`device_accessible`, `host_accessible`, stateful ones too), so a
 * `logging_resource<device_resource>` is a `device_memory_resource` and goes wherever a CCCL
 * resource or `cuda::mr::async_resource_ref<device_accessible>` does. It wraps any such resource:
 * a `pool_resource`, CCCL's resource refs, another `logging_resource`.
 *
 * Each line: the time in nanoseconds since the log was made (a steady clock), the thread (1, 2,
 * ... in order of each thread's first line in the process), the operation (`allocate`, `free`,
 * `allocate_async`, `free_async`), the pointer, the bytes and alignment asked for, the stream's
 * raw handle (empty, or null, for a synchronous call) and the outcome: `ok`, or `failed` with the
 * exception's type and message for an allocation that threw, which is then rethrown unchanged.
 * An allocation is written once the upstream returned; a free before it is handed to the
 * upstream, so that down the file an address is always freed before it is allocated again.
 * A free the upstream refuses (a foreign pointer, a double free) is reported by the upstream
 * (`pool_resource`: the bad-free handler) and is logged as `ok` like any other: a free line says
 * the free was asked for. `docs/observability.md` shows the lines and what they cost.
 *
 * Thread-safe without a lock on the way (a ticket per line): lines of concurrent calls never
 * mix; the order of the lines is the order of the calls; each thread's times never decrease.
 * Lines wait in memory (`logging_options::buffer_bytes`) and are written as they pile up, at
 * `flush()` and when the last resource writing to the log is destroyed; a failed write never
 * fails an allocation, `flush()` reports it. Move-only; a moved-from resource throws `std::logic_error` from its allocations and
 * passes frees to its upstream unlogged. Equal to another `logging_resource` writing to the same
 * log (made with the sharing constructor) over an equal upstream: memory of one may be freed
 * through the other and the log still holds both lines.
 * @code
 * streamalloc::pool pool;
 * streamalloc::logging_resource mr(streamalloc::device_resource(pool), "allocations.csv");
 * cuda::mr::async_resource_ref<cuda::mr::device_accessible> ref(mr);
 * void* p = ref.allocate_async(1 << 20, 256, cuda::stream_ref(s.get()));  // one line
 * ref.deallocate_async(p, 1 << 20, 256, cuda::stream_ref(s.get()));       // another
 * @endcode
 * @tparam Upstream the resource it allocates from, held by value (a `pool_resource` is a
 *         small handle; a move-only resource is moved in)
 */
template <class Upstream>
  requires ::cuda::mr::resource<Upstream>
class logging_resource : public ::cuda::forward_property<logging_resource<Upstream>, Upstream> {
 public:
  /// The type of the resource it passes calls to.
  using upstream_type = Upstream;
  /// Does the upstream claim `host_accessible`?
  static constexpr bool is_host_accessible = (::cuda::has_property<Upstream, host_accessible>);
  /// Does the upstream claim `device_accessible`?
  static constexpr bool is_device_accessible = (::cuda::has_property<Upstream, device_accessible>);

  /**
   * @brief Logs to `file`, which it creates, or truncates if it exists, and closes at the end.
   * @param upstream the resource that allocates
   * @param file where the lines go
   * @param format CSV or JSON lines
   * @throws std::system_error when the file cannot be opened (naming it)
   */
  logging_resource(Upstream upstream, const std::filesystem::path& file, log_format format = log_format::csv)
      : logging_resource(std::move(upstream), file, logging_options{.format = format}) {}
  /// As above, with all the options. @throws std::system_error, std::invalid_argument (a bad option)
  logging_resource(Upstream upstream, const std::filesystem::path& file, const logging_options& options)
      : upstream_(std::move(upstream)), sink_(std::make_shared<detail::log_sink>(file, options)) {}
  /**
   * @brief Logs to `out`, which must outlive every resource writing to it and which nothing else
   * may write to while they live (they write to it from whichever thread fills the buffer).
   */
  logging_resource(Upstream upstream, std::ostream& out, log_format format = log_format::csv)
      : logging_resource(std::move(upstream), out, logging_options{.format = format}) {}
  /// As above, with all the options. @throws std::invalid_argument (a bad option)
  logging_resource(Upstream upstream, std::ostream& out, const logging_options& options)
      : upstream_(std::move(upstream)), sink_(std::make_shared<detail::log_sink>(out, options)) {}
  /**
   * @brief Logs to the same log as `same_log_as` (its file or stream, its format, its clock):
   * the lines of both are in one file, in order. The log is closed when the last resource
   * writing to it goes. Compares equal to `same_log_as` when their upstreams are equal.
   * @throws std::invalid_argument when `same_log_as` was moved from
   */
  template <class Other>
  logging_resource(Upstream upstream, const logging_resource<Other>& same_log_as)
      : upstream_(std::move(upstream)), sink_(same_log_as.sink_) {
    if (sink_ == nullptr) {
      throw std::invalid_argument("streamalloc::logging_resource: the resource to share a log with was moved from");
    }
  }

  logging_resource(const logging_resource&) = delete;
  logging_resource& operator=(const logging_resource&) = delete;
  /// Takes `other`'s upstream and log; `other` is left without a log.
  logging_resource(logging_resource&& other) noexcept(std::is_nothrow_move_constructible_v<Upstream>)
      : upstream_(std::move(other.upstream_)), sink_(std::exchange(other.sink_, nullptr)) {}
  /// Flushes its own log (another resource may still write to it), then takes `other`'s.
  logging_resource& operator=(logging_resource&& other) noexcept(std::is_nothrow_move_assignable_v<Upstream>) {
    if (this != &other) {
      if (sink_ != nullptr) sink_->flush_noexcept();
      upstream_ = std::move(other.upstream_);
      sink_ = std::exchange(other.sink_, nullptr);
    }
    return *this;
  }
  /// Writes what is waiting; the log is closed if no other resource writes to it.
  ~logging_resource() {
    if (sink_ != nullptr) sink_->flush_noexcept();
  }

  /**
   * @brief Synchronous allocation through the upstream, logged as `allocate`.
   * @throws whatever the upstream throws, unchanged, after logging it; std::logic_error when
   *         moved from
   */
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = 256) {
    return logged(detail::log_op::allocate, bytes, alignment, nullptr,
                  [&] { return upstream_.allocate(bytes, alignment); });
  }
  /// Synchronous free through the upstream, logged as `free` (before it is handed on).
  void deallocate(void* p, std::size_t bytes, std::size_t alignment = 256) noexcept(
      noexcept(std::declval<Upstream&>().deallocate(p, bytes, alignment))) {
    log_free(detail::log_op::free, p, bytes, alignment, nullptr);
    upstream_.deallocate(p, bytes, alignment);
  }

  /**
   * @brief Allocation in the order of `s`, logged as `allocate_async`.
   * @throws whatever the upstream throws, unchanged, after logging it; std::logic_error when
   *         moved from
   */
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment, ::cuda::stream_ref s)
    requires ::cuda::mr::async_resource<Upstream>
  {
    const cudaStream_t h = s.get();
    return logged(detail::log_op::allocate_async, bytes, alignment, &h,
                  [&] { return upstream_.allocate_async(bytes, alignment, s); });
  }
  /// As above, with streamalloc's stream reference (passed on as is where the upstream takes it).
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment, stream_ref s)
    requires ::cuda::mr::async_resource<Upstream>
  {
    const cudaStream_t h = s.get();
    return logged(detail::log_op::allocate_async, bytes, alignment, &h, [&] {
      if constexpr (detail::takes_streamalloc_stream<Upstream>) {
        return upstream_.allocate_async(bytes, alignment, s);
      } else {
        return upstream_.allocate_async(bytes, alignment, ::cuda::stream_ref(h));
      }
    });
  }
  /// Allocation in the order of `s`, aligned to 256 bytes.
  [[nodiscard]] void* allocate_async(std::size_t bytes, stream_ref s)
    requires ::cuda::mr::async_resource<Upstream>
  {
    return allocate_async(bytes, 256, s);
  }
  /// Free in the order of `s`, logged as `free_async` (before it is handed on).
  void deallocate_async(void* p, std::size_t bytes, std::size_t alignment, ::cuda::stream_ref s) noexcept(
      noexcept(std::declval<Upstream&>().deallocate_async(p, bytes, alignment, s)))
    requires ::cuda::mr::async_resource<Upstream>
  {
    const cudaStream_t h = s.get();
    log_free(detail::log_op::free_async, p, bytes, alignment, &h);
    upstream_.deallocate_async(p, bytes, alignment, s);
  }
  /// As above, with streamalloc's stream reference.
  void deallocate_async(void* p, std::size_t bytes, std::size_t alignment, stream_ref s) noexcept(
      noexcept(std::declval<Upstream&>().deallocate_async(p, bytes, alignment, ::cuda::stream_ref(s.get()))))
    requires ::cuda::mr::async_resource<Upstream>
  {
    const cudaStream_t h = s.get();
    log_free(detail::log_op::free_async, p, bytes, alignment, &h);
    if constexpr (detail::takes_streamalloc_stream<Upstream>) {
      upstream_.deallocate_async(p, bytes, alignment, s);
    } else {
      upstream_.deallocate_async(p, bytes, alignment, ::cuda::stream_ref(h));
    }
  }
  /// Free of what `allocate_async(bytes, s)` returned, in the order of `s`.
  void deallocate_async(void* p, std::size_t bytes, stream_ref s) noexcept(
      noexcept(std::declval<logging_resource&>().deallocate_async(p, bytes, std::size_t{256}, s)))
    requires ::cuda::mr::async_resource<Upstream>
  {
    deallocate_async(p, bytes, 256, s);
  }

  /**
   * @brief Writes the lines waiting in memory to the log (and flushes a `std::ostream`).
   * @throws std::runtime_error if a write to the log has failed since it was made (saying why
   *         and how many bytes were lost); the allocations themselves never fail for it
   */
  void flush() {
    if (sink_ != nullptr) sink_->flush();
  }
  /// False once a write to the log has failed (`flush()` says why); false when moved from.
  [[nodiscard]] bool good() const noexcept { return sink_ != nullptr && sink_->good(); }
  /// The format of its lines. @throws std::logic_error when moved from
  [[nodiscard]] log_format format() const {
    if (sink_ == nullptr) throw_moved_from("format");
    return sink_->format();
  }
  /// The resource it passes calls to.
  [[nodiscard]] const Upstream& upstream_resource() const noexcept { return upstream_; }

  /// Equal when they write to the same log and their upstreams are equal (see the class).
  friend bool operator==(const logging_resource& a, const logging_resource& b) noexcept(
      noexcept(std::declval<const Upstream&>() == std::declval<const Upstream&>())) {
    return a.sink_ == b.sink_ && a.upstream_ == b.upstream_;
  }
  /// Not equal (see `operator==`).
  friend bool operator!=(const logging_resource& a, const logging_resource& b) noexcept(noexcept(a == b)) {
    return !(a == b);
  }

 private:
  template <class U>
    requires ::cuda::mr::resource<U>
  friend class logging_resource;
  friend struct detail::logging_access;

  template <class Allocate>
  void* logged(detail::log_op op, std::size_t bytes, std::size_t alignment, const cudaStream_t* s, Allocate&& allocate) {
    if (sink_ == nullptr) [[unlikely]] throw_moved_from(detail::log_op_name(op));
    void* p = nullptr;
    try {
      p = allocate();
    } catch (...) {
      log_failure(op, bytes, alignment, s);
      throw;
    }
    log_ok(op, p, bytes, alignment, s);
    return p;
  }

  void log_free(detail::log_op op, void* p, std::size_t bytes, std::size_t alignment, const cudaStream_t* s) noexcept {
    if (sink_ == nullptr) [[unlikely]] return;  // moved from: the free still goes to the upstream
    log_ok(op, p, bytes, alignment, s);
  }

  void log_ok(detail::log_op op, const void* p, std::size_t bytes, std::size_t alignment,
              const cudaStream_t* s) noexcept {
    sink_->ok(op, p, bytes, alignment, s);
  }
  // In the handler of what the upstream threw (which is rethrown after it).
  STREAMALLOC_COLD void log_failure(detail::log_op op, std::size_t bytes, std::size_t alignment,
                                    const cudaStream_t* s) noexcept {
    sink_->failed(op, bytes, alignment, s);
  }

  [[noreturn]] STREAMALLOC_COLD static void throw_moved_from(std::string_view what) {
    throw std::logic_error("streamalloc::logging_resource::" + std::string(what) + ": the resource was moved from");
  }

  Upstream upstream_;
  std::shared_ptr<detail::log_sink> sink_;
};

static_assert(::cuda::mr::async_resource_with<logging_resource<device_resource>, device_accessible>);
static_assert(!::cuda::mr::resource_with<logging_resource<device_resource>, host_accessible>);
static_assert(::cuda::mr::async_resource_with<logging_resource<host_device_resource>, host_accessible, device_accessible>);
static_assert(::cuda::mr::async_resource_with<logging_resource<host_resource>, host_accessible>);
static_assert(!::cuda::mr::resource_with<logging_resource<host_resource>, device_accessible>);
static_assert(device_memory_resource<logging_resource<device_resource>>);
static_assert(host_memory_resource<logging_resource<host_resource>>);

}  // namespace streamalloc
