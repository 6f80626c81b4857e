// user_object<T> on a real GPU: T's destructor runs exactly once, on a driver thread, only when
// the last reference is gone, whether CPU wrappers, graphs, clones, executables or work still
// running from a destroyed executable hold it; a reference moved into a graph during stream
// capture; moves, sharing and bad input.
//
// T's destructor reports through a probe: how often it ran, on which thread, and what a flag in
// host-mapped memory held then. The kernels set that flag as their last act after spinning for
// a while, so a destructor that ran while launched work was still running sees it unset. The
// destructor runs asynchronously, so a test waits for it with a bounded poll, and a claim that
// it has not run is checked after giving it time to (wrongly) do so.

#include <streamalloc/stream.hpp>
#include <streamalloc/user_object.hpp>

#include <doctest/doctest.h>

#include "gpu_kernels.cuh"
#include "gpu_support.hpp"

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

using namespace streamalloc;
using namespace streamalloc_test;
using namespace std::chrono_literals;

static_assert(!std::is_copy_constructible_v<user_object<int>> && !std::is_copy_assignable_v<user_object<int>>,
              "a user_object owns one reference: copies are made with share()");
static_assert(std::is_nothrow_move_constructible_v<user_object<int>> &&
              std::is_nothrow_move_assignable_v<user_object<int>>);

namespace {
constexpr unsigned long long long_spin_ns = 200'000'000;  // 200 ms: the host sees the kernel running
constexpr unsigned long long short_spin_ns = 1'000'000;

/// Spins for `spin_ns`, then sets *done (host-mapped memory) as its last act.
__global__ void spin_then_set(int* done, unsigned long long spin_ns) {
  const unsigned long long start = global_ns();
  while (global_ns() - start < spin_ns) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    __nanosleep(1000);
#endif
  }
  __threadfence_system();
  *static_cast<volatile int*>(done) = 1;
  __threadfence_system();
}

/// What T's destructor saw. Probes are never freed: a T that outlives a failed test may still
/// write to its probe, and must not write into freed memory.
struct probe {
  std::atomic<int> destructions{0};
  std::atomic<int> done_at_destruction{-1};  ///< *done when the destructor ran; -1 without a flag
  std::thread::id thread;                    ///< written before `destructions` is incremented
  int* done = nullptr;                       ///< host-mapped flag a kernel sets, or null

  [[nodiscard]] int done_now() const { return *static_cast<volatile const int*>(done); }
};

probe& new_probe() { return *new probe; }

/// A probe with a host-mapped flag, cleared, for kernels to set.
probe& new_probe_with_flag() {
  probe& p = *new probe;
  void* h = nullptr;
  SA_CUDA_REQUIRE(cudaHostAlloc(&h, sizeof(int), cudaHostAllocMapped));
  p.done = static_cast<int*>(h);
  *static_cast<volatile int*>(p.done) = 0;
  return p;
}

int* device_view(int* host_mapped) {
  void* d = nullptr;
  SA_CUDA_REQUIRE(cudaHostGetDevicePointer(&d, host_mapped, 0));
  return static_cast<int*>(d);
}

/// The T held by the user objects under test. Its destructor makes no CUDA call.
struct tracked {
  probe* p;
  int value;
  tracked(probe& pr, int v) : p(&pr), value(v) {}
  tracked(const tracked&) = delete;
  tracked& operator=(const tracked&) = delete;
  ~tracked() {
    if (p->done != nullptr) p->done_at_destruction.store(p->done_now());
    p->thread = std::this_thread::get_id();
    p->destructions.fetch_add(1, std::memory_order_release);
  }
};

/// Waits, up to 10 s, for the destructor's first run.
bool destroyed_within_limit(const probe& p) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (p.destructions.load(std::memory_order_acquire) == 0) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

/// Gives an asynchronous destructor time to run (it runs within microseconds of the release
/// in practice), then says how often it did.
int destructions_after_a_while(const probe& p) {
  std::this_thread::sleep_for(100ms);
  return p.destructions.load(std::memory_order_acquire);
}

