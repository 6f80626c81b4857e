#pragma once

/// @file
/// @brief `graph_exec`: an executable graph that launches as fast with streamalloc graph memory
/// as without, and checks what the driver's graph memory nodes check.
///
/// A graph captured with streamalloc allocations in it holds their memory through CUDA user
/// objects (see docs/graphs.md). The driver copies those references into every executable
/// instantiated from the graph, and an executable holding a user object launches far slower on
/// the host (on an H100, a graph of 256 kernels: 70 us a launch instead of 3). A `graph_exec`
/// made from a `captured_graph` (see captured_graph.hpp) instantiates a clone of the graph with
/// streamalloc's user objects taken out and holds the memory itself, until it is destroyed and
/// its last launch has finished. It also refuses a launch that would make again an allocation
/// the last launch made and nobody freed, as the driver does for its own graph allocations.
///
/// @code
/// cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
/// float* tmp = static_cast<float*>(pool.allocate(n * sizeof(float), streamalloc::stream_ref{s}));
/// step<<<grid, block, 0, s>>>(tmp, out);
/// pool.deallocate(tmp, streamalloc::stream_ref{s});
/// streamalloc::captured_graph g = streamalloc::end_capture(streamalloc::stream_ref{s});
/// streamalloc::graph_exec exec(g);
/// g.reset();  // the memory stays: exec holds it
/// for (int i = 0; i < steps; ++i) exec.launch(streamalloc::stream_ref{s});
/// @endcode

#include <streamalloc/captured_graph.hpp>
#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/detail/driver/capture.hpp>
#include <streamalloc/detail/pool/graph_ties.hpp>
#include <streamalloc/driver.hpp>
#include <streamalloc/error.hpp>
#include <streamalloc/stream.hpp>

#include <driver_types.h>

#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace streamalloc {

static_assert(std::is_same_v<cudaGraphExec_t, CUgraphExec>, "cudaGraphExec_t is expected to be CUgraphExec");

namespace detail {

/// The end of a graph_exec that holds graph memory: once its last launch has finished (the
/// event recorded after it; launches of one executable never overlap), its holds go. Not a
/// device-wide wait: while any stream of the device is being captured, that wait fails and
/// invalidates the capture (found on the GPU), even in relaxed mode.
struct exec_retirement final : reaper_job {
  CUevent done = nullptr;
  std::vector<graph_tie*> ties;

  void run() noexcept override {
    {
      // Relaxed: another thread's global-mode capture would refuse the wait and break.
      const relaxed_capture_mode relaxed;
      (void)cu::cuEventSynchronize_nothrow(done);
      (void)cu::cuEventDestroy_nothrow(done);
    }
    for (graph_tie* t : ties) t->let_go_of_launches();
    delete this;
  }
};

[[noreturn]] STREAMALLOC_COLD inline void throw_empty_exec(const char* member) {
  throw std::logic_error(std::string("streamalloc::graph_exec::") + member +
                         ": the graph_exec is empty (default-constructed, moved from or reset)");
}

}  // namespace detail

/**
 * @brief An executable graph (`cudaGraphExec_t`) owned by a C++ object, holding the streamalloc
 * graph memory of the graph it was instantiated from.
 *
 * Launch it with `launch(stream)` rather than `cudaGraphLaunch(get(), stream)`: the raw call
 * skips the check for allocations left live by the last launch, and, once this executable
 * alone holds a graph that frees all it allocates, the move of its memory onto the pages the
 * graphs launched into that stream share (docs/graphs.md): a raw launch into another stream
 * may then run on pages that stream's graphs do not own. Move-only. Destroying it does not wait for its launches; the memory goes back to the
 * pools once they have finished and nothing else holds it.
 */
class graph_exec {
 public:
  /// An empty graph_exec: no executable.
  graph_exec() noexcept = default;

