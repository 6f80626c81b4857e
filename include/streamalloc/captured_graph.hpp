#pragma once

/// @file
/// @brief `end_capture`, `make_graph` and `captured_graph`: a graph made by stream capture (or
/// built by hand), owned by a C++ object that knows which streamalloc graph memory it holds.
///
/// `cudaStreamEndCapture` returns a bare `cudaGraph_t`; the memory streamalloc allocated in the
/// capture is tied to it through CUDA user objects (see docs/graphs.md), which every executable
/// instantiated from it copies, and which make its launches slow on the host. Ending the capture
/// with `streamalloc::end_capture` instead keeps track of that memory, so that a `graph_exec`
/// made from the result holds it without the user objects.

#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/detail/driver/capture.hpp>
#include <streamalloc/detail/pool/graph_ties.hpp>
#include <streamalloc/error.hpp>
#include <streamalloc/stream.hpp>

#include <driver_types.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace streamalloc {

class captured_graph;
namespace detail {
/// The ties a captured_graph holds (for graph_exec and the tests).
inline const std::vector<graph_tie*>& ties_of(const captured_graph& g) noexcept;
/// Adding streamalloc memory to a captured_graph by hand (graph_allocation.hpp).
struct graph_building;

/// Ids of graphs built by hand, in a space of their own: CUDA numbers captures from 1 up.
inline std::uint64_t new_built_graph_id() noexcept {
  static std::atomic<std::uint64_t> next{0};
  return (std::uint64_t{1} << 63) | next.fetch_add(1, std::memory_order_relaxed);
}
}  // namespace detail

static_assert(std::is_same_v<cudaGraph_t, CUgraph>, "cudaGraph_t is expected to be CUgraph");

/**
 * @brief A graph (`cudaGraph_t`) made by stream capture (`end_capture`) or to be built by hand
 * (`make_graph`), owned: destroyed with this object.
 *
 * Holds the streamalloc graph memory of its capture, and of the allocations added to it with
 * `add_allocation` (graph_allocation.hpp), for its own life too, so that the memory does not
 * depend on the raw graph, which the caller may inspect or change through `get()` but must not
 * destroy. Move-only.
 */
class captured_graph {
 public:
  /// An empty captured_graph: no graph.
  captured_graph() noexcept = default;

  /// Takes over `o`'s graph and holds; `o` is left empty.
  captured_graph(captured_graph&& o) noexcept { swap(o); }
  /// Destroys this graph (as `reset`), then takes over `o`'s.
  captured_graph& operator=(captured_graph&& o) noexcept {
    if (this != &o) {
      reset();
      swap(o);
    }
    return *this;
  }
  captured_graph(const captured_graph&) = delete;
  captured_graph& operator=(const captured_graph&) = delete;
  ~captured_graph() { reset(); }

  /// Destroys the graph (`cudaGraphDestroy`; executables made from it live on) and lets go of
  /// its memory, which goes back to its pools once no executable holds it either.
  void reset() noexcept {
    if (graph_ != nullptr) (void)detail::cu::cuGraphDestroy_nothrow(graph_);
    graph_ = nullptr;
    id_ = 0;
    frees_ = 0;
    for (detail::graph_tie* t : ties_) t->let_go();
    ties_.clear();
  }

  /// The driver's handle (a `cudaGraph_t`); null when empty. Owned by this object.
  [[nodiscard]] CUgraph get() const noexcept { return graph_; }
  /// True while it owns a graph.
  explicit operator bool() const noexcept { return graph_ != nullptr; }
  /// Pools whose memory the capture allocated (one hold on each).
  [[nodiscard]] std::size_t graph_memory_holds() const noexcept { return ties_.size(); }

  /// Exchanges the graphs and holds of the two.
  void swap(captured_graph& o) noexcept {
    std::swap(graph_, o.graph_);
    std::swap(id_, o.id_);
    std::swap(frees_, o.frees_);
    std::swap(ties_, o.ties_);
  }

 private:
  friend captured_graph end_capture(stream_ref s);
  friend captured_graph make_graph();
  friend const std::vector<detail::graph_tie*>& detail::ties_of(const captured_graph& g) noexcept;
  friend struct detail::graph_building;