/// Waits for the destructor and checks it ran once. Which thread runs it is the driver's
/// choice: measured on the H100 (driver 580), the thread whose release drops the count to zero
/// when that is a CPU release, a driver thread when a graph or executable lets go last.
void require_destroyed_once_elsewhere(probe& p) {
  REQUIRE(destroyed_within_limit(p));
  CHECK(destructions_after_a_while(p) == 1);
  if (p.done != nullptr) {  // read by the destructor, which has run: the flag may go
    CHECK(cudaFreeHost(p.done) == cudaSuccess);
    p.done = nullptr;
  }
}

/// A graph of one kernel that spins for `spin_ns`, then sets `p`'s flag; made by stream capture.
cudaGraph_t spin_graph(cudaStream_t s, probe& p, unsigned long long spin_ns) {
  int* done = device_view(p.done);
  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  spin_then_set<<<1, 1, 0, s>>>(done, spin_ns);
  cudaGraph_t g = nullptr;
  SA_CUDA_REQUIRE(cudaStreamEndCapture(s, &g));
  REQUIRE(g != nullptr);
  return g;
}

cudaGraphExec_t instantiate(cudaGraph_t g) {
  cudaGraphExec_t e = nullptr;
  SA_CUDA_REQUIRE(cudaGraphInstantiate(&e, g, 0));
  REQUIRE(e != nullptr);
  return e;
}

/// The message of the `E` that `fn` threw; otherwise what happened instead.
template <class E>
std::string thrown(auto&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("another exception: ") + e.what();
  }
  return "nothing thrown";
}
}  // namespace

TEST_CASE("a user_object never given to a graph: T is destroyed once, on a driver thread, when the wrapper goes") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  SA_CUDA_REQUIRE(cudaFree(nullptr));
  SUBCASE("by the wrapper's destructor") {
    probe& p = new_probe();
    {
      auto o = user_object<tracked>::make(p, 7);
      REQUIRE(o);
      CHECK(o.handle() != nullptr);
      CHECK(o->value == 7);
      CHECK((*o).p == &p);
      CHECK(o.get() == &*o);
      CHECK(destructions_after_a_while(p) == 0);
    }
    require_destroyed_once_elsewhere(p);
  }
  SUBCASE("by reset(), which leaves it empty; a second reset() does nothing") {
    probe& p = new_probe();
    user_object<tracked> o(std::in_place, p, 8);
    CHECK(o->value == 8);
    o.reset();
    CHECK_FALSE(o);
    CHECK(o.get() == nullptr);
    CHECK(o.handle() == nullptr);
    require_destroyed_once_elsewhere(p);
    o.reset();
    CHECK(destructions_after_a_while(p) == 1);
  }
}

TEST_CASE("moves: the moved-from wrapper is empty; move assignment releases the reference it replaces") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  probe& pa = new_probe();
  probe& pc = new_probe();
  auto a = user_object<tracked>::make(pa, 1);
  const CUuserObject ha = a.handle();
  user_object<tracked> b(std::move(a));
  CHECK_FALSE(a);  // NOLINT(bugprone-use-after-move): what a move leaves is under test
  CHECK(a.get() == nullptr);
  CHECK(a.handle() == nullptr);
  REQUIRE(b);
  CHECK(b.handle() == ha);
  CHECK(b->value == 1);

  auto c = user_object<tracked>::make(pc, 3);
  c = std::move(b);  // c's old object loses its only reference
  CHECK_FALSE(b);    // NOLINT(bugprone-use-after-move)
  CHECK(c.handle() == ha);
  CHECK(c->p == &pa);
  require_destroyed_once_elsewhere(pc);
  CHECK(destructions_after_a_while(pa) == 0);

  user_object<tracked>& alias = c;
  c = std::move(alias);  // self-move keeps the reference
  REQUIRE(c);
  CHECK(c.handle() == ha);
  CHECK(destructions_after_a_while(pa) == 0);

  user_object<tracked> empty;
  CHECK_FALSE(empty);
  c = std::move(empty);  // releases pa's only reference
  CHECK_FALSE(c);
  require_destroyed_once_elsewhere(pa);
}

