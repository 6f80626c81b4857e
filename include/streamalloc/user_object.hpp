#pragma once

/// @file
/// @brief `user_object<T>`: a C++ object whose lifetime CPU code and CUDA graphs share.
///
/// A graph launched many times, or an executable destroyed while its last launch still runs,
/// cannot free what its work uses from the code that built it: that code does not know when
/// the last launch ends. CUDA user objects solve this. A user object binds a destructor
/// callback to a reference count, like `std::shared_ptr`; references are held by CPU code and
/// by graphs, and the driver runs the destructor once the last one is gone and the work
/// launched from every graph holding one has finished. `user_object<T>` is that mechanism for
/// one `T`, with the CPU reference owned by a C++ object instead of tracked by hand.

#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/driver/driver_api.hpp>
#include <streamalloc/error.hpp>

#include <driver_types.h>  // cudaGraph_t and cudaUserObject_t, checked to be the driver's types

#include <memory>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace streamalloc {

// One overload serves both APIs: the runtime's handles are the driver's, under other names.
static_assert(std::is_same_v<cudaGraph_t, CUgraph>, "cudaGraph_t is expected to be CUgraph");
static_assert(std::is_same_v<cudaUserObject_t, CUuserObject>, "cudaUserObject_t is expected to be CUuserObject");

namespace detail {
/// cuUserObjectCreate, making a context current first if the driver turns the calling thread
/// away for having none (as on a thread that never made a CUDA call). User objects belong to
/// no context, so a thread with one is left alone: its context is not ours to change.
inline CUuserObject create_user_object(void* ptr, CUhostFn destroy) {
  CUuserObject h = nullptr;
  CUresult r = cu::cuUserObjectCreate_nothrow(&h, ptr, destroy, 1u, static_cast<unsigned>(CU_USER_OBJECT_NO_DESTRUCTOR_SYNC));
  if (r == CUDA_ERROR_INVALID_CONTEXT) {
    ensure_context(0);
    r = cu::cuUserObjectCreate_nothrow(&h, ptr, destroy, 1u, static_cast<unsigned>(CU_USER_OBJECT_NO_DESTRUCTOR_SYNC));
  }
  check(r, "cuUserObjectCreate", [] { return std::string("creating the user object of a streamalloc::user_object"); });
  return h;
}

[[noreturn]] STREAMALLOC_COLD inline void throw_null_graph(const char* call) {
  throw std::invalid_argument(std::string("streamalloc::user_object::") + call +
                              ": the graph is null (pass the graph from cudaGraphCreate, cudaStreamEndCapture, "
                              "cudaGraphClone, or, during a capture, cudaStreamGetCaptureInfo)");
}

[[noreturn]] STREAMALLOC_COLD inline void throw_empty_user_object(const char* call) {
  throw std::logic_error(std::string("streamalloc::user_object::") + call +
                         ": the user_object is empty (default-constructed, moved from, reset, released or "
                         "moved into a graph)");
}
}  // namespace detail

/**
 * @brief Owns a `T` and one CPU-side reference to the CUDA user object that keeps it alive;
 * graphs can take references of their own, and `T` is destroyed when the last one goes.
 *
 * Move-only, like `std::unique_ptr` over a shared count: each `user_object` holds exactly one
 * reference, and `share()` makes another explicitly.
 *
 * The rules (CUDA's, summarised):
 * - `retain_by(g)` gives graph `g` a reference of its own; `std::move(o).move_into(g)` moves
 *   `o`'s reference into `g` (the count is unchanged) and leaves `o` empty.
 * - Instantiating a graph gives the executable references of its own, a copy of every one the
 *   graph holds; cloning a graph copies them into the clone. A graph or executable releases
 *   its references when destroyed, but the driver holds them until the work already launched
 *   from it has finished. So the graph may be destroyed right after instantiation, and the
 *   executable right after its last launch.
 * - During stream capture, a reference moved into the graph that `cudaStreamGetCaptureInfo`
 *   (`cuStreamGetCaptureInfo`) returns belongs to the graph `cudaStreamEndCapture` returns.
 *   If the capture fails, that graph is destroyed, and its references with it.
 * - References in a child graph node belong to the child graph, not to the parent;
 *   `cudaGraphExecUpdate` replaces an executable's references with those of the new graph.
 *
 * `T`'s destructor runs exactly once, when the count reaches zero: on a thread of the
 * driver's when a graph or executable lets go last (possibly after `cudaGraphExecDestroy` has
 * returned), and, as measured on an H100 with driver 580, inline on the calling thread when
 * `reset()` or another CPU release drops the last reference. It MUST NOT call any CUDA API (not even to free memory: CUDA forbids it, since a
 * call there can block the thread that lets other work make progress), and should not block,
 * for the same reason.
 * No CUDA call waits for it; a destructor that others must wait for signals them itself
 * (an atomic, a condition variable), and may hand CUDA work, such as freeing memory, to a
 * thread of yours. A destructor not run yet when the process exits may never run, and the
 * code that runs it is the program's: a shared library that made the `user_object` must stay
 * loaded until `T` is gone.
 *
 * One `user_object` must not be used by two threads at once; distinct ones, even of the same
 * object, may (the driver's count is thread-safe). `T` itself is shared: synchronize access
 * to it as for any object that several threads and host callbacks use.
 * @code
 * struct results {                          // filled by a host node of every launch
 *   std::vector<float> values;
 *   ~results() = default;                   // a destructor here may make no CUDA call
 * };
 * cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
 * auto out = streamalloc::user_object<results>::make();
 * kernel<<<grid, block, 0, s>>>(...);
 * cudaLaunchHostFunc(s, [](void* r) { static_cast<results*>(r)->values.push_back(...); }, out.get());
 * cudaStreamCaptureStatus status;
 * cudaGraph_t capturing = nullptr;
 * cudaStreamGetCaptureInfo(s, &status, nullptr, &capturing);
 * std::move(out).move_into(capturing);       // `out` is empty now; the graph owns the results
 * cudaGraph_t graph;
 * cudaStreamEndCapture(s, &graph);
 * cudaGraphExec_t exec;
 * cudaGraphInstantiate(&exec, graph);        // the executable holds a reference too
 * cudaGraphDestroy(graph);
 * cudaGraphLaunch(exec, s);
 * cudaGraphExecDestroy(exec);                // `results` goes once the launch has finished
 * @endcode
 * @tparam T a cv-unqualified object type (not an array) whose destructor does not throw
 */
