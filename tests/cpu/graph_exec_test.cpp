// graph_exec against the fake driver's model of graphs and user objects: the executable is
// instantiated without streamalloc's user objects and holds the graph memory itself, until it
// is reset and its last launch is known finished; relaunching with allocations of the last
// launch still live is refused unless the executable frees them itself. The GPU test
// (tests/gpu/graph_exec_test.cu) checks the same with real kernels and memory.

#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/graph_exec.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>

using namespace streamalloc;
namespace cu = streamalloc::detail::cu;
using streamalloc_test::fake_graphs;
using streamalloc_test::fake_quiesce;
using streamalloc_test::reaper_idle;
using streamalloc_test::fake_user_object_refs;
using streamalloc_test::handle;
using streamalloc_test::MiB;

namespace {
/// Captures on `s` one allocation of `bytes` from `p`, freed in the graph when `free_inside`.
captured_graph capture_one(pool& p, stream& s, std::size_t bytes, bool free_inside, void** out = nullptr) {
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  void* x = p.allocate(bytes, s.ref());
  if (free_inside) p.deallocate(x, s.ref());
  if (out != nullptr) *out = x;
  return end_capture(s.ref());
}

/// The user object holding `g`'s memory.
CUuserObject tie_object(const captured_graph& g) {
  REQUIRE(detail::ties_of(g).size() == 1);
  return detail::ties_of(g).front()->object;
}
}  // namespace