TEST_CASE("share(): each wrapper holds a reference; T goes with the last") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  probe& p = new_probe();
  auto a = user_object<tracked>::make(p, 5);
  user_object<tracked> b = a.share();
  REQUIRE(b);
  CHECK(b.handle() == a.handle());
  CHECK(b.get() == a.get());
  a.reset();
  CHECK(destructions_after_a_while(p) == 0);
  CHECK(b->value == 5);
  b.reset();
  require_destroyed_once_elsewhere(p);

  user_object<tracked> empty;
  CHECK(thrown<std::logic_error>([&] { (void)empty.share(); }).find("empty") != std::string::npos);
}

TEST_CASE("bad input: a null graph is refused with std::invalid_argument naming the call; the wrapper keeps its reference") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  probe& p = new_probe();
  auto o = user_object<tracked>::make(p, 11);
  const cudaGraph_t null_graph = nullptr;
  const std::string retain = thrown<std::invalid_argument>([&] { o.retain_by(null_graph); });
  CHECK_MESSAGE(retain.find("retain_by") != std::string::npos, retain);
  CHECK_MESSAGE(retain.find("graph is null") != std::string::npos, retain);
  const std::string move = thrown<std::invalid_argument>([&] { (void)std::move(o).move_into(null_graph); });
  CHECK_MESSAGE(move.find("move_into") != std::string::npos, move);
  const std::string release = thrown<std::invalid_argument>([&] { o.release_from(nullptr); });
  CHECK_MESSAGE(release.find("release_from") != std::string::npos, release);
  REQUIRE(o);  // a refused move moved nothing
  CHECK(o->value == 11);
  CHECK(destructions_after_a_while(p) == 0);

  // An empty wrapper has nothing to give a graph: std::logic_error, and not the null-graph one.
  cudaGraph_t g = nullptr;
  SA_CUDA_REQUIRE(cudaGraphCreate(&g, 0));
  user_object<tracked> empty;
  const std::string empty_retain = thrown<std::logic_error>([&] { empty.retain_by(g); });
  CHECK_MESSAGE(empty_retain.find("retain_by: the user_object is empty") != std::string::npos, empty_retain);
  const std::string empty_move = thrown<std::logic_error>([&] { (void)std::move(empty).move_into(g); });
  CHECK_MESSAGE(empty_move.find("move_into: the user_object is empty") != std::string::npos, empty_move);
  SA_CUDA_REQUIRE(cudaGraphDestroy(g));

  o.reset();
  require_destroyed_once_elsewhere(p);
}

TEST_CASE("moved into a graph: T outlives the graph and every executable, until the last launch has finished") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  stream s(0);
  probe& p = new_probe_with_flag();
  cudaGraph_t graph = spin_graph(s.get(), p, long_spin_ns);
  auto o = user_object<tracked>::make(p, 21);
  const CUuserObject h = o.handle();
  tracked* t = std::move(o).move_into(graph);
  CHECK_FALSE(o);  // NOLINT(bugprone-use-after-move): the reference went into the graph
  CHECK(o.handle() == nullptr);
  REQUIRE(t != nullptr);
  CHECK(t->value == 21);
  CHECK(h != nullptr);

  cudaGraphExec_t first = instantiate(graph);
  cudaGraphExec_t second = instantiate(graph);
  SA_CUDA_REQUIRE(cudaGraphDestroy(graph));
  CHECK(destructions_after_a_while(p) == 0);  // both executables hold references
  SA_CUDA_REQUIRE(cudaGraphExecDestroy(second));
  CHECK(destructions_after_a_while(p) == 0);  // `first` still does
  CHECK(t->value == 21);

  SA_CUDA_REQUIRE(cudaGraphLaunch(first, s.get()));
  SA_CUDA_REQUIRE(cudaGraphExecDestroy(first));  // the last reference, while the launch runs
  REQUIRE_MESSAGE(p.done_now() == 0, "the kernel finished before the test could look: the spin is too short");
  require_destroyed_once_elsewhere(p);
  CHECK_MESSAGE(p.done_at_destruction.load() == 1, "T was destroyed while work launched from its graph ran");
  s.synchronize();
  CHECK(destructions_after_a_while(p) == 1);
}