template <class T>
class user_object {
  static_assert(std::is_object_v<T> && !std::is_array_v<T>,
                "streamalloc::user_object<T>: T must be an object type, not a reference, function or array "
                "(wrap an array in a struct or std::array)");
  static_assert(std::is_same_v<T, std::remove_cv_t<T>>,
                "streamalloc::user_object<T>: T must not be const or volatile; use user_object<U> and "
                "hand out const U*");
  static_assert(std::is_nothrow_destructible_v<T>,
                "streamalloc::user_object<T>: T's destructor must not throw: it runs on a driver thread, "
                "where nothing could catch the exception");

 public:
  /// The type of the object owned.
  using element_type = T;

  /// An empty `user_object`: no `T`, no reference.
  constexpr user_object() noexcept = default;

  /**
   * @brief Constructs a `T` from `args` and a user object holding it, with one reference,
   * owned by this `user_object`.
   * @throws whatever `T`'s constructor throws; nothing is made then
   * @throws cuda_error (`driver_unavailable` without a usable driver) when the driver refuses
   *         to make the user object; the `T` is destroyed, on this thread, before it propagates
   */
  template <class... Args>
    requires std::is_constructible_v<T, Args...>
  explicit user_object(std::in_place_t, Args&&... args) {
    auto value = std::make_unique<T>(std::forward<Args>(args)...);
    handle_ = detail::create_user_object(value.get(), &destroy);
    object_ = value.release();  // the user object owns it from here
  }

  /// `user_object(std::in_place, args...)`, for `auto o = user_object<T>::make(args...)`.
  /// @throws as that constructor
  template <class... Args>
    requires std::is_constructible_v<T, Args...>
  [[nodiscard]] static user_object make(Args&&... args) {
    return user_object(std::in_place, std::forward<Args>(args)...);
  }

  /// Takes `o`'s reference; `o` is left empty.
  user_object(user_object&& o) noexcept
      : handle_(std::exchange(o.handle_, nullptr)), object_(std::exchange(o.object_, nullptr)) {}

  /// Releases this one's reference (see `reset()`) and takes `o`'s; `o` is left empty.
  user_object& operator=(user_object&& o) noexcept {
    if (this != &o) {
      reset();
      handle_ = std::exchange(o.handle_, nullptr);
      object_ = std::exchange(o.object_, nullptr);
    }
    return *this;
  }

  user_object(const user_object&) = delete;
  user_object& operator=(const user_object&) = delete;

  /// Releases the reference, as `reset()`.
  ~user_object() { reset(); }

  /**
   * @brief Releases this `user_object`'s reference; it is empty afterwards. If that was the
   * last reference, `T`'s destructor runs, asynchronously, on a driver thread: maybe after
   * `reset()` returns. Does nothing on an empty one.
   */
  void reset() noexcept {
    if (handle_ == nullptr) return;
    // Nothing could be done about a refusal here (the driver refuses a valid handle only once
    // it is being torn down, at exit), and reset() runs in destructors: ignore the status.
    (void)detail::cu::cuUserObjectRelease_nothrow(std::exchange(handle_, nullptr), 1u);
    object_ = nullptr;
  }

  /**
   * @brief Another `user_object` holding a new reference to the same `T`
   * (`cuUserObjectRetain`). Either may then be destroyed first.
   * @throws std::logic_error on an empty `user_object`
   * @throws cuda_error
   */
  [[nodiscard]] user_object share() const {
    if (handle_ == nullptr) [[unlikely]] detail::throw_empty_user_object("share");
    detail::cu::cuUserObjectRetain(handle_, 1u);
    return user_object(handle_, object_);
  }

