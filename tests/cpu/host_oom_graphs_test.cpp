// Running out of host memory (operator new throwing std::bad_alloc) while memory goes back from
// a graph that is gone, and while another process imports a pool's memory and ends its imports.
// Both happen on threads of streamalloc's own (the graph reaper, the exporter's server, the
// importer's reaper) or in noexcept members, so nothing may escape, and nothing may be lost,
// released twice or unmapped under work that still uses it. Host allocations fail through
// support/failing_new.hpp: the test's own thread is exempt where the code under test runs on
// another thread, so that only that thread's allocations fail. That header replaces operator new
// for all of cpu_fake_driver (a unity build: another file including it gets the same, once);
// nothing fails unless a case asks. The fake driver's own allocations (its first lookup of an
// entry point, its maps) go through it too, and would throw through streamalloc's noexcept driver
// calls where a real driver returns a status: the cases look entry points up first, with memory.
// Crashes (std::terminate, SIGSEGV) are shown in a child process running suite
// host_oom_graphs_child, whose cases do nothing in any other process.
//
// The comment above each case names the bug it was written for, fixed since.

#include <streamalloc/captured_graph.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/detail/ipc/channel.hpp>
#include <streamalloc/detail/ipc/protocol.hpp>
#include <streamalloc/detail/pool/graph_reaper.hpp>
#include <streamalloc/graph_exec.hpp>
#include <streamalloc/ipc.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "failing_new.hpp"
#include "fake_driver.hpp"

#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

using namespace streamalloc;
namespace cu = streamalloc::detail::cu;
using streamalloc_test::fake_graphs;
using streamalloc_test::fake_live;
using streamalloc_test::handle;
using streamalloc_test::MiB;
using streamalloc_test::reaper_idle;