TEST_CASE("an executable outliving its graph keeps T alive across launches") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  stream s(0);
  probe& p = new_probe_with_flag();
  cudaGraph_t graph = spin_graph(s.get(), p, short_spin_ns);
  tracked* t = user_object<tracked>::make(p, 31).move_into(graph);  // a temporary: an rvalue already
  cudaGraphExec_t exec = instantiate(graph);
  SA_CUDA_REQUIRE(cudaGraphDestroy(graph));
  CHECK(destructions_after_a_while(p) == 0);
  for (int launch = 0; launch < 3; ++launch) {
    *static_cast<volatile int*>(p.done) = 0;
    SA_CUDA_REQUIRE(cudaGraphLaunch(exec, s.get()));
    s.synchronize();
    CHECK(p.done_now() == 1);  // the launch ran
    CHECK(destructions_after_a_while(p) == 0);
    CHECK(t->value == 31);
  }
  SA_CUDA_REQUIRE(cudaGraphExecDestroy(exec));
  require_destroyed_once_elsewhere(p);
}

TEST_CASE("a clone holds references of its own, and so do the executables made from it") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  stream s(0);
  probe& p = new_probe_with_flag();
  cudaGraph_t graph = spin_graph(s.get(), p, long_spin_ns);
  (void)user_object<tracked>::make(p, 41).move_into(graph);
  cudaGraph_t clone = nullptr;
  SA_CUDA_REQUIRE(cudaGraphClone(&clone, graph));
  SA_CUDA_REQUIRE(cudaGraphDestroy(graph));
  CHECK(destructions_after_a_while(p) == 0);  // the clone holds a reference

  cudaGraphExec_t exec = instantiate(clone);
  SA_CUDA_REQUIRE(cudaGraphDestroy(clone));
  CHECK(destructions_after_a_while(p) == 0);  // the clone's executable holds one

  SA_CUDA_REQUIRE(cudaGraphLaunch(exec, s.get()));
  SA_CUDA_REQUIRE(cudaGraphExecDestroy(exec));
  REQUIRE(p.done_now() == 0);
  require_destroyed_once_elsewhere(p);
  CHECK(p.done_at_destruction.load() == 1);
  s.synchronize();
}

TEST_CASE("retain_by: the graph takes a reference of its own; T goes when both the wrapper and the graph have") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  cudaGraph_t graph = nullptr;
  SUBCASE("the wrapper goes first") {
    probe& p = new_probe();
    SA_CUDA_REQUIRE(cudaGraphCreate(&graph, 0));
    auto o = user_object<tracked>::make(p, 51);
    o.retain_by(graph);
    REQUIRE(o);
    o.reset();
    CHECK(destructions_after_a_while(p) == 0);
    SA_CUDA_REQUIRE(cudaGraphDestroy(graph));
    require_destroyed_once_elsewhere(p);
  }
  SUBCASE("the graph goes first") {
    probe& p = new_probe();
    SA_CUDA_REQUIRE(cudaGraphCreate(&graph, 0));
    auto o = user_object<tracked>::make(p, 52);
    o.retain_by(graph);
    SA_CUDA_REQUIRE(cudaGraphDestroy(graph));
    CHECK(destructions_after_a_while(p) == 0);
    CHECK(o->value == 52);
    o.reset();
    require_destroyed_once_elsewhere(p);
  }
  SUBCASE("release_from takes the graph's reference back: the wrapper's is then the last") {
    probe& p = new_probe();
    SA_CUDA_REQUIRE(cudaGraphCreate(&graph, 0));
    auto o = user_object<tracked>::make(p, 53);
    o.retain_by(graph);
    o.retain_by(graph);  // two references, one to take back
    o.release_from(graph);
    o.reset();
    CHECK(destructions_after_a_while(p) == 0);  // the graph still holds one
    SA_CUDA_REQUIRE(cudaGraphDestroy(graph));
    require_destroyed_once_elsewhere(p);
  }
  SUBCASE("release_from of the graph's only reference: the graph outlives T") {
    probe& p = new_probe();
    SA_CUDA_REQUIRE(cudaGraphCreate(&graph, 0));
    auto o = user_object<tracked>::make(p, 54);
    o.retain_by(graph);
    o.release_from(graph);
    o.reset();
    require_destroyed_once_elsewhere(p);
    SA_CUDA_REQUIRE(cudaGraphDestroy(graph));  // holds nothing: no second destruction
    CHECK(destructions_after_a_while(p) == 1);
  }
}