  /**
   * @brief Gives `graph` a reference of its own (`cuGraphRetainUserObject`); this
   * `user_object` keeps its reference too, so `T` lives until both, and the graph's
   * executables and clones, are gone.
   * @param graph a graph (`cudaGraph_t` is `CUgraph`); during stream capture, the one
   *        `cudaStreamGetCaptureInfo` returns
   * @throws std::invalid_argument for a null graph
   * @throws std::logic_error on an empty `user_object`
   * @throws cuda_error when the driver refuses (e.g. a destroyed graph)
   */
  void retain_by(CUgraph graph) const {
    if (graph == nullptr) [[unlikely]] detail::throw_null_graph("retain_by");
    if (handle_ == nullptr) [[unlikely]] detail::throw_empty_user_object("retain_by");
    detail::cu::cuGraphRetainUserObject(graph, handle_, 1u, 0u);
  }

  /**
   * @brief Moves this `user_object`'s reference into `graph` (`cuGraphRetainUserObject` with
   * `CU_GRAPH_USER_OBJECT_MOVE`) and leaves it empty: from now on the graph, its executables
   * and clones keep `T` alive. Called on an rvalue, so the transfer shows where it happens:
   * `std::move(o).move_into(graph)`.
   * @param graph a graph (`cudaGraph_t` is `CUgraph`); during stream capture, the one
   *        `cudaStreamGetCaptureInfo` returns
   * @return the `T`, valid while a graph or executable holding a reference lives, and while
   *         work launched from one runs; for the nodes of the graph to use
   * @throws std::invalid_argument for a null graph; `*this` is unchanged
   * @throws std::logic_error on an empty `user_object`
   * @throws cuda_error when the driver refuses; `*this` still holds its reference
   */
  T* move_into(CUgraph graph) && {
    if (graph == nullptr) [[unlikely]] detail::throw_null_graph("move_into");
    if (handle_ == nullptr) [[unlikely]] detail::throw_empty_user_object("move_into");
    detail::cu::cuGraphRetainUserObject(graph, handle_, 1u, static_cast<unsigned>(CU_GRAPH_USER_OBJECT_MOVE));
    handle_ = nullptr;
    return std::exchange(object_, nullptr);
  }
  /// Rejected: moving the reference empties this `user_object`; write
  /// `std::move(o).move_into(graph)`, or `o.retain_by(graph)` to keep it.
  T* move_into(CUgraph graph) & = delete;

  /**
   * @brief Releases one of `graph`'s references (`cuGraphReleaseUserObject`): one it took
   * with `retain_by` or `move_into`. The references of its executables and clones stay.
   * @throws std::invalid_argument for a null graph
   * @throws std::logic_error on an empty `user_object`
   * @throws cuda_error when the driver refuses
   * @warning releasing a reference the graph does not hold is the caller's error: the driver
   *          may not detect it, and the count would then go below what others hold
   */
  void release_from(CUgraph graph) const {
    if (graph == nullptr) [[unlikely]] detail::throw_null_graph("release_from");
    if (handle_ == nullptr) [[unlikely]] detail::throw_empty_user_object("release_from");
    detail::cu::cuGraphReleaseUserObject(graph, handle_, 1u);
  }

  /**
   * @brief Gives up ownership of the reference without releasing it, for raw CUDA calls that
   * take it over; this `user_object` is left empty. The caller must release it
   * (`cuUserObjectRelease`) or move it into a graph, or `T` lives for the process's life.
   * @return the handle, null for an empty `user_object`
   */
  [[nodiscard]] CUuserObject release() noexcept {
    object_ = nullptr;
    return std::exchange(handle_, nullptr);
  }

  /// The `T`; null when empty.
  [[nodiscard]] T* get() const noexcept { return object_; }
  /// The `T`. The `user_object` must not be empty.
  [[nodiscard]] T& operator*() const noexcept { return *object_; }
  /// The `T`. The `user_object` must not be empty.
  T* operator->() const noexcept { return object_; }
  /// True when it holds a reference.
  explicit operator bool() const noexcept { return handle_ != nullptr; }
  /// The driver's handle (a `cudaUserObject_t` too); null when empty. Valid while a reference
  /// is held: using it after the last one is released is undefined behaviour.
  [[nodiscard]] CUuserObject handle() const noexcept { return handle_; }

 private:
  user_object(CUuserObject h, T* p) noexcept : handle_(h), object_(p) {}

  // The driver calls this on its own thread once the count reaches zero (no CUDA call may be
  // made here: see the class's rules).
  static void destroy(void* p) noexcept { delete static_cast<T*>(p); }

  CUuserObject handle_ = nullptr;
  T* object_ = nullptr;
};

}  // namespace streamalloc
