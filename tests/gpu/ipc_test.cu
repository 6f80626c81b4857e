// Pools shared across processes (ipc.hpp), on one GPU: an exporter (this process) and
// importers (this binary started again as `--child ipc_importer ...`), data written and checked
// both ways with interprocess events; allocations made after the export; an importer killed
// with SIGKILL while it holds memory; bad descriptors of every kind.

#include <streamalloc/ipc.hpp>
#include <streamalloc/streamalloc.hpp>

#include <doctest/doctest.h>

#include "child_process.hpp"
#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

using namespace streamalloc;
using namespace streamalloc_test;

namespace {

constexpr std::size_t small_bytes = 4 * MiB;
constexpr std::size_t big_bytes = 200 * MiB;  // larger than a chunk: a chunk of its own
constexpr long long spin_cycles = 400'000'000;  // about 200 ms: the reader must really wait

/// What the exporter leaves for its importers (a file: descriptors travel by any means).
struct blackboard {
  ipc_descriptor x, y, big, stale;
  ipc_event_handle ready, done[2];
};

pool_properties shareable() {
  pool_properties p;
  p.location = memory_location::device(0);
  p.handle_types = shareable_handle_type::posix_fd;
  return p;
}

std::string unique_name(const char* what) {
  return "@streamalloc-test-" + std::to_string(::getpid()) + "-" + what;
}

void write_board(const std::string& path, const blackboard& b) {
  FILE* f = std::fopen(path.c_str(), "wb");
  REQUIRE(f != nullptr);
  REQUIRE(std::fwrite(&b, sizeof b, 1, f) == 1);
  std::fclose(f);
}
blackboard read_board(const char* path) {
  blackboard b{};
  FILE* f = std::fopen(path, "rb");
  if (f == nullptr || std::fread(&b, sizeof b, 1, f) != 1) std::exit(3);
  std::fclose(f);
  return b;
}

bool wait_until(const std::function<bool()>& done) {
  for (int i = 0; i < 500; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

#define CHILD_REQUIRE(cond)                                                 \
  do {                                                                      \
    if (!(cond)) {                                                          \
      std::fprintf(stderr, "importer: %s failed (line %d)\n", #cond, __LINE__); \
      return 10;                                                            \
    }                                                                       \
  } while (0)

template <class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("(not invalid_argument) ") + e.what();
  }
  return "(nothing thrown)";
}

// --- the importers -------------------------------------------------------------------------------

// args: socket, blackboard, index (0 or 1). Checks x after the exporter's ready event, writes
// its half of y (slowly) and records done[index]; releases both in stream order.
int importer_main(int argc, char** argv) {
  if (argc != 3) return 2;
  const blackboard b = read_board(argv[1]);
  const int index = std::atoi(argv[2]);
  imported_pool from(argv[0]);
  CHILD_REQUIRE(from.device() == 0);
  CHILD_REQUIRE(from.access(memory_location::device(0)) == access_flags::read_write);
  ipc_handle x = from.import_pointer(b.x);
  ipc_handle y = from.import_pointer(b.y);
  ipc_handle big = from.import_pointer(b.big);
  CHILD_REQUIRE(x.size() == small_bytes && big.size() == big_bytes);
  CHILD_REQUIRE(from.statistics().live_allocations == 3);
  CHILD_REQUIRE(from.statistics().used_current == 2 * small_bytes + big_bytes);
  event ready = event::import_ipc(b.ready);
  event done = event::import_ipc(b.done[index]);
  stream s(0);
  s.wait(ready);  // the exporter's slow fill of x and big
  const auto bad_x = mismatches_on(x.get(), small_bytes, 11, s.get());
  const auto bad_big = mismatches_on(big.get(), big_bytes, 13, s.get());
  std::fprintf(stderr, "importer %d: x %llu and big %llu words wrong\n", index, bad_x, bad_big);
  CHILD_REQUIRE(bad_x == 0 && bad_big == 0);
  slow_fill_kernel<<<64, 256, 0, s.get()>>>(y.as<std::uint32_t>() + index * (small_bytes / 8), small_bytes / 8,
                                            100 + index, spin_cycles);
  done.record(s);
  x.release(s);
  y.release(s);
  std::printf("recorded\n");
  std::fflush(stdout);
  big.reset();  // the destructor's way: waits for the device
  s.synchronize();
  return 0;
}
register_child importer_child("ipc_importer", importer_main);

// args: socket, blackboard. Imports big, says so, then holds it until killed.
int holder_main(int argc, char** argv) {
  if (argc != 2) return 2;
  const blackboard b = read_board(argv[1]);
  imported_pool from(argv[0]);
  ipc_handle big = from.import_pointer(b.big);
  stream s(0);
  fill_async(big.get(), big_bytes, 21, s.get());  // its own writes into the exporter's memory
  s.synchronize();
  std::printf("imported\n");
  std::fflush(stdout);
  for (;;) ::pause();
}
register_child holder_child("ipc_holder", holder_main);

// args: socket, blackboard. Every bad descriptor refused with a reason; nothing held after.
int hostile_main(int argc, char** argv) {
  if (argc != 2) return 2;
  const blackboard b = read_board(argv[1]);
  imported_pool from(argv[0]);
  ipc_descriptor foreign = b.x;
  foreign.pool_id[0] ^= 1;
  ipc_descriptor forged = b.x;
  forged.size = b.x.size * 2;
  ipc_descriptor inside = b.x;
  inside.address += 256;
  ipc_descriptor garbage{};
  std::memset(static_cast<void*>(&garbage), 0x5a, sizeof garbage);
  const std::string msgs[] = {
      refusal([&] { (void)from.import_pointer(foreign); }),
      refusal([&] { (void)from.import_pointer(b.stale); }),
      refusal([&] { (void)from.import_pointer(forged); }),
      refusal([&] { (void)from.import_pointer(inside); }),
      refusal([&] { (void)from.import_pointer(garbage); }),
      refusal([&] { imported_pool nowhere("@streamalloc-nobody-listens-here"); }),
  };
  const char* expected[] = {"foreign", "stale", "forged", "stale", "not a descriptor", "no exporting pool"};
  for (std::size_t i = 0; i < std::size(msgs); ++i) {
    std::fprintf(stderr, "hostile: %s\n", msgs[i].c_str());
    CHILD_REQUIRE(msgs[i].find(expected[i]) != std::string::npos);
  }
  CHILD_REQUIRE(from.statistics().live_allocations == 0);
  // After the refusals the connection still works.
  ipc_handle x = from.import_pointer(b.x);
  stream s(0);
  s.wait(event::import_ipc(b.ready));  // the exporter's slow fill of x
  CHILD_REQUIRE(mismatches_on(x.get(), small_bytes, 11, s.get()) == 0);
  std::printf("ok\n");
  std::fflush(stdout);
  // Wait for the exporter to close its pool, then find it gone.
  char c;
  if (::read(STDIN_FILENO, &c, 1) != 1) return 4;
  const std::string gone = refusal([&] { (void)from.import_pointer(b.y); });
  std::fprintf(stderr, "hostile: %s\n", gone.c_str());
  CHILD_REQUIRE(gone.find("is gone") != std::string::npos);
  CHILD_REQUIRE(mismatches_on(x.get(), small_bytes, 11, s.get()) == 0);  // still mapped: the memory lives on
  return 0;
}
register_child hostile_child("ipc_hostile", hostile_main);

/// The exporting side common to the cases: a pool exported at a fresh name, x and big filled
/// slowly (seed 11, 13) with `ready` recorded after, y for the importers, and a stale descriptor.
struct exporter_fixture {
  pool p{shareable()};
  stream s{0};
  std::string socket = unique_name("pool");
  std::string board_path;
  void *x = nullptr, *y = nullptr, *big = nullptr;
  event ready = event::interprocess();
  event done[2] = {event::interprocess(), event::interprocess()};
  blackboard board{};

  exporter_fixture() {
    export_pool(p, socket);
    // Everything allocated after the export: chunks no importer has seen yet.
    x = p.allocate(small_bytes, s);
    y = p.allocate(small_bytes, s);
    big = p.allocate(big_bytes, s);
    void* gone = p.allocate(4096, s);
    board.stale = export_pointer(p, gone);
    p.deallocate(gone, s);
    slow_fill_kernel<<<64, 256, 0, s.get()>>>(static_cast<std::uint32_t*>(x), small_bytes / 4, 11, spin_cycles);
    fill_async(big, big_bytes, 13, s.get());
    ready.record(s);
    board.x = export_pointer(p, x);
    board.y = export_pointer(p, y);
    board.big = export_pointer(p, big);
    board.ready = ready.export_ipc();
    board.done[0] = done[0].export_ipc();
    board.done[1] = done[1].export_ipc();
    char name[] = "/tmp/streamalloc-ipc-XXXXXX";
    const int fd = ::mkstemp(name);
    REQUIRE(fd >= 0);
    ::close(fd);
    board_path = name;
    write_board(board_path, board);
  }
  ~exporter_fixture() { ::unlink(board_path.c_str()); }
};

}  // namespace

TEST_CASE("an exporter and two importers: data both ways, ordered by interprocess events") {
  exporter_fixture f;
  piped_child a("ipc_importer", {f.socket, f.board_path, "0"});
  piped_child b("ipc_importer", {f.socket, f.board_path, "1"});
  CHECK(a.line() == "recorded");
  CHECK(b.line() == "recorded");
  // Their slow fills of y are still running: only the events order this read after them.
  f.s.wait(f.done[0]);
  f.s.wait(f.done[1]);
  const auto y = static_cast<std::uint32_t*>(f.y);
  CHECK(mismatches_on(y, small_bytes / 2, 100, f.s.get()) == 0);
  CHECK(mismatches_on(y + small_bytes / 8, small_bytes / 2, 101, f.s.get()) == 0);
  CHECK(a.wait() == 0);
  CHECK(b.wait() == 0);
  CHECK(wait_until([&] { return importers_of(f.p) == 0; }));
  // Both gone: everything is the exporter's again.
  f.p.deallocate(f.x, f.s);
  f.p.deallocate(f.y, f.s);
  f.p.deallocate(f.big, f.s);
  f.s.synchronize();
  f.p.trim_to(0);
  CHECK(f.p.statistics().reserved_current == 0);
}

TEST_CASE("an importer killed while it holds memory: the exporter keeps working and gets it back") {
  exporter_fixture f;
  piped_child h("ipc_holder", {f.socket, f.board_path});
  REQUIRE(h.line() == "imported");
  CHECK(importers_of(f.p) == 1);
  // Freed here while imported: neither reused nor released.
  f.p.deallocate(f.big, f.s);
  f.s.synchronize();
  CHECK(f.p.statistics().free_pending >= big_bytes);
  void* again = f.p.allocate(big_bytes, f.s);
  CHECK(again != f.big);
  f.p.trim_to(0);
  CHECK(f.p.statistics().reserved_current >= 2 * big_bytes);
  // The holder wrote seed 21 into it: its memory is still there for it.
  ::kill(h.pid, SIGKILL);
  CHECK(h.wait() == 128 + SIGKILL);
  CHECK(wait_until([&] { return importers_of(f.p) == 0; }));
  f.s.synchronize();
  CHECK(f.p.statistics().free_pending < big_bytes);  // released back into the pool
  f.p.deallocate(again, f.s);
  f.p.deallocate(f.x, f.s);
  f.p.deallocate(f.y, f.s);
  f.s.synchronize();
  f.p.trim_to(0);
  CHECK(f.p.statistics().reserved_current == 0);
  // Still exporting and working.
  void* more = f.p.allocate(small_bytes, f.s);
  fill_async(more, small_bytes, 5, f.s.get());
  CHECK(mismatches_on(more, small_bytes, 5, f.s.get()) == 0);
  CHECK_NOTHROW((void)export_pointer(f.p, more));
  f.p.deallocate(more, f.s);
}

TEST_CASE("bad descriptors are refused with reasons; the exporter is unaffected; a closed pool is gone") {
  exporter_fixture f;
  piped_child h("ipc_hostile", {f.socket, f.board_path});
  CHECK(h.line() == "ok");
  const auto stats = f.p.statistics();
  CHECK(stats.live_allocations == 3);
  f.s.synchronize();
  f.p.close();
  h.say("x");
  CHECK(h.wait() == 0);
}

TEST_CASE("exporting: bad pools, pointers and events are refused with reasons") {
  pool plain({.location = memory_location::device(0)});
  stream s(0);
  CHECK(refusal([&] { export_pool(plain, unique_name("plain")); }).find("without handle types") != std::string::npos);
  void* p = plain.allocate(4096, s);
  CHECK(refusal([&] { (void)export_pointer(plain, p); }).find("not exported") != std::string::npos);
  plain.deallocate(p, s);

  pool shared(shareable());
  const std::string name = unique_name("twice");
  export_pool(shared, name);
  CHECK(refusal([&] { export_pool(shared, name); }).find("already") != std::string::npos);
  pool other(shareable());
  CHECK(refusal([&] { export_pool(other, name); }).find("already") != std::string::npos);
  void* q = shared.allocate(8192, s);
  CHECK(refusal([&] { (void)export_pointer(shared, static_cast<char*>(q) + 256); }).find("inside") !=
        std::string::npos);
  CHECK(refusal([&] { (void)export_pointer(shared, p); }).find("not allocated from this pool") != std::string::npos);
  const ipc_descriptor d1 = export_pointer(shared, q);
  const ipc_descriptor d2 = export_pointer(shared, q);
  CHECK(std::memcmp(&d1, &d2, sizeof d1) == 0);
  shared.deallocate(q, s);

  event plain_event;
  CHECK(refusal([&] { (void)plain_event.export_ipc(); }).find("interprocess") != std::string::npos);
  ipc_event_handle nothing{};
  CHECK_THROWS((void)event::import_ipc(nothing));
}