TEST_SUITE("graph_exec") {

TEST_CASE("the executable holds no user object; the memory stays until it is reset") {
  pool p;
  stream s;
  captured_graph g = capture_one(p, s, MiB, true);
  CHECK(g.graph_memory_holds() == 1);
  const CUuserObject o = tie_object(g);
  CHECK(fake_user_object_refs(o) == 1);  // the graph's
  graph_exec e(g);
  CHECK(e.graph_memory_holds() == 1);
  CHECK(fake_user_object_refs(o) == 1);  // still only the graph's: not the executable's
  const auto launches = fake_graphs().launches;
  e.launch(s.ref());
  e.launch(s.ref());  // freed inside: relaunching is fine
  CHECK(fake_graphs().launches == launches + 2);
  g.reset();
  fake_quiesce();
  CHECK(p.statistics().graphs == 1);  // the graph is gone; e holds its memory
  e.reset();
  CHECK(!e);
  REQUIRE(reaper_idle());
  CHECK(p.statistics().graphs == 0);
  CHECK(p.statistics().graph_reserved_current == 0);
}

TEST_CASE("a raw instantiation keeps the user object; both hold the memory") {
  pool p;
  stream s;
  captured_graph g = capture_one(p, s, MiB, true);
  const CUuserObject o = tie_object(g);
  CUgraphExec raw = nullptr;
  cu::cuGraphInstantiateWithFlags(&raw, g.get(), 0);
  CHECK(fake_user_object_refs(o) == 2);
  graph_exec by_handle(g.get());  // instantiated from the bare graph: keeps the user object
  CHECK(by_handle.graph_memory_holds() == 0);
  CHECK(fake_user_object_refs(o) == 3);
  graph_exec e(g);
  CHECK(fake_user_object_refs(o) == 3);
  g.reset();
  cu::cuGraphExecDestroy(raw);
  by_handle.reset();
  fake_quiesce();
  CHECK(p.statistics().graphs == 1);
  graph_exec moved = std::move(e);
  CHECK(!e);
  CHECK(moved.graph_memory_holds() == 1);
  moved.reset();
  REQUIRE(reaper_idle());
  CHECK(p.statistics().graphs == 0);
}

TEST_CASE("relaunching with the last launch's allocations live is refused, unless freed or auto-freed") {
  pool p;
  stream s;
  void* x = nullptr;
  captured_graph g = capture_one(p, s, MiB, false, &x);
  graph_exec e(g);
  e.launch(s.ref());
  const auto launches = fake_graphs().launches;
  CHECK_THROWS_WITH_AS(e.launch(s.ref()), doctest::Contains("still live since its last launch"), std::logic_error);
  CHECK(fake_graphs().launches == launches);  // nothing launched
  p.deallocate(x, s.ref());                   // freed after the launch, on a stream after it
  e.launch(s.ref());                          // makes it again
  CHECK_THROWS_AS(e.launch(s.ref()), std::logic_error);
  p.deallocate(x, s.ref());

  graph_exec auto_free(g, CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
  auto_free.launch(s.ref());
  auto_free.launch(s.ref());
  CHECK(fake_graphs().launches == launches + 3);
  g.reset();
  e.reset();
  auto_free.reset();
  REQUIRE(reaper_idle());
  // The last launch left x live, never freed since: an ordinary allocation of the pool now.
  CHECK(p.statistics().live_allocations == 1);
  p.deallocate(x, s.ref());
}

TEST_CASE("graph memory the device will not map at the launch stream's pages, nor back: not launched, the next launch maps it") {
  pool p;
  stream s;
  captured_graph g = capture_one(p, s, 16 * MiB, true);
  graph_exec e(g);
  g.reset();  // the executable alone holds the graph: its memory moves onto s's pages at launch
  streamalloc_test::fake_refuse_maps(3, 1000);  // mid-move, and every mapping back
  struct maps_allowed_again {  // whatever happens below, the next test case maps as usual
    ~maps_allowed_again() { streamalloc_test::fake_refuse_maps(0, 0); }
  } at_exit;
  // The graph's user object goes on streamalloc's thread: until then a launch leaves the memory
  // where it is (and runs); the first launch after it tries to move the memory.
  bool refused = false;
  long long launches = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!refused && std::chrono::steady_clock::now() < until) {
    launches = fake_graphs().launches;
    try {
      e.launch(s.ref());
      (void)s.synchronize();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } catch (const cuda_error& err) {
      refused = true;
      CHECK(err.code() == CUDA_ERROR_OUT_OF_MEMORY);
      CHECK(std::string(err.what()).find("refused to map it back where it was") != std::string::npos);
    }
  }
  REQUIRE(refused);
  CHECK(fake_graphs().launches == launches);  // nothing launched
  CHECK(p.statistics().graph_reserved_current == 0);  // its own memory went back to the device
  CHECK_THROWS_AS(e.upload(s.ref()), cuda_error);  // refused again: still nothing mapped
  streamalloc_test::fake_refuse_maps(0, 0);
  e.launch(s.ref());  // mapped on s's pages now
  e.launch(s.ref());
  CHECK(fake_graphs().launches == launches + 2);
  CHECK(p.statistics().graph_reserved_current == 16 * MiB);
  e.reset();
  REQUIRE(reaper_idle());
  CHECK(p.statistics().graph_reserved_current == 0);
  CHECK(p.statistics().live_allocations == 0);
}

TEST_CASE("a launch refused by one pool changes nothing in another") {
  pool a, b;
  stream s;
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  void* x = a.allocate(MiB, s.ref());
  void* y = b.allocate(MiB, s.ref());
  captured_graph g = end_capture(s.ref());
  REQUIRE(g.graph_memory_holds() == 2);
  graph_exec e(g);
  e.launch(s.ref());
  a.deallocate(x, s.ref());  // a's allocation freed after the launch; b's not
  CHECK_THROWS_WITH_AS(e.launch(s.ref()), doctest::Contains("still live"), std::logic_error);
  b.deallocate(y, s.ref());
  e.launch(s.ref());  // x's free still counts: the refused launch did not make x again
  a.deallocate(x, s.ref());
  b.deallocate(y, s.ref());
  g.reset();
  e.reset();
  REQUIRE(reaper_idle());
  CHECK(a.statistics().live_allocations == 0);
  CHECK(b.statistics().live_allocations == 0);
}

TEST_CASE("a graph without streamalloc memory; misuse") {
  stream s, other;
  CHECK_THROWS_WITH_AS((void)end_capture(s.ref()), doctest::Contains("not being captured"), std::logic_error);
  cu::cuStreamBeginCapture(handle(s), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  captured_graph g = end_capture(s.ref());
  CHECK(g.graph_memory_holds() == 0);
  graph_exec plain(g);
  CHECK(plain.graph_memory_holds() == 0);
  plain.launch(s.ref());
  plain.upload(s.ref());

  graph_exec empty;
  CHECK_THROWS_WITH_AS(empty.launch(s.ref()), doctest::Contains("empty"), std::logic_error);
  CHECK_THROWS_WITH_AS(empty.upload(s.ref()), doctest::Contains("empty"), std::logic_error);
  CHECK_THROWS_WITH_AS(graph_exec(captured_graph{}), doctest::Contains("empty"), std::invalid_argument);
  CHECK_THROWS_WITH_AS(graph_exec(static_cast<cudaGraph_t>(nullptr)), doctest::Contains("empty"), std::invalid_argument);
  CHECK_THROWS_AS(graph_exec(g, ~0ULL), cuda_error);  // flags the driver refuses

  // Launching or uploading into another capture: refused when the executable holds graph
  // memory, before anything is asked that would end the capture (a global-mode one too).
  pool p;
  captured_graph held = capture_one(p, s, MiB, true);
  graph_exec e(held);
  cu::cuStreamBeginCapture(handle(other), CU_STREAM_CAPTURE_MODE_THREAD_LOCAL);
  CHECK_THROWS_WITH_AS(e.launch(other.ref()), doctest::Contains("child graph node"), std::invalid_argument);
  captured_graph outer = end_capture(other.ref());
  CUstream raw = nullptr;
  cu::cuStreamCreateWithPriority(&raw, CU_STREAM_NON_BLOCKING, 0);
  cu::cuStreamBeginCapture(raw, CU_STREAM_CAPTURE_MODE_GLOBAL);
  const stream_ref raw_ref{reinterpret_cast<cudaStream_t>(raw)};
  CHECK_THROWS_WITH_AS(e.upload(raw_ref), doctest::Contains("graph_exec::upload: the stream is being captured"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS(e.launch(raw_ref), doctest::Contains("graph_exec::launch: the stream is being captured"),
                       std::invalid_argument);
  CUgraph raw_graph = nullptr;
  CHECK(cu::cuStreamEndCapture_nothrow(raw, &raw_graph) == CUDA_SUCCESS);  // not invalidated
  if (raw_graph != nullptr) cu::cuGraphDestroy(raw_graph);
  cu::cuStreamDestroy(raw);
  held.reset();
  e.reset();
  REQUIRE(reaper_idle());
}

}  // TEST_SUITE