namespace {

/// Every host allocation of the other threads fails, from the `k`-th on, while it lives; the
/// calling thread's succeed (and do not count). The code under test runs on another thread.
struct oom_elsewhere {
  explicit oom_elsewhere(int k = 0) noexcept : refuse(k) { test_support::allocations_exempt = true; }
  ~oom_elsewhere() { test_support::allocations_exempt = false; }
  oom_elsewhere(const oom_elsewhere&) = delete;
  oom_elsewhere& operator=(const oom_elsewhere&) = delete;
  test_support::refusing_allocations refuse;
};

/// Makes the pool's state for synchronous calls, which the reaper otherwise makes (and needs
/// host memory for) when a graph leaves an allocation live. Returns the allocation that made it,
/// live: freed after the capture, it keeps the graph off its chunk (and its live-table shard).
void* oom_make_host_state(const pool& p) { return p.allocate_sync(256); }

/// A graph that frees all it allocates, captured on `s`.
captured_graph oom_workspace_graph(const pool& p, const stream& s) {
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  p.deallocate(p.allocate(MiB, s.ref()), s.ref());
  return end_capture(s.ref());
}

/// Runs a graph_exec's whole life once with host memory, so that every driver entry point it
/// uses has been looked up: the fake driver's first lookup of a name needs host memory, which
/// a real driver's does not (and would throw through streamalloc's noexcept driver calls).
void oom_warm_up(const pool& p, const stream& s) {
  captured_graph g = oom_workspace_graph(p, s);
  graph_exec e(g);
  g.reset();
  e.launch(s.ref());
  s.synchronize();
  e.reset();
  REQUIRE(reaper_idle());
}

/// Waits until the reaper has run every job handed to it so far (holds may remain: those of
/// graphs still alive).
void oom_reaper_ran() {
  streamalloc_test::fake_quiesce();
  (void)streamalloc::detail::graph_reaper::instance().drain();
}

/// Lets go of `g` so that the last hold on its memory ends on the reaper, with every host
/// allocation of the threads but this one failing from the `k`-th on meanwhile. An executable
/// instantiated from the bare graph keeps the graph's user objects while the captured_graph's
/// own holds go here (with host memory); destroying it then ends the user objects, whose end the
/// driver's thread hands the reaper. (Destroying the captured_graph alone would race: its holds
/// and the user object's end on the reaper, whichever lets go last releases.)
void oom_release_on_reaper(captured_graph& g, int k = 0) {
  graph_exec holder(g.get());
  g.reset();
  const oom_elsewhere oom(k);
  holder.reset();
  REQUIRE(reaper_idle());
}

// --- cases run in a process of their own: a crash there must not end this one -----------------

constexpr const char* oom_child_variable = "STREAMALLOC_HOST_OOM_CHILD";

/// In a child process run by oom_run_child? (The child suite's cases do nothing elsewhere.)
bool oom_in_child() { return std::getenv(oom_child_variable) != nullptr; }

struct oom_child_result {
  int status = 0;
  std::string output;
  [[nodiscard]] bool exited_cleanly() const { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

/// Runs case `name` of suite host_oom_graphs_child in a new process of this binary (nothing
/// done in this one carries over: the host stream record, the reaper's thread) and returns how
/// it ended and what it printed.
oom_child_result oom_run_child(const std::string& name) {
  // Everything the child needs is made before fork: between fork and exec only async-signal-safe calls.
  const std::string suite = "--test-suite=host_oom_graphs_child";
  const std::string which = "--test-case=" + name;
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) env_strings.emplace_back(*e);
  env_strings.push_back(std::string(oom_child_variable) + "=1");
  std::vector<char*> env;
  for (std::string& e : env_strings) env.push_back(e.data());
  env.push_back(nullptr);
  char exe[] = "/proc/self/exe";
  std::vector<char*> argv{exe, const_cast<char*>(suite.c_str()), const_cast<char*>(which.c_str()), nullptr};
  int out[2];
  REQUIRE(::pipe(out) == 0);
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(out[1], STDERR_FILENO);
    ::close(out[0]);
    ::execve(exe, argv.data(), env.data());
    ::_exit(127);
  }
  ::close(out[1]);
  oom_child_result r;
  char buf[4096];
  for (ssize_t n; (n = ::read(out[0], buf, sizeof buf)) > 0;) r.output.append(buf, static_cast<std::size_t>(n));
  ::close(out[0]);
  REQUIRE(::waitpid(child, &r.status, 0) == child);
  return r;
}

// --- IPC ----------------------------------------------------------------------------------------

namespace ipc = streamalloc::detail::ipc;

/// A socket name of this process's own, in Linux's abstract namespace.
std::string oom_socket_name(const char* what, int n) {
  return "@streamalloc-host-oom-" + std::to_string(::getpid()) + "-" + what + "-" + std::to_string(n);
}

/// One request and its answer over a raw connection to an exporter, as an importer would; the
/// answer's size (0: the exporter closed the session).
std::size_t oom_round_trip(const unique_fd& c, const ipc::request& r, void* reply, std::size_t capacity) {
  ipc::send_message(c.get(), &r, sizeof r);
  pollfd p{c.get(), POLLIN, 0};
  if (::poll(&p, 1, 5000) != 1) return 0;  // no answer in 5 s: as good as gone
  return ipc::receive_message(c.get(), reply, capacity);
}

/// A fetch the exporter refuses (no import lies on that chunk): a round trip that needs no
/// host memory on the exporter's side, to know it has taken the session in.
bool oom_exporter_answers(const unique_fd& c) {
  ipc::request r;
  r.what = ipc::kind::fetch;
  r.id = 12345;
  ipc::fetch_reply f;
  return oom_round_trip(c, r, &f, sizeof f) == sizeof f && f.refusal.refused();
}

/// Waits (5 s at most) until `p` has no importer connected.
bool oom_no_importers(const pool& p) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (importers_of(p) != 0) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

/// An exporting process's side of the protocol, played by a thread of this test, for the
/// importer's tests: the real exporter answers a hello with the device's UUID, which the fake
/// driver does not model. Every chunk it describes is the same physical memory (the importer
/// keys chunks by the id the exporter gives; the fake driver maps one allocation at many
/// addresses). It counts what it granted and what the importer gave back.
///
/// The fake driver imports a descriptor only by the number it had when exported (one process,
/// no real sharing), and a descriptor received with a message gets the lowest number free in
/// the receiving process. So the memory is exported under many numbers first, all closed again:
/// whichever the importer's copy gets is one of them.
class oom_fake_exporter {
 public:
  explicit oom_fake_exporter(int n)
      : path_(oom_socket_name("exporter", n)),
        granularity_(allocation_granularity(memory_location::device(0))),
        memory_(granularity_, memory_location::device(0), allocation_options{shareable_handle_type::posix_fd}) {
    {
      std::vector<unique_fd> numbers;
      for (int i = 0; i < 32; ++i) numbers.push_back(memory_.export_to_fd());
    }
    listener_ = ipc::listen_at(path_);
    thread_ = std::thread([this] { serve(); });
  }
  ~oom_fake_exporter() {
    stop_ = true;
    thread_.join();
  }
  oom_fake_exporter(const oom_fake_exporter&) = delete;
  oom_fake_exporter& operator=(const oom_fake_exporter&) = delete;