  captured_graph(CUgraph g, std::uint64_t id, std::vector<detail::graph_tie*> ties) noexcept
      : graph_(g), id_(id), ties_(std::move(ties)) {}

  CUgraph graph_ = nullptr;
  /// What the pools know its memory by: its capture's id, or one given by make_graph.
  std::uint64_t id_ = 0;
  std::size_t frees_ = 0;  ///< free nodes added by hand (graph_allocation.hpp)
  std::vector<detail::graph_tie*> ties_;
};

inline const std::vector<detail::graph_tie*>& detail::ties_of(const captured_graph& g) noexcept { return g.ties_; }

/**
 * @brief Ends the capture of stream `s` (`cudaStreamEndCapture`) and returns its graph, knowing
 * which streamalloc memory it holds.
 * @throws std::logic_error when `s` is not being captured
 * @throws cuda_error as cudaStreamEndCapture fails (an invalidated capture, a stream that
 *   joined the capture rather than began it, a global-mode capture ended on another thread);
 *   the driver destroys the graph then, and the memory goes back to the pools. An invalidated
 *   capture is ended all the same (the stream is usable again). CUDA_ERROR_STREAM_CAPTURE_UNJOINED
 *   when the capture ended without a graph because a stream that had joined it was destroyed.
 */
[[nodiscard]] inline captured_graph end_capture(stream_ref s) {
  // Asked without refusing an invalidated capture: that one is ended too, the driver reporting
  // why and destroying its graph, whose ties then give the memory back (graph_reaper.hpp).
  // The status alone first: CUDA answers it for the legacy stream during another stream's
  // capture without invalidating that capture (is_capturing refuses then), which the full
  // question does not promise.
  (void)detail::is_capturing(s.get(), "streamalloc::end_capture");
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  const detail::capture_info capture = detail::capture_status(s.get(), status, "streamalloc::end_capture");
  if (status == CU_STREAM_CAPTURE_STATUS_NONE) {
    throw std::logic_error("streamalloc::end_capture: the stream is not being captured (begin with "
                           "cudaStreamBeginCapture)");
  }
  CUgraph g = nullptr;
  detail::check(detail::cu::cuStreamEndCapture_nothrow(s.get(), &g), "cuStreamEndCapture",
                [] { return std::string("streamalloc::end_capture: ending the capture"); });
  if (g == nullptr) {
    // Ended without a graph: a stream that joined the capture was destroyed meanwhile (the
    // driver then ends it so, having destroyed the graph and its ties with it).
    throw cuda_error(CUDA_ERROR_STREAM_CAPTURE_UNJOINED, "cuStreamEndCapture",
                     "streamalloc::end_capture: the capture ended without a graph (a stream that had joined it "
                     "was destroyed before it ended); its memory went back to the pools");
  }
  // The graph now holds the user object of each tie of this capture: they live.
  std::vector<detail::graph_tie*> ties;
  try {
    ties = detail::graph_tie_registry::instance().take(capture.id);
  } catch (...) {
    (void)detail::cu::cuGraphDestroy_nothrow(g);
    throw;
  }
  return captured_graph(g, capture.id, std::move(ties));
}

/**
 * @brief An empty graph (`cudaGraphCreate`), owned, to build by hand: the driver's node calls
 * on `get()`, and streamalloc allocations and frees with `add_allocation` and `add_free`
 * (graph_allocation.hpp).
 * @throws cuda_error when the driver refuses
 */
[[nodiscard]] inline captured_graph make_graph() {
  CUgraph g = nullptr;
  CUresult r = detail::cu::cuGraphCreate_nothrow(&g, 0u);
  if (r == CUDA_ERROR_INVALID_CONTEXT) {
    detail::ensure_context(0);
    r = detail::cu::cuGraphCreate_nothrow(&g, 0u);
  }
  detail::check(r, "cuGraphCreate", [] { return std::string("streamalloc::make_graph"); });
  return captured_graph(g, detail::new_built_graph_id(), {});
}

}  // namespace streamalloc