TEST_CASE("moved into the graph being captured (cudaStreamGetCaptureInfo): the captured graph and its executable own T") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  stream s(0);
  probe& p = new_probe_with_flag();
  int* done = device_view(p.done);

  SA_CUDA_REQUIRE(cudaStreamBeginCapture(s.get(), cudaStreamCaptureModeGlobal));
  // Made while the capture runs, as a library called under capture would.
  auto o = user_object<tracked>::make(p, 61);
  spin_then_set<<<1, 1, 0, s.get()>>>(done, long_spin_ns);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t capturing = nullptr;
  SA_CUDA_REQUIRE(cudaStreamGetCaptureInfo(s.get(), &status, nullptr, &capturing));
  REQUIRE(status == cudaStreamCaptureStatusActive);
  REQUIRE(capturing != nullptr);
  tracked* t = std::move(o).move_into(capturing);
  CHECK_FALSE(o);  // NOLINT(bugprone-use-after-move)
  cudaGraph_t graph = nullptr;
  SA_CUDA_REQUIRE(cudaStreamEndCapture(s.get(), &graph));
  REQUIRE(graph != nullptr);
  CHECK(destructions_after_a_while(p) == 0);  // the graph the capture returned owns T
  CHECK(t->value == 61);

  cudaGraphExec_t exec = instantiate(graph);
  SA_CUDA_REQUIRE(cudaGraphDestroy(graph));
  CHECK(destructions_after_a_while(p) == 0);
  SA_CUDA_REQUIRE(cudaGraphLaunch(exec, s.get()));
  SA_CUDA_REQUIRE(cudaGraphExecDestroy(exec));
  REQUIRE(p.done_now() == 0);
  require_destroyed_once_elsewhere(p);
  CHECK(p.done_at_destruction.load() == 1);
  s.synchronize();
}

TEST_CASE("threads that never made a CUDA call: made and released on one; released on one") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  SUBCASE("made and released there") {
    probe& p = new_probe();
    std::string failure;
        std::thread([&] {
      try {
        auto o = user_object<tracked>::make(p, 71);
        if (!o || o->value != 71) failure = "the new user_object does not hold the T";
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }).join();
    CHECK_MESSAGE(failure.empty(), failure);
    require_destroyed_once_elsewhere(p);
  }
  SUBCASE("made here, the last reference released there") {
    probe& p = new_probe();
    auto o = user_object<tracked>::make(p, 72);
        std::thread([held = std::move(o)]() mutable {
      held.reset();  // no context current on this thread
    }).join();
    require_destroyed_once_elsewhere(p);
  }
}

TEST_CASE("a T whose constructor throws: the exception propagates, and no user object is made") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  struct refuses {
    explicit refuses(int) { throw std::runtime_error("refused to be built"); }
  };
  CHECK(thrown<std::runtime_error>([] { (void)user_object<refuses>::make(1); }) == "refused to be built");
}
