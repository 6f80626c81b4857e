#pragma once

// The state behind a `pool` (see <streamalloc/pool.hpp>): the pool core over the VMM backend,
// and what a pool adds around it (capture, graphs, IPC export). The checks of a pool's
// properties are in property_checks.hpp, which devices may use its memory in pool_access.hpp,
// what it says when memory runs out in out_of_memory_report.hpp, the process-wide directories
// of pools in pool_registry.hpp.

#include <streamalloc/access.hpp>
#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/core/pool_core.hpp>
#include <streamalloc/detail/ipc/exporter.hpp>
#include <streamalloc/detail/driver/capture.hpp>
#include <streamalloc/detail/pool/graph_ties.hpp>
#include <streamalloc/detail/pool/out_of_memory_report.hpp>
#include <streamalloc/detail/pool/pool_access.hpp>
#include <streamalloc/detail/pool/pool_registry.hpp>
#include <streamalloc/detail/pool/property_checks.hpp>
#include <streamalloc/detail/pool/snapshot_json.hpp>
#include <streamalloc/detail/pool/vmm_backend.hpp>
#include <streamalloc/driver.hpp>
#include <streamalloc/memory_location.hpp>
#include <streamalloc/ordering.hpp>
#include <streamalloc/physical_allocation.hpp>
#include <streamalloc/placement.hpp>
#include <streamalloc/pool_properties.hpp>
#include <streamalloc/shareable_handle.hpp>
#include <streamalloc/stream.hpp>

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace streamalloc::detail {

/// The key of a stream the caller has just found not capturing (capture_of). Its handle is
/// never null (explicit_handle): to the pool a null handle means no stream at all (a
/// synchronous call), so a default stream given as null could never be queried or have an
/// event recorded on it, and its frees would never be known complete, nor reused by other
/// streams or remapped.
inline stream_key key_of_uncaptured(stream_ref s) {
  stream_record* known = s.known_record();
  return {known != nullptr ? known : &resolve_uncaptured_stream(s.get()), explicit_handle(s.get())};
}

/// The pseudo-stream of synchronous allocations: no CUDA stream, and every free on it is
/// complete when made (the caller promises no work uses the memory any more), so what it
/// frees is reusable by every stream as soon as the pool looks.
inline stream_key host_key() {
  static stream_record& r = [] () -> stream_record& {
    stream_record& rec = ordering().record(~std::uint64_t{0});
    rec.mark_completed(~std::uint64_t{0} >> 1);
    return rec;
  }();
  return {&r, nullptr};
}

/// A capture's graph's hold on a pool's core (see graph_ties.hpp). It owns a reference to the
/// core: a pool closed while graphs live keeps the memory they hold mapped until the last of
/// them goes.
struct pool_graph_tie final : graph_tie {
  pool_graph_tie(std::shared_ptr<vmm_pool_core> c, std::uint64_t id, int dev)
      : graph_tie(id), core(std::move(c)), device(dev) {}

  void release() noexcept override {
    stream_key host;
    try {
      ensure_context(device);
      // Made when the tie was (tie_to_graph): asked here it allocates nothing.
      host = host_key();
    } catch (...) {  // the context is gone: so is the memory
      return;
    }
    core->release_graph(capture, host);
  }

  std::string launch_refusal(bool auto_free) override { return core->graph_launch_refusal(capture, auto_free); }
  void launched() noexcept override { core->graph_launched(capture); }
  bool bind(std::uint64_t stream, CUevent last) noexcept override {
    return core->bind_graph_memory(capture, stream, [last] {
      // Relaxed: another thread's global-mode capture would refuse the wait and break.
      const relaxed_capture_mode relaxed;
      return cu::cuEventSynchronize_nothrow(last) == CUDA_SUCCESS;
    });
  }
  [[nodiscard]] std::uint64_t allocation_size(std::uint64_t p) override { return core->graph_block_size(capture, p); }
  [[nodiscard]] std::vector<std::pair<std::uint64_t, std::uint64_t>> unfreed() override {
    return core->graph_unfreed(capture);
  }
  [[nodiscard]] const void* pool_core_address() const noexcept override { return core.get(); }

  std::shared_ptr<vmm_pool_core> core;
  int device;
};

/**
 * @brief The state of a pool: what `pool` owns and `pool_ref` refers to. It lives on the heap,
 * so that its address, which refs, resources, buffers, the current-pool slots and the pointer
 * directory hold, stays the same when the owning `pool` is moved. The members are those of
 * `pool_interface` (documented there), applied to one state; those a closed pool refuses
 * check that it is not closed.
 */
class pool_state {
 public:
  /// Checks the properties and makes the core (see `pool::pool`, which documents what is refused).
  explicit pool_state(pool_properties props)
      : props_(props), device_(home_device(props.location)), access_(props.location, device_) {
    // The properties' test allocation and the core's first reservation are calls another
    // thread's global-mode capture forbids (the refusal would invalidate that capture).
    const detail::deferred_relaxed_capture_mode relaxed;
    require_driver();
    const int device = device_;
    const allocation_options opts{props.handle_types, false};
    const std::size_t g = detail::check_pool_properties(props, device, opts);
    // Physical memory comes in granules: a limit between two holds the smaller, so that the
    // pool never holds more than max_size.
    props_.max_size = props.max_size / g * g;
    std::size_t space = props.address_space;
    if (space == 0) {
      std::size_t physical = props_.max_size;
      if (physical == 0) {
        physical = props.location.is_device()
                       ? device_memory(device).total
                       : static_cast<std::size_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
      }
      // Room for runs to grow in place (large allocations start in the middle of free
      // addresses) and for defragmentation to remap into: addresses cost nothing until mapped.
      // Capped, so that neither a huge memory nor the product overflows.
      space = physical > detail::max_pool_bytes / 4 ? detail::max_pool_bytes : 4 * physical;
    }
    std::vector<access_descriptor> access{{props.location, access_flags::read_write}};
    if (props.location.is_host()) access.push_back({memory_location::device(device), access_flags::read_write});
    detail::core_options o;
    o.max_size = props_.max_size;
    o.release_threshold = props.release_threshold;
    o.chunk_size = props.compact && props.chunk_size == 0 ? g : props.chunk_size;
    o.own_chunk_for_large = false;
    o.own_chunk_to_grow = !props.compact;
    o.address_space = space;
    props_.address_space = space;  // properties() reports the limit in force
    o.on_reserve = [this](std::uint64_t base, std::uint64_t size) { detail::pools().add(this, base, size); };
    o.reuse = props.reuse;
    detail::ensure_context(device);
    // What the core's device-wide synchronization accounting names (see open_sync_domain): the
    // pool's device, and the devices it grants access to later, whose streams may then free
    // here. The domain lives as long as the core, which graphs may keep past the pool.
    const int domain = detail::ordering().open_sync_domain(device);
    o.device = domain;
    access_.set_sync_domain(domain);
    bool deleter_owns_domain = false;
    try {
      std::unique_ptr<detail::vmm_pool_core> made(
          new detail::vmm_pool_core(detail::vmm_backend(props.location, opts, std::move(access)), o));
      deleter_owns_domain = true;
      // Shared: graphs made by capture hold it too (pool_graph_tie). Whoever lets go last
      // gives its memory back.
      core_ = std::shared_ptr<detail::vmm_pool_core>(made.release(), [domain](detail::vmm_pool_core* c) {
        // The backend's destructor unmaps, frees the addresses and destroys the spare events:
        // relaxed, as the core's own calls (whichever thread lets go last, a capturing one too).
        const detail::deferred_relaxed_capture_mode relaxed;
        (void)c->shutdown();
        delete c;
        detail::ordering().close_sync_domain(domain);
      });
    } catch (...) {
      if (!deleter_owns_domain) detail::ordering().close_sync_domain(domain);
      detail::pools().remove(this);
      throw;
    }
    if (props.location.is_device()) {
      try {
        detail::cores_by_device().add(device, core_);
      } catch (...) {
        close();
        throw;
      }
    }
  }

  // Refs, resources, buffers and the pointer directory hold its address.
  pool_state(const pool_state&) = delete;
  pool_state& operator=(const pool_state&) = delete;

  /// Closes the pool, reporting live allocations on stderr (see `pool::~pool`).
  ~pool_state() {
    if (!core_) return;
    const pool_close_report r = close();
    if (r.live_allocations != 0) {
      std::fprintf(stderr,
                   "streamalloc: a pool on %s was destroyed with %zu live allocation(s), %zu bytes; "
                   "their memory has been released\n",
                   props_.location.to_string().c_str(), r.live_allocations, r.live_bytes);
    }
  }

  /// See `pool::close`.
  pool_close_report close() noexcept {
    if (!core_) return {};
    const detail::deferred_relaxed_capture_mode relaxed;  // see the deleter in the constructor
    {
      std::lock_guard lock(ipc_mutex_);
      exporter_.reset();  // no importer gets anything once closing has begun
    }
    detail::pools().remove(this);
    detail::forget_current_pool(this);
    pool_statistics stats;
    try {
      stats = core_->statistics();
    } catch (...) {  // out of host memory: the report says less
    }
    if (stats.live_allocations != 0 || core_->frees_in_flight()) {
      // Every device that ever had access may run work on the memory (see set_access).
      access_.for_each_user([](int d) {
        try {
          synchronize_device(d);
        } catch (...) {  // a lost context: no work of it runs any more
        }
      });
    }
    if (core_->graphs_alive() == 0) {
      const auto [count, bytes] = core_->shutdown();
      core_.reset();
      return {static_cast<std::size_t>(count), static_cast<std::size_t>(bytes)};
    }
    // Graphs made by capture still hold memory of this pool: it stays mapped at their fixed
    // addresses until the last of them is gone (the core is theirs now). The rest goes back
    // to the device at once.
    try {
      core_->trim_to(0);
    } catch (...) {  // it goes when the graphs do
    }
    core_.reset();
    return {stats.live_allocations, stats.used_current};
  }

  /// Its core's address, which graph ties name (null once closed).
  [[nodiscard]] const void* core_address() const noexcept { return core_.get(); }

  /// True once `close()` has run: the pool then holds nothing and refuses every use.
  [[nodiscard]] bool closed() const noexcept { return core_ == nullptr; }

  // The operations of `pool_interface`, which documents them, on this state.
  [[nodiscard]] void* allocate(std::size_t bytes, stream_ref s, placement where = placement::packed) {
    if (!core_) [[unlikely]] throw_closed("allocate");
    if (bytes == 0) return nullptr;
    // Capture first: a capturing stream cannot be looked up (see captured_stream).
    const detail::capture_info capture = detail::capture_of(s.get(), "streamalloc::pool::allocate");
    if (capture.id != 0) [[unlikely]] return allocate_in_capture(bytes, s, capture);
    const detail::stream_key key = detail::key_of_uncaptured(s);
    if (key.record->device() != device_) [[unlikely]] access_.require("allocate", key.record->device());
    return allocate_keyed(bytes, [&](std::uint64_t n) { return core_->allocate(n, key, where); });
  }

  void deallocate(void* p, stream_ref s) {
    if (!core_) [[unlikely]] throw_closed("deallocate");
    if (p == nullptr) return;
    const detail::capture_info capture = detail::capture_of(s.get(), "streamalloc::pool::deallocate");
    if (capture.id != 0) [[unlikely]] return deallocate_in_capture(p, s, capture);
    const detail::stream_key key = detail::key_of_uncaptured(s);
    if (key.record->device() != device_) [[unlikely]] access_.require("deallocate", key.record->device());
    core_->deallocate(reinterpret_cast<std::uint64_t>(p), key);
  }

  /// Allocates `bytes` in the graph built by hand `graph` (graph_allocation.hpp), reusing a
  /// block the graph freed where `after(free node)` says the allocation is ordered after it.
  /// `peers` (from graph_peers) get read-write access to the graph's memory for its life.
  template <class After>
  [[nodiscard]] void* allocate_in_graph(std::size_t bytes, detail::capture_info graph, std::uint64_t peers,
                                        After&& after) {
    if (!core_) [[unlikely]] throw_closed("allocate (graph_allocation)");
    access_.note_graph_peers(peers);
    return allocate_keyed(bytes == 0 ? 1 : bytes, [&](std::uint64_t n) {
      return core_->allocate_for_graph(n, graph.id, peers, after, [&] { tie_to_graph(graph); });
    });
  }
  /// The devices `access` names for a graph allocation, as a mask (see pool_access).
  [[nodiscard]] std::uint64_t graph_peers(std::span<const access_descriptor> access, const char* caller) const {
    (void)core(caller);
    return access_.graph_peers(access, caller);
  }
  /// Frees `p` in the graph built by hand `graph`, at free node `node`.
  void free_in_graph(void* p, detail::capture_info graph, CUgraphNode node) {
    if (!core_) [[unlikely]] throw_closed("deallocate (graph free node)");
    core_->deallocate_captured(reinterpret_cast<std::uint64_t>(p), graph.id, reinterpret_cast<std::uint64_t>(node),
                               detail::host_key(), nullptr, [&] { tie_to_graph(graph); });
  }

  [[nodiscard]] void* allocate_sync(std::size_t bytes) {
    if (!core_) [[unlikely]] throw_closed("allocate_sync");
    return allocate_keyed(bytes, [&](std::uint64_t n) { return core_->allocate(n, detail::host_key()); });
  }

  void deallocate_sync(void* p) {
    if (!core_) [[unlikely]] throw_closed("deallocate_sync");
    if (p == nullptr) return;
    core_->deallocate(reinterpret_cast<std::uint64_t>(p), detail::host_key());
  }

  std::size_t grow_in_place(void* p, std::size_t bytes, stream_ref s) {
    if (!core_) [[unlikely]] throw_closed("grow_in_place");
    if (bytes > (std::size_t{1} << 62)) [[unlikely]] return 0;
    // Under capture the captured work runs at each launch, not now: memory free now in this
    // stream's order may be in use then. Growing is refused, as when something is in the way.
    if (detail::capture_of(s.get(), "streamalloc::pool::grow_in_place").id != 0) return 0;
    const detail::stream_key key = detail::key_of_uncaptured(s);
    if (key.record->device() != device_) [[unlikely]] access_.require("grow_in_place", key.record->device());
    return static_cast<std::size_t>(core_->grow_in_place(reinterpret_cast<std::uint64_t>(p), bytes, key));
  }

  std::size_t shrink_in_place(void* p, std::size_t bytes, stream_ref s) {
    if (!core_) [[unlikely]] throw_closed("shrink_in_place");
    // Under capture, for the reason grow_in_place gives: the allocation keeps its size.
    if (detail::capture_of(s.get(), "streamalloc::pool::shrink_in_place").id != 0) {
      const auto found = core_->find_live(reinterpret_cast<std::uint64_t>(p));
      if (!found || found->first != reinterpret_cast<std::uint64_t>(p)) {
        throw std::invalid_argument("streamalloc::pool::shrink_in_place: the pointer is not a live allocation of this pool");
      }
      return static_cast<std::size_t>(found->second);
    }
    const detail::stream_key key = detail::key_of_uncaptured(s);
    if (key.record->device() != device_) [[unlikely]] access_.require("shrink_in_place", key.record->device());
    return static_cast<std::size_t>(core_->shrink_in_place(reinterpret_cast<std::uint64_t>(p), bytes, key));
  }

  [[nodiscard]] bool owns(const void* p) const noexcept {
    return core_ && core_->owns(reinterpret_cast<std::uint64_t>(p));
  }

  [[nodiscard]] pool_statistics statistics() const { return core("statistics").statistics(); }

  /// See `pool::snapshot`.
  [[nodiscard]] std::string snapshot() const {
    detail::vmm_pool_core& c = core("snapshot");
    const pool_statistics s = c.statistics();
    const detail::core_snapshot taken = c.snapshot();
    return detail::snapshot_json(device_, props_, s, taken, detail::device_memory_now(props_.location));
  }
  /// See `pool::keep_history`.
  void keep_history(std::size_t events) { core("keep_history").history().keep(events); }
  /// See `pool::set_out_of_memory_handler`.
  void set_out_of_memory_handler(std::function<bool(const out_of_memory&)> handler) {
    (void)core("set_out_of_memory_handler");
    out_of_memory_.set_handler(std::move(handler));
  }
  void reset_high_water() { core("reset_high_water").reset_high_water(); }

  void trim_to(std::size_t keep) { core("trim_to").trim_to(keep); }

  host_order synchronize() {
    if (!core_) [[unlikely]] throw_closed("synchronize");
    if (props_.location.is_device()) {
      // The peers that had access first: their streams' frees are this pool's too. The proof
      // returned is the memory's own device's.
      access_.for_each_user([&](int d) {
        if (d != device_) (void)synchronize_device(d);
      });
      return synchronize_device(props_.location.id());
    }
    host_order last = synchronize_device(0);
    for (int d = 1; d < device_count(); ++d) last = synchronize_device(d);
    return last;
  }

  void set_release_threshold(std::size_t bytes) {
    core("set_release_threshold").set_release_threshold(bytes);
    props_.release_threshold = bytes;
  }
  void set_reuse_policy(reuse_policy r) {
    core("set_reuse_policy").set_reuse(r);
    props_.reuse = r;
  }

  [[nodiscard]] const pool_properties& properties() const noexcept { return props_; }
  [[nodiscard]] memory_location location() const noexcept { return props_.location; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] std::size_t granularity() const { return core("granularity").granularity(); }

  void set_access(std::span<const access_descriptor> who) {
    detail::vmm_pool_core& c = core("set_access");
    access_.set(who, [&](const std::vector<access_descriptor>& changes) {
      detail::ensure_context(device_);
      // cuMemSetAccess is a call another thread's global-mode capture forbids.
      const detail::relaxed_capture_mode relaxed;
      c.backend().set_access(changes);
    });
  }

  [[nodiscard]] access_flags access(memory_location where) const {
    (void)core("access");
    return access_.of(where);
  }

  /// May streams of `device` allocate here and free here? (see pool_access)
  [[nodiscard]] bool serves(int device) const noexcept { return access_.serves(device); }

  // IPC (ipc.hpp documents these as export_pool and export_pointer).
  void export_ipc(std::string path) {
    auto& c = core("export_pool");
    (void)c;
    if (props_.handle_types == shareable_handle_type::none) {
      throw std::invalid_argument("streamalloc::export_pool: the pool was made without handle types; make it with "
                                  "pool_properties::handle_types = shareable_handle_type::posix_fd to share it");
    }
    std::lock_guard lock(ipc_mutex_);
    if (exporter_) {
      throw std::invalid_argument("streamalloc::export_pool: the pool is exported at '" + exporter_->path() +
                                  "' already");
    }
    exporter_ = std::make_unique<detail::ipc::exporter>(
        core_, detail::ipc::pool_identity{props_.location, device_, props_.handle_types}, std::move(path));
  }
  [[nodiscard]] ipc_descriptor export_pointer(const void* p) {
    (void)core("export_pointer");
    std::lock_guard lock(ipc_mutex_);
    if (!exporter_) {
      throw std::invalid_argument("streamalloc::export_pointer: the pool is not exported (call export_pool first)");
    }
    return exporter_->describe(reinterpret_cast<std::uint64_t>(p));
  }
  /// Importers connected now (0 when not exported).
  [[nodiscard]] std::size_t importers() {
    std::lock_guard lock(ipc_mutex_);
    return exporter_ ? exporter_->sessions() : 0;
  }

  [[nodiscard]] std::optional<std::pair<void*, std::size_t>> find_allocation(const void* p) {
    auto r = core("find_allocation").find_live(reinterpret_cast<std::uint64_t>(p));
    if (!r) return std::nullopt;
    return std::pair{reinterpret_cast<void*>(r->first), static_cast<std::size_t>(r->second)};
  }

 private:
  template <class>
  friend class pool_interface;

  /// The core, for a member that is not on an allocation's path; throws once closed.
  detail::vmm_pool_core& core(const char* member) const {
    if (!core_) [[unlikely]] throw_closed(member);
    return *core_;
  }

  // The paths of a capturing stream, out of line: kept out of the fast path's code, which
  // the compiler then lays out and inlines as if capture did not exist.
  STREAMALLOC_COLD void* allocate_in_capture(std::size_t bytes, stream_ref s, detail::capture_info capture) {
    const std::uint64_t token = captured_stream(s, "allocate");
    // The devices with access now keep it to the graph's memory, as an allocation node keeps
    // the pool's access of capture time (spec 003), whatever set_access does later.
    const std::uint64_t peers = access_.peers_now();
    return allocate_keyed(bytes, [&](std::uint64_t n) {
      return core_->allocate_captured(n, capture.id, token, peers, [&] { tie_to_graph(capture); });
    });
  }
  STREAMALLOC_COLD void deallocate_in_capture(void* p, stream_ref s, detail::capture_info capture) {
    const std::uint64_t token = captured_stream(s, "deallocate");
    // The stream's record when the reference carries it (CUDA cannot be asked during the
    // capture): the pool then takes memory this graph adopts back in that stream's order.
    detail::stream_key freer{s.known_record(), s.get()};
    core_->deallocate_captured(reinterpret_cast<std::uint64_t>(p), capture.id, token, detail::host_key(),
                               freer.record != nullptr ? &freer : nullptr, [&] { tie_to_graph(capture); });
  }

  [[noreturn]] STREAMALLOC_COLD static void throw_closed(const char* member) {
    throw pool_closed(std::string("streamalloc::pool::") + member +
                      ": the pool is closed (close() released its memory and addresses)");
  }
  [[noreturn]] STREAMALLOC_COLD static void throw_moved_from(const char* member) {
    throw pool_closed(std::string("streamalloc::pool::") + member +
                      ": the pool was moved from (its memory belongs to the pool it was moved into)");
  }

  /// `allocate(bytes)` from the core, its refusals in the pool's words.
  template <class Allocate>
  void* allocate_keyed(std::size_t bytes, Allocate&& allocate) {
    if (bytes == 0) return nullptr;
    if (bytes > (std::size_t{1} << 62)) [[unlikely]] {
      throw out_of_memory(bytes, "streamalloc: " + std::to_string(bytes) + " bytes is more than any pool can hold");
    }
    for (;;) {
      std::optional<out_of_memory> failure;
      try {
        return reinterpret_cast<void*>(allocate(static_cast<std::uint64_t>(bytes)));
      } catch (const detail::core_out_of_memory& e) {
        failure.emplace(detail::out_of_memory_report::describe(bytes, e, *core_, props_.location));
      }
      // Out of the catch, so that no lock of the pool is held (see out_of_memory_report::retry).
      if (!out_of_memory_.retry(*failure)) throw *failure;
    }
  }

  /// The token of a capturing stream for in-graph reuse, checking its device when known. CUDA
  /// refuses to tell a capturing stream's id or context, so a raw handle is not looked up: its
  /// value names it (a stream destroyed while captured ends its capture if it began it, and
  /// otherwise leaves a capture that then ends without a graph, so a later stream given the
  /// same value never shares a graph with it), and its device is not
  /// checked (a `stream` or resolved `stream_ref` carries its record, and is). The per-thread
  /// default stream's handle names another stream on each thread.
  std::uint64_t captured_stream(stream_ref s, const char* member) const {
    if (const detail::stream_record* r = s.known_record(); r != nullptr && r->device() != device_) [[unlikely]] {
      access_.require(member, r->device());
    }
    if (detail::is_per_thread_handle(s.get())) {
      static thread_local const char this_thread = 0;
      return reinterpret_cast<std::uint64_t>(&this_thread);
    }
    return reinterpret_cast<std::uint64_t>(s.get());
  }

  /// Ties a new graph segment to the graph of `capture`: a user object owning a
  /// pool_graph_tie, moved into the graph being captured (the driver allows that during the
  /// capture), and registered for end_capture to find. Called by the core under its lock; on
  /// failure the core forgets the segment.
  void tie_to_graph(detail::capture_info capture) {
    // The synchronous pseudo-stream's record, made now if it is the first use in the process:
    // the graph's release (on the reaper, where nothing may throw) asks for it.
    (void)detail::host_key();
    auto& reaper = detail::graph_reaper::instance();
    reaper.start();
    auto tie = std::make_unique<detail::pool_graph_tie>(core_, capture.id, device_);
    CUuserObject object = nullptr;
    detail::cu::cuUserObjectCreate(&object, tie.get(), &detail::on_graph_gone, 1u,
                                   static_cast<unsigned>(CU_USER_OBJECT_NO_DESTRUCTOR_SYNC));
    detail::graph_tie* held = tie.release();  // the user object's now
    held->object = object;
    reaper.note_held();
    const CUresult r = detail::cu::cuGraphRetainUserObject_nothrow(capture.graph, object, 1u,
                                                                   static_cast<unsigned>(CU_GRAPH_USER_OBJECT_MOVE));
    if (r != CUDA_SUCCESS) {
      held->cancelled = true;  // its destructor still runs, through the reaper
      (void)detail::cu::cuUserObjectRelease_nothrow(object, 1u);
      detail::throw_driver_failure(r, "cuGraphRetainUserObject",
                                   "tying the memory of an allocation under stream capture to the graph");
    }
    try {
      detail::graph_tie_registry::instance().add(held);
    } catch (...) {  // out of host memory: end_capture will not find it; executables keep the user object
    }
  }

  /// The device whose streams allocate here: the memory's own, or device 0 for host memory.
  static int home_device(memory_location where) noexcept { return where.is_device() ? where.id() : 0; }

  pool_properties props_;
  int device_ = 0;  ///< the device whose streams may allocate here (and devices granted access)
  detail::pool_access access_;
  std::shared_ptr<detail::vmm_pool_core> core_;
  detail::out_of_memory_report out_of_memory_;
  std::mutex ipc_mutex_;
  std::unique_ptr<detail::ipc::exporter> exporter_;  // serving importers, once exported
};

}  // namespace streamalloc::detail