  /**
   * @brief Instantiates the graph of a capture (`cudaGraphInstantiate` with `flags`) on the
   * calling thread's current context (the device 0 primary context when it has none).
   *
   * When the capture allocated streamalloc memory, the executable is instantiated from a clone
   * of the graph without the user objects that hold it, and this object holds the memory
   * instead: `graph` may be reset or changed afterwards.
   * @param graph the graph to instantiate (not empty)
   * @param flags cudaGraphInstantiateFlag* values, passed to the driver.
   *   With `cudaGraphInstantiateFlagAutoFreeOnLaunch`, a launch may find the last launch's
   *   allocations still live: it makes them again at the same addresses, as the driver frees
   *   and makes its own.
   * @throws std::invalid_argument for an empty captured_graph
   * @throws cuda_error when the driver refuses to clone or instantiate it
   */
  explicit graph_exec(const captured_graph& graph, unsigned long long flags = 0)
      : auto_free_((flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) != 0) {
    if (!graph) throw_null_graph();
    require_driver();
    ties_.reserve(detail::ties_of(graph).size());
    for (detail::graph_tie* t : detail::ties_of(graph)) {
      t->hold_for_launches();  // graph holds it: it lives
      ties_.push_back(t);
    }
    try {
      instantiate(graph.get(), flags);
      if (!ties_.empty()) {
        detail::cu::cuEventCreate(&done_, static_cast<unsigned>(CU_EVENT_DISABLE_TIMING));
      }
    } catch (...) {
      if (exec_ != nullptr) (void)detail::cu::cuGraphExecDestroy_nothrow(exec_);
      for (detail::graph_tie* t : ties_) t->let_go_of_launches();
      throw;
    }
  }

  /**
   * @brief Instantiates any graph, as `cudaGraphInstantiate` does. Streamalloc memory the graph
   * holds stays held by its user objects, copied into the executable (correct, but launches
   * pay for them: end the capture with `end_capture` to avoid that).
   * @throws std::invalid_argument for a null graph
   * @throws cuda_error when the driver refuses to instantiate it
   */
  explicit graph_exec(cudaGraph_t graph, unsigned long long flags = 0)
      : auto_free_((flags & CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH) != 0) {
    if (graph == nullptr) throw_null_graph();
    require_driver();
    instantiate(graph, flags);
  }

  /// Takes over `o`'s executable and holds; `o` is left empty.
  graph_exec(graph_exec&& o) noexcept { swap(o); }
  /// Lets go of this executable (as `reset`), then takes over `o`'s.
  graph_exec& operator=(graph_exec&& o) noexcept {
    if (this != &o) {
      reset();
      swap(o);
    }
    return *this;
  }
  graph_exec(const graph_exec&) = delete;
  graph_exec& operator=(const graph_exec&) = delete;

  ~graph_exec() { reset(); }

  /// Destroys the executable now, without waiting for its launches: the graph memory it holds
  /// goes back to its pools once the last launch has finished (waited for on streamalloc's
  /// reaper thread).
  /// The graph_exec is empty afterwards.
  void reset() noexcept {
    if (exec_ == nullptr) return;
    (void)detail::cu::cuGraphExecDestroy_nothrow(exec_);  // the driver finishes its launches first
    exec_ = nullptr;
    if (ties_.empty()) return;
    auto* job = new (std::nothrow) detail::exec_retirement;
    if (job == nullptr) {  // out of host memory: wait here instead
      {
        const detail::relaxed_capture_mode relaxed;
        (void)detail::cu::cuEventSynchronize_nothrow(done_);
        (void)detail::cu::cuEventDestroy_nothrow(done_);
      }
      for (detail::graph_tie* t : ties_) t->let_go_of_launches();
    } else {
      job->done = done_;
      job->ties = std::move(ties_);
      auto& reaper = detail::graph_reaper::instance();
      try {
        reaper.start();
      } catch (...) {  // cannot happen after a tie was made: the capture started the thread
      }
      reaper.push(job);
    }
    done_ = nullptr;
    ties_.clear();
  }