  [[nodiscard]] const std::string& path() const { return path_; }
  [[nodiscard]] std::size_t chunk_size() const { return granularity_; }
  /// A descriptor of `bytes` at the start of chunk `chunk`.
  [[nodiscard]] ipc_descriptor descriptor(std::uint64_t chunk, std::size_t bytes) const {
    ipc_descriptor d;
    d.magic = ipc::magic;
    d.version = ipc::version;
    d.pool_id = pool_id;
    d.address = chunk;
    d.size = bytes;
    return d;
  }
  /// Imports granted, and releases received for them.
  [[nodiscard]] std::size_t granted() const { return granted_.load(); }
  [[nodiscard]] std::size_t released() const { return released_.load(); }
  /// Waits (5 s at most) until every import granted was released but `held`.
  bool all_released_but(std::size_t held) const {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (granted() - released() != held) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }

  static constexpr std::array<std::uint64_t, 2> pool_id{0x5eed, 0xf00d};

 private:
  void serve() {
    test_support::allocations_exempt = true;  // the exporter is another process: its memory is not short
    unique_fd session;
    auto reply = std::make_unique<ipc::import_reply>();
    std::uint64_t next_id = 0;
    while (!stop_) {
      pollfd p{session ? session.get() : listener_.get(), POLLIN, 0};
      if (::poll(&p, 1, 10) != 1) continue;
      if (!session) {
        session = unique_fd(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
        continue;
      }
      ipc::request r;
      if (ipc::receive_message(session.get(), &r, sizeof r) != sizeof r) {
        session.reset();
        continue;
      }
      switch (r.what) {
        case ipc::kind::hello: {
          ipc::hello_reply h;
          h.pool_id = pool_id;
          h.location_kind = static_cast<std::int32_t>(memory_location::kind::device);
          h.location_id = 0;
          h.granularity = granularity_;
          h.handle_types = static_cast<std::uint32_t>(shareable_handle_type::posix_fd);
          ipc::send_message(session.get(), &h, sizeof h);
          break;
        }
        case ipc::kind::import: {
          reply->clear();
          reply->count = 1;
          reply->pieces[0] = ipc::piece{r.descriptor.address, granularity_, 0, r.descriptor.size};
          reply->id = ++next_id;
          ++granted_;
          ipc::send_message(session.get(), reply.get(), reply->bytes());
          break;
        }
        case ipc::kind::fetch: {
          ipc::fetch_reply f;
          f.handle_type = static_cast<std::uint32_t>(shareable_handle_type::posix_fd);
          const unique_fd fd = memory_.export_to_fd();
          ipc::send_message(session.get(), &f, sizeof f, fd.get());
          break;
        }
        case ipc::kind::release:
          ++released_;
          break;
      }
    }
  }

  std::string path_;
  std::size_t granularity_;
  physical_allocation memory_;
  unique_fd listener_;
  std::atomic<bool> stop_{false};
  std::atomic<std::size_t> granted_{0}, released_{0};
  std::thread thread_;
};

/// Imports and ends one allocation with host memory, so that the driver entry points of an
/// import and of its end have been looked up (see oom_warm_up).
void oom_warm_up_import(oom_fake_exporter& x, imported_pool& from, std::uint64_t chunk) {
  ipc_handle h = from.import_pointer(x.descriptor(chunk, MiB));
  REQUIRE(h);
  h.reset();
  (void)cu::cuCtxSynchronize_nothrow();
}

/// Does importing `d` throw std::bad_alloc when this thread's host allocations fail from the
/// `k`-th on? (Checked outside: doctest's own assertions need host memory.)
bool oom_import_fails(imported_pool& from, const ipc_descriptor& d, int k) {
  const test_support::refusing_allocations oom(k);  // this thread's too: the import runs here
  try {
    (void)from.import_pointer(d);
  } catch (const std::bad_alloc&) {
    return true;
  }
  return false;
}

}  // namespace

TEST_SUITE("host_oom_graphs") {

// --- the graph reaper: a graph's memory goes back with no host memory -------------------------

// pool_core::release_graph made a block the graph left live an ordinary live allocation through
// live_.insert, which needs host memory (a shard of the live table is allocated on its first
// insert, and grows); when that failed the block was dropped: its owner's valid free was refused
// as a bad free, and its memory held until the pool closed. Such a block is now listed through
// itself, where deallocate finds it.
TEST_CASE("a graph's live allocation stays freeable when the reaper has no host memory to index it") {
  pool p(pool_properties{.release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  stream s;
  void* sync = oom_make_host_state(p);
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  void* kept = p.allocate(MiB, s.ref());  // the capture leaves it live
  captured_graph g = end_capture(s.ref());
  p.deallocate_sync(sync);
  REQUIRE(p.statistics().graphs == 1);
  oom_release_on_reaper(g);  // every allocation of the reaper fails
  const pool_statistics after = p.statistics();
  CHECK(after.graphs == 0);
  CHECK(after.graph_reserved_current == 0);
  CHECK(after.live_allocations == 1);
  CHECK(after.used_current == MiB);
  CHECK_NOTHROW(p.deallocate(kept, s.ref()));
  s.synchronize();
  p.trim_to(0);
  const pool_statistics end = p.statistics();
  CHECK(end.live_allocations == 0);
  CHECK(end.used_current == 0);
  CHECK(end.reserved_current == 0);
}

// pool_core::release_graph counted a block the graph left live in the synchronous pseudo-stream's
// state, made there on first use, which needs host memory; when that failed the block was not
// counted, and its free later subtracted what was never added (used_current and
// live_allocations short for the pool's life). It is now counted without a state.
TEST_CASE("a graph's live allocation is counted when the reaper has no host memory for its accounting") {
  pool p(pool_properties{.release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  stream s;
  // The graph takes this chunk, free again, so the block it leaves live lands where a live
  // block was: its live-table slot needs no host memory, only the accounting does.
  void* before = p.allocate(MiB, s.ref());
  p.deallocate(before, s.ref());
  s.synchronize();
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  void* kept = p.allocate(MiB, s.ref());
  captured_graph g = end_capture(s.ref());
  REQUIRE(kept == before);
  oom_release_on_reaper(g);
  const pool_statistics after = p.statistics();
  CHECK(after.graphs == 0);
  CHECK(after.live_allocations == 1);
  CHECK(after.used_current == MiB);
  REQUIRE_NOTHROW(p.deallocate(kept, s.ref()));
  void* next = p.allocate(MiB, s.ref());
  CHECK(p.statistics().live_allocations == 1);
  CHECK(p.statistics().used_current == MiB);
  p.deallocate(next, s.ref());
  s.synchronize();
  CHECK(p.statistics().used_current == 0);
}

// pool_core::release_graph (and release_import) listed memory allocated outside a capture and
// freed inside it on a raw stream in awaiting_device_idle_, whose entry needs host memory; when
// it could not be made the block was in no list, never reused, its chunk never released. Such a
// block is now listed through itself, and freed by the same device-wide synchronization.
TEST_CASE("memory a graph took over from a raw stream comes back after a device-wide synchronization, "
          "whatever host memory the reaper had") {
  pool p(pool_properties{.max_size = 2 * MiB, .release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  CUstream raw = nullptr;
  cu::cuStreamCreateWithPriority(&raw, CU_STREAM_NON_BLOCKING, 0);
  const stream_ref r{reinterpret_cast<cudaStream_t>(raw)};
  stream other;
  void* before = p.allocate(MiB, r);
  cu::cuStreamBeginCapture(raw, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  p.deallocate(before, r);  // allocated outside, freed inside: the graph's now
  captured_graph g = end_capture(r);
  REQUIRE(p.statistics().graphs == 1);
  oom_release_on_reaper(g);
  CHECK(p.statistics().graphs == 0);
  p.synchronize();  // proves the work before the capture done: the memory is free now
  void* whole = nullptr;
  CHECK_NOTHROW(whole = p.allocate(2 * MiB, other.ref()));
  if (whole != nullptr) p.deallocate(whole, other.ref());
  other.synchronize();
  p.trim_to(0);
  CHECK(p.statistics().reserved_current == 0);
  CHECK(cu::cuStreamDestroy_nothrow(raw) == CUDA_SUCCESS);
}

// reset() of a graph_exec hands its end to the reaper in a job it allocates (new (std::nothrow));
// with no host memory it waits for the last launch itself and lets go there (graph_exec.hpp:
// 168-175). Nothing may be left held: the memory is back by the time reset returns, and the
// executable's event is destroyed.
TEST_CASE("a graph_exec destroyed with no host memory at all gives its graph's memory back at once") {
  pool p(pool_properties{.release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  stream s;
  void* sync = oom_make_host_state(p);
  oom_warm_up(p, s);
  const int events = fake_live().events;
  captured_graph g = oom_workspace_graph(p, s);
  p.deallocate_sync(sync);
  graph_exec e(g);
  g.reset();  // e alone holds the memory now
  oom_reaper_ran();  // the graph's user object has ended: e's end is the last
  REQUIRE(p.statistics().graphs == 1);
  REQUIRE(p.statistics().graph_reserved_current == 2 * MiB);
  REQUIRE(fake_live().events == events + 1);  // e's end-of-launch event
  {
    const test_support::refusing_allocations oom;  // every thread's, this one's included
    e.reset();
  }
  // Released inline (a job handed to the reaper would have needed host memory).
  const pool_statistics after = p.statistics();
  CHECK(after.graphs == 0);
  CHECK(after.graph_reserved_current == 0);
  CHECK(after.graph_allocations == 0);
  CHECK(fake_live().events == events);
  CHECK(streamalloc::detail::graph_reaper::instance().outstanding() == 0);
  p.trim_to(0);
  CHECK(p.statistics().reserved_current == 0);
}

// docs/graphs.md: "When the graph goes, its pieces on shared pages are unmapped and their
// addresses go back to the pool; pages no graph maps are released. That step cannot fail ...
// even a process out of host memory loses nothing there." Checked with no host memory on any
// thread: the pages and the pieces' memory go back to the device (addresses that cannot be given
// back for lack of memory stay reserved, unused, as docs/pool.md says).
TEST_CASE("a graph on a stream's shared pages gives them back with no host memory at all") {
  pool p(pool_properties{.release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  stream s;
  void* sync = oom_make_host_state(p);
  oom_warm_up(p, s);
  captured_graph g = oom_workspace_graph(p, s);
  p.deallocate_sync(sync);
  graph_exec e(g);
  g.reset();
  oom_reaper_ran();  // e's end is the last
  e.launch(s.ref());  // onto s's shared pages
  s.synchronize();
  const int mappings = fake_live().mappings;
  REQUIRE(p.statistics().graphs == 1);
  REQUIRE(p.statistics().graph_reserved_current == 2 * MiB);  // the pages; the pieces' own memory went
  {
    const test_support::refusing_allocations oom;
    e.reset();
  }
  const pool_statistics after = p.statistics();
  CHECK(after.graphs == 0);
  CHECK(after.graph_reserved_current == 0);
  CHECK(fake_live().mappings < mappings);  // the pieces unmapped
  p.trim_to(0);
  CHECK(p.statistics().reserved_current == 0);
  CHECK(fake_live().used_device0 == 0);
  // And the pool goes on: a new allocation maps new memory.
  void* y = p.allocate(MiB, s.ref());
  CHECK(p.statistics().used_current == MiB);
  p.deallocate(y, s.ref());
}

// pool_graph_tie::release evaluated host_key() outside its try, and host_key()'s function-local
// static (the synchronous pseudo-stream's record, ordering().record, which allocates) was made
// by the first call in the process: a program whose graphs allocate but that never frees
// inside a capture nor allocates synchronously made it first on the reaper, and out of host
// memory there std::bad_alloc left a noexcept function (std::terminate). The record is now made
// when a tie is (pool_state::tie_to_graph), and asked inside release()'s try.
TEST_CASE("the reaper's first release in a process survives having no host memory") {
  const oom_child_result r = oom_run_child("host record first made by the reaper");
  INFO(r.output);
  CHECK(r.exited_cleanly());
}

// --- IPC: the exporter -----------------------------------------------------------------------

// exporter::import, out of host memory while booking a granted import in the session, released
// the import's hold on the block while s.imports already held it; the exception then ended the
// session, and drop() released the same hold again: the block's import count wrapped and its
// memory never came back (with two importers, the other's hold was taken instead, and the
// memory reused while that importer mapped it). Now the books are undone and the importer gets
// a refusal naming the lack of host memory, its session kept.
TEST_CASE("an import the exporter cannot book for lack of host memory is given back once") {
  for (int k = 0; k < 8; ++k) {
    INFO("the exporter's allocations fail from the " << k << "-th of the import on");
    pool p(pool_properties{.release_threshold = SIZE_MAX, .chunk_size = 2 * MiB,
                           .handle_types = shareable_handle_type::posix_fd});
    stream s;
    export_pool(p, oom_socket_name("export", k));
    void* a = p.allocate(MiB, s.ref());
    const ipc_descriptor d = export_pointer(p, a);
    unique_fd c = ipc::connect_to(oom_socket_name("export", k));
    REQUIRE(oom_exporter_answers(c));
    std::size_t answered = 0;
    auto reply = std::make_unique<ipc::import_reply>();
    {
      const oom_elsewhere oom(k);
      ipc::request r;
      r.what = ipc::kind::import;
      r.descriptor = d;
      answered = oom_round_trip(c, r, reply.get(), sizeof *reply);
    }
    if (answered != 0 && reply->refusal.refused()) {  // granted, or refused for the lack of host memory
      CHECK(std::string_view(reply->refusal.text).find("out of host memory") != std::string_view::npos);
    }
    c.reset();  // the importer goes: whatever the exporter holds for it is given back
    REQUIRE(oom_no_importers(p));
    p.deallocate(a, s.ref());
    s.synchronize();
    const pool_statistics after = p.statistics();
    CHECK(after.live_allocations == 0);
    CHECK(after.used_current == 0);
    CHECK(after.free_pending == 0);
    p.trim_to(0);
    CHECK(p.statistics().reserved_current == 0);
  }
}

// exporter::serve_one ended the importer's session on any exception, std::bad_alloc included,
// and drop() gave back everything that importer held while it was alive and kept its mappings:
// the exporter then reused memory another process still mapped. Now an import the exporter
// has no host memory for is refused, and the session goes on.
TEST_CASE("an import refused for lack of host memory leaves the importer's other imports held") {
  pool p(pool_properties{.release_threshold = SIZE_MAX, .chunk_size = 2 * MiB,
                         .handle_types = shareable_handle_type::posix_fd});
  stream s;
  const std::string path = oom_socket_name("held", 0);
  export_pool(p, path);
  void* a = p.allocate(MiB, s.ref());
  void* b = p.allocate(MiB, s.ref());
  unique_fd c = ipc::connect_to(path);
  auto reply = std::make_unique<ipc::import_reply>();
  ipc::request r;
  r.what = ipc::kind::import;
  r.descriptor = export_pointer(p, a);
  REQUIRE(oom_round_trip(c, r, reply.get(), sizeof *reply) != 0);
  REQUIRE_FALSE(reply->refusal.refused());  // `a` is imported: the importer maps it
  r.descriptor = export_pointer(p, b);
  {
    const oom_elsewhere oom;
    (void)oom_round_trip(c, r, reply.get(), sizeof *reply);  // refused, or the session ended
  }
  // The importer still maps `a` (it is alive, its socket open): a free here must wait for it.
  p.deallocate(a, s.ref());
  s.synchronize();
  CHECK(p.statistics().free_pending == MiB);
  void* again = p.allocate(MiB, s.ref());
  CHECK(again != a);
  p.deallocate(again, s.ref());
  p.deallocate(b, s.ref());
}

// exporter::serve rebuilt its list of descriptors to poll on each round, and when one more
// importer than ever before had connected, its growth could run out of host memory: the
// std::bad_alloc left the thread function and std::terminate ended the exporting process. The
// list is now a member, with room made as each importer is accepted, and room for the next ahead.
TEST_CASE("an exporter out of host memory when one more importer connects goes on serving") {
  const oom_child_result r = oom_run_child("exporter polls one more importer");
  INFO(r.output);
  CHECK(r.exited_cleanly());
}

// --- IPC: the importer -----------------------------------------------------------------------

// importer::map_import counted an import among a chunk's users before recording the chunk,
// and recorded the import outside its try: out of host memory there, the count was never taken
// back and the chunk stayed mapped for an import that did not exist. Room is now made first,
// the use counted once recorded, and the import recorded inside the try.
TEST_CASE("an import that runs out of host memory leaves its chunk's use count as it was") {
  oom_fake_exporter x(1);
  imported_pool from(x.path());
  oom_warm_up_import(x, from, 100);
  // An import onto a chunk imported already allocates three times (used, e.chunks, the
  // imports_ entry): each is made to fail in turn.
  for (int k = 0; k < 3; ++k) {
    INFO("the importer's allocations fail from the " << k << "-th of the import on");
    // A chunk of its own for each k: one left mapped by a k before is not counted again.
    const std::uint64_t chunk = 1 + static_cast<std::uint64_t>(k);
    const pool_statistics before = from.statistics();
    const int mappings = fake_live().mappings;
    ipc_handle first = from.import_pointer(x.descriptor(chunk, MiB));
    REQUIRE(from.statistics().chunks == before.chunks + 1);
    CHECK(oom_import_fails(from, x.descriptor(chunk, MiB / 2), k));
    CHECK(x.all_released_but(1));  // the exporter was told: it holds only `first` for us
    CHECK(from.statistics().live_allocations == 1);
    first.reset();
    const pool_statistics after = from.statistics();
    CHECK(after.live_allocations == 0);
    CHECK(after.chunks == before.chunks);
    CHECK(after.reserved_current == before.reserved_current);
    CHECK(fake_live().mappings == mappings);
  }
}

// importer::map_import, for a chunk new to this process, out of host memory while recording the
// chunk, read its list of chunks in the catch while the list was still empty (SIGSEGV). The
// catch now names the chunks from the exporter's reply.
TEST_CASE("an import of a new chunk that runs out of host memory while recording it fails cleanly") {
  const oom_child_result r = oom_run_child("importer records a new chunk");
  INFO(r.output);
  CHECK(r.exited_cleanly());
}

// ipc_handle::reset caught the std::bad_alloc of importer::synchronize_accessors (a vector of
// devices) as a lost context and unmapped the import without waiting for the devices. The
// devices are now gathered without allocating, and only a cuda_error counts as a lost context.
TEST_CASE("an import ended without a stream waits for its devices even with no host memory") {
  oom_fake_exporter x(2);
  imported_pool from(x.path());
  from.set_access(memory_location::device(0), access_flags::read_write);
  oom_warm_up_import(x, from, 100);
  stream s;
  ipc_handle h = from.import_pointer(x.descriptor(1, MiB));
  const int mappings = fake_live().mappings;
  streamalloc_test::fake_hold_stream(handle(s), true);  // work on the device still uses the import
  {
    const test_support::refusing_allocations oom;
    h.reset();
  }
  CHECK(fake_live().mappings == mappings - 1);  // unmapped
  // ... only after the device's work finished (a host wait lets the fake's held streams run).
  CHECK(cu::cuStreamQuery_nothrow(handle(s)) == CUDA_SUCCESS);
  streamalloc_test::fake_hold_stream(handle(s), false);
  CHECK(x.all_released_but(0));
}

}  // TEST_SUITE

// The cases oom_run_child runs, each in a process of its own (they do nothing elsewhere).
TEST_SUITE("host_oom_graphs_child") {

TEST_CASE("host record first made by the reaper") {
  if (!oom_in_child()) return;
  // Nothing here makes the synchronous pseudo-stream's record: no synchronous call, no free
  // inside a capture.
  pool p(pool_properties{.release_threshold = SIZE_MAX, .chunk_size = 2 * MiB});
  stream s;
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  void* kept = p.allocate(MiB, s.ref());
  captured_graph g = end_capture(s.ref());
  oom_release_on_reaper(g);
  CHECK(p.statistics().graphs == 0);
  (void)kept;
}

TEST_CASE("exporter polls one more importer") {
  if (!oom_in_child()) return;
  pool p(pool_properties{.release_threshold = SIZE_MAX, .chunk_size = 2 * MiB,
                         .handle_types = shareable_handle_type::posix_fd});
  const std::string path = oom_socket_name("polls", 0);
  export_pool(p, path);
  // Two importers: the exporter polls four descriptors, all its list had room for so far.
  std::vector<unique_fd> importers;
  for (int i = 0; i < 2; ++i) {
    importers.push_back(ipc::connect_to(path));
    REQUIRE(oom_exporter_answers(importers.back()));
  }
  {
    // The session's own allocation succeeds; the poll list's growth is the next.
    const oom_elsewhere oom(1);
    importers.push_back(ipc::connect_to(path));
    CHECK(oom_exporter_answers(importers.back()));
  }
  for (const unique_fd& c : importers) CHECK(oom_exporter_answers(c));
}

TEST_CASE("importer records a new chunk") {
  if (!oom_in_child()) return;
  oom_fake_exporter x(3);
  imported_pool from(x.path());
  oom_warm_up_import(x, from, 100);
  // The host allocations of importing a chunk new here: the driver's, then the importer's books
  // of it (chunks_ entry, used, e.chunks, imports_ entry). Counted once, then failed at e.chunks.
  int before = 1 << 30;
  {
    const test_support::refusing_allocations count(before);
    ipc_handle h = from.import_pointer(x.descriptor(1, MiB));
    before -= test_support::allocations_until_failure;
  }
  const int k = before - 2;
  REQUIRE(k > 0);
  CHECK(oom_import_fails(from, x.descriptor(2, MiB), k));
  CHECK(from.statistics().chunks == 0);
  CHECK(x.all_released_but(0));
}

}  // TEST_SUITE host_oom_graphs_child