  /**
   * @brief Launches the graph into stream `s` (`cudaGraphLaunch`).
   *
   * Before launching, each pool whose memory the graph holds is told: allocations freed on a
   * stream after the last launch are made again, at their addresses. Refused, as the driver
   * refuses it for its graph allocations, when an allocation the last launch made and the
   * graph does not free is still live and the executable was not instantiated with
   * `cudaGraphInstantiateFlagAutoFreeOnLaunch`: work ordered after that launch may still read it.
   * @throws std::logic_error when empty, or for live allocations of the last launch (the
   *   message says how many and how to free them); nothing is launched
   * @throws std::invalid_argument when `s` is being captured (add the graph to the other as a
   *   child graph node instead: this executable's memory would not be tied to that graph)
   * @throws cuda_error when the driver refuses the launch, or (CUDA_ERROR_OUT_OF_MEMORY from
   *   cuMemMap) when the graph's memory, moved for this stream, could be mapped neither there
   *   nor back where it was: then nothing is launched, and the next launch tries again
   */
  void launch(stream_ref s) {
    if (exec_ == nullptr) [[unlikely]] detail::throw_empty_exec("launch");
    if (!ties_.empty()) {
      refuse_capturing(s, "streamalloc::graph_exec::launch");
      // Every pool is asked before any is told: a refusal changes nothing.
      for (detail::graph_tie* t : ties_) {
        if (std::string why = t->launch_refusal(auto_free_); !why.empty()) [[unlikely]] {
          throw std::logic_error("streamalloc::graph_exec::launch: " + why);
        }
      }
      if (!bind_memory(s)) [[unlikely]] throw_memory_lost("launch");
      for (detail::graph_tie* t : ties_) t->launched();
    }
    detail::check(detail::cu::cuGraphLaunch_nothrow(exec_, s.get()), "cuGraphLaunch",
                  [] { return std::string("launching a streamalloc::graph_exec"); });
    if (done_ != nullptr) {
      detail::check(detail::cu::cuEventRecord_nothrow(done_, s.get()), "cuEventRecord",
                    [] { return std::string("recording the end of a streamalloc::graph_exec launch"); });
    }
  }

  /// Uploads the executable's work to the device ahead of its first launch
  /// (`cudaGraphUpload`), as a device-launched graph needs before the device launches it, and
  /// moves graph memory it may share onto the pages of the graphs launched into `s`, so that
  /// launches into `s` do no mapping work.
  /// @throws std::logic_error when empty
  /// @throws std::invalid_argument when it holds graph memory and `s` is being captured (as launch)
  /// @throws cuda_error when the driver refuses it, or when the graph's memory could be mapped
  ///   neither at `s`'s pages nor back (as launch)
  void upload(stream_ref s) {
    if (exec_ == nullptr) [[unlikely]] detail::throw_empty_exec("upload");
    if (!ties_.empty()) refuse_capturing(s, "streamalloc::graph_exec::upload");
    if (!bind_memory(s)) [[unlikely]] throw_memory_lost("upload");
    detail::check(detail::cu::cuGraphUpload_nothrow(exec_, s.get()), "cuGraphUpload",
                  [] { return std::string("uploading a streamalloc::graph_exec"); });
  }

  /// The driver's handle (a `cudaGraphExec_t`); null when empty. Owned by this object.
  [[nodiscard]] CUgraphExec get() const noexcept { return exec_; }
  /// True when it holds an executable.
  explicit operator bool() const noexcept { return exec_ != nullptr; }
  /// Pools' graph memory this executable holds (one per pool and capture), without user objects.
  [[nodiscard]] std::size_t graph_memory_holds() const noexcept { return ties_.size(); }

  /// Exchanges the executables and holds of the two.
  void swap(graph_exec& o) noexcept {
    std::swap(exec_, o.exec_);
    std::swap(done_, o.done_);
    std::swap(ties_, o.ties_);
    std::swap(auto_free_, o.auto_free_);
  }

 private:
  [[noreturn]] STREAMALLOC_COLD static void throw_null_graph() {
    throw std::invalid_argument("streamalloc::graph_exec: the graph is empty (pass the captured_graph from "
                                "streamalloc::end_capture, or a cudaGraph_t)");
  }

  /// Throws when `s` is being captured: graph memory follows the streams its graph is launched
  /// into, and a capture's graph runs in no order with them.
  static void refuse_capturing(stream_ref s, const char* caller) {
    if (detail::capture_of(s.get(), caller).id == 0) [[likely]] return;
    throw std::invalid_argument(std::string(caller) +
                                ": the stream is being captured into another graph; a graph_exec holding graph "
                                "memory is launched on an ordinary stream (to run this graph inside the other, add "
                                "it as a child graph node)");
  }

  /// Before a launch or upload into `s`: the memory of each pool this executable alone holds
  /// moves, if it must, onto the pages shared by the graphs launched into `s` (see the class).
  /// False when a graph's memory is lost (graph_tie::bind): it must not run.
  bool bind_memory(stream_ref s) noexcept {
    unsigned long long id = 0;
    bool asked = false, known = false, mapped = true;
    for (detail::graph_tie* t : ties_) {
      if (!t->launched_only_by_one_exec()) continue;
      if (!asked) {
        asked = true;
        // The caller refused a capturing stream (refuse_capturing), whose id CUDA would not
        // tell. Unknown, the memory stays where it is.
        if (const detail::stream_record* r = s.known_record(); r != nullptr) {
          id = r->id();
          known = true;
        } else {
          known = detail::cu::cuStreamGetId_nothrow(s.get(), &id) == CUDA_SUCCESS;
        }
      }
      mapped = t->bind(known ? id + 1 : 0, done_) && mapped;
    }
    return mapped;
  }

  [[noreturn]] static void throw_memory_lost(const char* what) {
    throw cuda_error(CUDA_ERROR_OUT_OF_MEMORY, "cuMemMap",
                     std::string("streamalloc::graph_exec::") + what +
                         ": nothing is mapped under the graph's allocations, so it is not run: moving its memory onto the "
                         "pages of the stream it was launched into failed, and the device refused to map it back where it "
                         "was, nor could this call map it (out of device memory). The next launch or upload tries again; "
                         "freeing device memory helps");
  }

  /// Instantiates `graph`, or, when this holds its streamalloc memory, a clone of it with the
  /// user objects holding that memory taken out (the clone holds one reference of each, copied
  /// from the graph; the driver does not check what is released, so only those are).
  void instantiate(CUgraph graph, unsigned long long flags) {
    CUgraph source = graph;
    CUgraph clone = nullptr;
    if (!ties_.empty()) {
      detail::check(detail::cu::cuGraphClone_nothrow(&clone, graph), "cuGraphClone",
                    [] { return std::string("cloning a graph for streamalloc::graph_exec"); });
      source = clone;
      for (detail::graph_tie* t : ties_) {
        const CUresult r = detail::cu::cuGraphReleaseUserObject_nothrow(clone, t->object, 1u);
        if (r != CUDA_SUCCESS) {
          (void)detail::cu::cuGraphDestroy_nothrow(clone);
          detail::throw_driver_failure(r, "cuGraphReleaseUserObject",
                                       "taking streamalloc's user object out of a clone for graph_exec");
        }
      }
    }
    CUresult r = detail::cu::cuGraphInstantiateWithFlags_nothrow(&exec_, source, flags);
    if (r == CUDA_ERROR_INVALID_CONTEXT) {
      detail::ensure_context(0);
      r = detail::cu::cuGraphInstantiateWithFlags_nothrow(&exec_, source, flags);
    }
    if (clone != nullptr) (void)detail::cu::cuGraphDestroy_nothrow(clone);
    if (r != CUDA_SUCCESS) exec_ = nullptr;
    detail::check(r, "cuGraphInstantiateWithFlags",
                  [] { return std::string("instantiating a graph for streamalloc::graph_exec"); });
  }

  CUgraphExec exec_ = nullptr;
  CUevent done_ = nullptr;  ///< recorded after each launch, when graph memory is held
  std::vector<detail::graph_tie*> ties_;
  bool auto_free_ = false;
};

}  // namespace streamalloc
