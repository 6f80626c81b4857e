#pragma once

// The state behind a `pool` (see <streamalloc/pool.hpp>): the pool core over the VMM backend,
// and what a pool adds around it (capture, graphs, peer access, IPC export). The checks of a
// pool's properties are in property_checks.hpp, the process-wide directories of pools in
// pool_registry.hpp.

#include <streamalloc/access.hpp>
#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/core/pool_core.hpp>
#include <streamalloc/detail/ipc/exporter.hpp>
#include <streamalloc/detail/pool/capture.hpp>
#include <streamalloc/detail/pool/graph_ties.hpp>
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

/// The key of a stream the caller has just found not capturing (capture_of).
inline stream_key key_of_uncaptured(stream_ref s) {
  stream_record* known = s.known_record();
  return {known != nullptr ? known : &resolve_uncaptured_stream(s.get()), s.get()};
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
    try {
      ensure_context(device);
    } catch (...) {  // the context is gone: so is the memory
      return;
    }
    core->release_graph(capture, host_key());
  }

  std::string launch_refusal(bool auto_free) override { return core->graph_launch_refusal(capture, auto_free); }
  void launched() noexcept override { core->graph_launched(capture); }
  void bind(std::uint64_t stream, CUevent last) noexcept override {
    core->bind_graph_memory(capture, stream, [last] {
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
  explicit pool_state(pool_properties props) : props_(props) {
    require_driver();
    const int device = props.location.is_device() ? props.location.id() : 0;
    device_ = device;
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
    o.own_chunk_for_large = !props.compact;
    o.address_space = space;
    props_.address_space = space;  // properties() reports the limit in force
    o.on_reserve = [this](std::uint64_t base, std::uint64_t size) { detail::pools().add(this, base, size); };
    o.reuse = props.reuse;
    device_access_[static_cast<std::size_t>(device)].store(access_flags::read_write, std::memory_order_relaxed);
    users_.store(std::uint64_t{1} << device, std::memory_order_relaxed);
    detail::ensure_context(device);
    // What the core's device-wide synchronization accounting names (see open_sync_domain): the
    // pool's device, and the devices it grants access to later, whose streams may then free
    // here. The domain lives as long as the core, which graphs may keep past the pool.
    const int domain = detail::ordering().open_sync_domain(device);
    o.device = domain;
    sync_domain_ = domain;
    bool deleter_owns_domain = false;
    try {
      std::unique_ptr<detail::vmm_pool_core> made(
          new detail::vmm_pool_core(detail::vmm_backend(props.location, opts, std::move(access)), o));
      deleter_owns_domain = true;
      // Shared: graphs made by capture hold it too (pool_graph_tie). Whoever lets go last
      // gives its memory back.
      core_ = std::shared_ptr<detail::vmm_pool_core>(made.release(), [domain](detail::vmm_pool_core* c) {
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
      for_each_user([](int d) {
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
    if (key.record->device() != device_) [[unlikely]] require_access("allocate", key.record->device());
    return allocate_keyed(bytes, [&](std::uint64_t n) { return core_->allocate(n, key, where); });
  }

  void deallocate(void* p, stream_ref s) {
    if (!core_) [[unlikely]] throw_closed("deallocate");
    if (p == nullptr) return;
    const detail::capture_info capture = detail::capture_of(s.get(), "streamalloc::pool::deallocate");
    if (capture.id != 0) [[unlikely]] return deallocate_in_capture(p, s, capture);
    const detail::stream_key key = detail::key_of_uncaptured(s);
    if (key.record->device() != device_) [[unlikely]] require_access("deallocate", key.record->device());
    core_->deallocate(reinterpret_cast<std::uint64_t>(p), key);
  }

  /// Allocates `bytes` in the graph built by hand `graph` (graph_allocation.hpp), reusing a
  /// block the graph freed where `after(free node)` says the allocation is ordered after it.
  /// `peers` (from graph_peers) get read-write access to the graph's memory for its life.
  template <class After>
  [[nodiscard]] void* allocate_in_graph(std::size_t bytes, detail::capture_info graph, std::uint64_t peers,
                                        After&& after) {
    if (!core_) [[unlikely]] throw_closed("allocate (graph_allocation)");
    note_graph_peers(peers);
    return allocate_keyed(bytes == 0 ? 1 : bytes, [&](std::uint64_t n) {
      return core_->allocate_for_graph(n, graph.id, peers, after, [&] { tie_to_graph(graph); });
    });
  }
  /// The devices `access` names for a graph allocation, as a mask (bit d: device d), checked
  /// as spec 003 says of an allocation node's access descriptors: devices only, read-write
  /// only; the pool's own device may be named (it has access anyway). Throws
  /// std::invalid_argument or not_supported, naming the descriptor, before anything changes.
  [[nodiscard]] std::uint64_t graph_peers(std::span<const access_descriptor> access, const char* caller) const {
    (void)core(caller);
    const std::string who = std::string("streamalloc::") + caller + ": ";
    std::uint64_t peers = 0;
    for (const access_descriptor& d : access) {
      if (!d.location.is_device()) {
        throw std::invalid_argument(who + d.location.to_string() + " cannot be given access to graph memory: the "
                                    "peers of a graph allocation are devices");
      }
      if (d.flags != access_flags::read_write) {
        throw std::invalid_argument(who + d.location.to_string() + " is asked access_flags " +
                                    std::to_string(static_cast<unsigned>(d.flags)) +
                                    ": the peers of a graph allocation get read_write only, as the driver's "
                                    "allocation nodes do");
      }
      if (check_grant(d, who)) peers |= std::uint64_t{1} << d.location.id();  // not the pool's own device
    }
    return peers;
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
    if (key.record->device() != device_) [[unlikely]] require_access("grow_in_place", key.record->device());
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
    if (key.record->device() != device_) [[unlikely]] require_access("shrink_in_place", key.record->device());
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
    return detail::snapshot_json(device_, props_, s, taken, device_memory_now());
  }
  /// See `pool::keep_history`.
  void keep_history(std::size_t events) { core("keep_history").history().keep(events); }
  /// See `pool::set_out_of_memory_handler`.
  void set_out_of_memory_handler(std::function<bool(const out_of_memory&)> handler) {
    (void)core("set_out_of_memory_handler");
    auto h = handler ? std::make_shared<const std::function<bool(const out_of_memory&)>>(std::move(handler)) : nullptr;
    std::lock_guard lock(oom_mutex_);
    oom_handler_ = std::move(h);
  }
  void reset_high_water() { core("reset_high_water").reset_high_water(); }

  void trim_to(std::size_t keep) { core("trim_to").trim_to(keep); }

  host_order synchronize() {
    if (!core_) [[unlikely]] throw_closed("synchronize");
    if (props_.location.is_device()) {
      // The peers that had access first: their streams' frees are this pool's too. The proof
      // returned is the memory's own device's.
      for_each_user([&](int d) {
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
    // One change at a time: each is checked against the access in force, and the flags read
    // by allocate follow the driver's state in the order the changes are made.
    std::lock_guard lock(access_change_);
    std::vector<access_descriptor> changes;
    for (std::size_t i = 0; i < who.size(); ++i) {
      const access_descriptor& d = who[i];
      for (std::size_t j = 0; j < i; ++j) {
        if (who[j].location == d.location) {
          throw std::invalid_argument("streamalloc::pool::set_access: " + d.location.to_string() +
                                      " is named twice in one call");
        }
      }
      // What a device has already costs no driver call (revoking what a device never had
      // included: the driver might not even accept that for a device that is not a peer).
      if (check_grant(d) && device_access_[static_cast<std::size_t>(d.location.id())].load(
                                std::memory_order_relaxed) != d.flags) {
        changes.push_back(d);
      }
    }
    if (changes.empty()) return;
    for (const access_descriptor& d : changes) {
      if (d.flags == access_flags::none) continue;
      // Before the driver is asked: from now on, work of that device may use the memory, and
      // a synchronization of the pool's memory must cover it (for the rest of its life: work
      // it enqueued may outlive a revocation).
      users_.fetch_or(std::uint64_t{1} << d.location.id(), std::memory_order_acq_rel);
      detail::ordering().add_domain_user(sync_domain_, d.location.id());
    }
    // A revoked device's streams are refused before its access goes; a granted one's only
    // once it has it.
    std::vector<std::pair<int, access_flags>> lowered;
    for (const access_descriptor& d : changes) {
      auto& slot = device_access_[static_cast<std::size_t>(d.location.id())];
      const access_flags was = slot.load(std::memory_order_relaxed);
      if (rank(d.flags) < rank(was)) {
        lowered.emplace_back(d.location.id(), was);
        slot.store(d.flags, std::memory_order_release);
      }
    }
    try {
      detail::ensure_context(device_);
      // cuMemSetAccess is a call another thread's global-mode capture forbids.
      const detail::relaxed_capture_mode relaxed;
      c.backend().set_access(changes);
    } catch (...) {
      for (const auto& [dev, was] : lowered) device_access_[static_cast<std::size_t>(dev)].store(was, std::memory_order_release);
      throw;
    }
    for (const access_descriptor& d : changes) {
      device_access_[static_cast<std::size_t>(d.location.id())].store(d.flags, std::memory_order_release);
    }
  }

  [[nodiscard]] access_flags access(memory_location where) const {
    (void)core("access");
    if (where.is_host()) return props_.location.is_host() ? access_flags::read_write : access_flags::none;
    if (where.id() >= detail::max_devices) return access_flags::none;
    return device_access_[static_cast<std::size_t>(where.id())].load(std::memory_order_acquire);
  }

  /// May streams of `device` allocate here and free here? Its own device's, and those of
  /// devices granted access (read or read-write).
  [[nodiscard]] bool serves(int device) const noexcept {
    if (device == device_) return true;
    return device >= 0 && device < detail::max_devices &&
           device_access_[static_cast<std::size_t>(device)].load(std::memory_order_acquire) != access_flags::none;
  }

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
    std::uint64_t peers = 0;
    for_each_user([&](int d) {
      if (d != device_ && device_access_[static_cast<std::size_t>(d)].load(std::memory_order_acquire) != access_flags::none) {
        peers |= std::uint64_t{1} << d;
      }
    });
    return allocate_keyed(bytes, [&](std::uint64_t n) {
      return core_->allocate_captured(n, capture.id, token, peers, [&] { tie_to_graph(capture); });
    });
  }
  /// Devices given access to graph memory run work on the pool's memory: a synchronization of
  /// it covers them from now on (as set_access's grants).
  void note_graph_peers(std::uint64_t peers) {
    if ((users_.load(std::memory_order_acquire) & peers) == peers) return;
    std::lock_guard lock(access_change_);
    for (int d = 0; d < detail::max_devices; ++d) {
      if ((peers >> d & 1) == 0 || (users_.load(std::memory_order_relaxed) >> d & 1) != 0) continue;
      users_.fetch_or(std::uint64_t{1} << d, std::memory_order_acq_rel);
      detail::ordering().add_domain_user(sync_domain_, d);
    }
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

  /// A stream of another device than the pool's: served when that device has access, else
  /// refused. Out of line: the pool's own device's streams never come here.
  STREAMALLOC_COLD void require_access(const char* member, int stream_device) const {
    if (!serves(stream_device)) throw_wrong_device(member, stream_device);
  }

  [[noreturn]] STREAMALLOC_COLD void throw_wrong_device(const char* member, int stream_device) const {
    const std::string grant = "grant device " + std::to_string(stream_device) +
                              " access first (pool.set_access(streamalloc::memory_location::device(" +
                              std::to_string(stream_device) + "), streamalloc::access_flags::read_write))";
    const std::string advice = std::string(member) == "allocate"
                                   ? grant + ", or allocate from that device's pool (streamalloc::current_pool(" +
                                         std::to_string(stream_device) + "))"
                                   : grant + ", or use a stream of device " + std::to_string(device_);
    throw std::invalid_argument(std::string("streamalloc::pool::") + member + ": the stream belongs to device " +
                                std::to_string(stream_device) + ", but this pool's memory (" +
                                props_.location.to_string() + ") is for device " + std::to_string(device_) +
                                " and the devices granted access, and device " + std::to_string(stream_device) +
                                " has none; " + advice);
  }

  /// none < read < read_write.
  static int rank(access_flags f) noexcept {
    return f == access_flags::read_write ? 2 : f == access_flags::read ? 1 : 0;
  }

  /// Checks one change of `set_access` against what the memory allows, before anything is
  /// changed. False when it changes nothing (read-write for the memory's own location).
  bool check_grant(const access_descriptor& d, const std::string& who = "streamalloc::pool::set_access: ") const {
    if (d.flags != access_flags::none && d.flags != access_flags::read && d.flags != access_flags::read_write) {
      throw std::invalid_argument(who + "access_flags " + std::to_string(static_cast<unsigned>(d.flags)) +
                                  " for " + d.location.to_string() + " is none of none, read, read_write");
    }
    const char* const flags_name = d.flags == access_flags::read ? "read" : "none";
    if (d.location.is_host()) {
      if (props_.location.is_device()) {
        throw std::invalid_argument(who + "the host cannot be given access to this pool's memory, which lives on " +
                                    props_.location.to_string() +
                                    " (the CPU cannot map device memory: make a pool on a host location for memory "
                                    "the CPU uses)");
      }
      if (d.flags != access_flags::read_write) {
        throw std::invalid_argument(who + "the host's access to this pool's memory, which lives on " +
                                    props_.location.to_string() + ", cannot be reduced (asked: " + flags_name + ")");
      }
      return false;
    }
    const int dev = d.location.id();
    if (dev >= device_count()) throw std::invalid_argument(who + "there is no device " + std::to_string(dev));
    if (dev >= detail::max_devices) {
      throw std::invalid_argument(who + "device " + std::to_string(dev) + " is beyond the devices streamalloc serves (0 to " +
                                  std::to_string(detail::max_devices - 1) + ")");
    }
    if (dev == device_) {
      if (d.flags != access_flags::read_write) {
        const std::string why = props_.location.is_device()
                                    ? "the memory lives there"
                                    : "the pool was made for it (its streams allocate here)";
        throw std::invalid_argument(who + "device " + std::to_string(dev) +
                                    "'s access to this pool's memory cannot be removed or reduced (asked: " +
                                    flags_name + "): " + why);
      }
      return false;
    }
    if (d.flags == access_flags::none) return true;  // revoking needs no capability
    if (props_.location.is_device()) {
      int can = 0;
      detail::check(detail::cu::cuDeviceCanAccessPeer_nothrow(&can, detail::device_handle(dev),
                                                              detail::device_handle(device_)),
                    "cuDeviceCanAccessPeer", [&] {
                      return "asking whether device " + std::to_string(dev) + " can access the memory of device " +
                             std::to_string(device_);
                    });
      if (can == 0) {
        // Refused here, not by the driver: on a pool that holds no memory yet the driver's
        // own grant succeeds, and the next allocation fails instead (spec: the SetAccess trap).
        throw not_supported(who + "device " + std::to_string(dev) + " cannot access the memory of device " +
                            std::to_string(device_) + ", where this pool's memory lives: they are not peers "
                            "(cuDeviceCanAccessPeer(" + std::to_string(dev) + ", " + std::to_string(device_) +
                            ") is 0)");
      }
      return true;
    }
    // Host memory: any device that can map memory of that kind through the VMM API.
    const device_capabilities c = query_capabilities(dev);
    const bool numa = props_.location.type() == memory_location::kind::host_numa;
    const char* missing = !c.virtual_memory                   ? "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
                          : numa && !c.host_numa_memory       ? "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
                          : !numa && !c.host_memory           ? "HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
                                                              : nullptr;
    if (missing != nullptr) {
      throw not_supported(who + "device " + std::to_string(dev) + " cannot access this pool's memory on " +
                          props_.location.to_string() + ": it cannot map " + (numa ? "host NUMA" : "host") +
                          " memory through the VMM API (CU_DEVICE_ATTRIBUTE_" + missing + " is 0)");
    }
    return true;
  }

  /// Calls `f(device)` for the pool's device and every device ever granted access.
  template <class F>
  void for_each_user(F&& f) const {
    const std::uint64_t users = users_.load(std::memory_order_acquire);
    for (int d = 0; d < detail::max_devices; ++d) {
      if ((users >> d & 1) != 0) f(d);
    }
  }

  /// The part of an out-of-memory message that blames the addresses, when they are short:
  /// when the least the pool could have grown by for `bytes` does not fit in the addresses it
  /// may still use (every mapped byte takes one address, so at most `address_space - reserved`
  /// are left), or when the driver refused to reserve more (the process's addresses ran out),
  /// growing was impossible whatever memory the device has. Addresses too fragmented for the
  /// growth are not detected: the message then says nothing rather than blame them wrongly.
  std::string address_shortage(std::size_t bytes) const {
    const auto& o = core_->options();
    const std::uint64_t g = core_->granularity();
    const std::uint64_t space = core_->address_space();
    const std::uint64_t mapped = core_->statistics().reserved_current;
    const std::uint64_t taken = core_->addresses_reserved();
    // A request of a chunk or more (outside compact pools) grows by its own size, rounded to
    // the granularity; any other by whole chunks, at least one (fewer bytes when extending a
    // free tail, but never less than a chunk), except under max_size, where a single granule
    // may do.
    std::uint64_t least = o.max_size == 0 ? o.chunk_size : g;
    if (o.own_chunk_for_large && bytes >= o.chunk_size) least = (bytes + g - 1) / g * g;
    if (const std::uint64_t refused = core_->refused_reservation(); refused != 0) {
      return " (the process's virtual addresses ran out: the driver refused to reserve " + std::to_string(refused) +
             " more bytes of addresses for the pool, which holds " + std::to_string(taken) + " bytes of addresses, " +
             std::to_string(mapped) + " of them mapped)";
    }
    if (mapped <= space && least <= space - mapped) return {};
    return " (the pool's addresses are used up: it may reserve " + std::to_string(space) + " bytes of addresses, " +
           std::to_string(mapped) + " of them mapped, and growing for this request needs " + std::to_string(least) +
           " more: raise pool_properties::address_space)";
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
        failure.emplace(bytes, "streamalloc: cannot allocate " + std::to_string(bytes) + " bytes from a pool on " +
                                   props_.location.to_string() + ": " + e.reason + address_shortage(bytes) +
                                   device_memory_words());
      }
      // The handler runs with no lock of the pool held: it may free, synchronize or trim.
      std::shared_ptr<const std::function<bool(const out_of_memory&)>> handler;
      {
        std::lock_guard lock(oom_mutex_);
        handler = oom_handler_;
      }
      if (handler == nullptr || !(*handler)(*failure)) throw *failure;
    }
  }

  /// The device's free and total memory (cuMemGetInfo in its primary context), for device
  /// pools; unknown when the driver does not answer.
  detail::device_memory_info device_memory_now() const noexcept {
    if (!props_.location.is_device()) return {};
    try {
      const detail::scoped_context on_device(detail::primary_context(device_));
      std::size_t free = 0, total = 0;
      if (detail::cu::cuMemGetInfo_nothrow(&free, &total) == CUDA_SUCCESS) return {true, free, total};
    } catch (...) {  // no context: the report says less
    }
    return {};
  }
  std::string device_memory_words() const {
    const detail::device_memory_info m = device_memory_now();
    if (!m.known) return {};
    return "; the device has " + std::to_string(m.free) + " bytes free of " + std::to_string(m.total);
  }

  /// The token of a capturing stream for in-graph reuse, checking its device when known. CUDA
  /// refuses to tell a capturing stream's id or context, so a raw handle is not looked up: its
  /// value names it (a stream cannot be destroyed while captured), and its device is not
  /// checked (a `stream` or resolved `stream_ref` carries its record, and is). The per-thread
  /// default stream's handle names another stream on each thread.
  std::uint64_t captured_stream(stream_ref s, const char* member) const {
    if (const detail::stream_record* r = s.known_record(); r != nullptr && r->device() != device_) [[unlikely]] {
      require_access(member, r->device());
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

  pool_properties props_;
  int device_ = 0;  ///< the device whose streams may allocate here (and devices granted access)
  std::shared_ptr<detail::vmm_pool_core> core_;
  int sync_domain_ = 0;  ///< the core's synchronization domain (ordering.hpp)
  // Peer access (set_access): what each device may do, read on the allocation path of another
  // device's stream; the devices ever granted (bit d: device d), whose work a synchronization
  // of the pool's memory covers; changes one at a time.
  std::array<std::atomic<access_flags>, detail::max_devices> device_access_{};
  std::atomic<std::uint64_t> users_{0};
  std::mutex access_change_;
  // Called when an allocation fails (set_out_of_memory_handler); replaced whole, read under
  // the mutex and called outside it.
  std::mutex oom_mutex_;
  std::shared_ptr<const std::function<bool(const out_of_memory&)>> oom_handler_;
  std::mutex ipc_mutex_;
  std::unique_ptr<detail::ipc::exporter> exporter_;  // serving importers, once exported
};

}  // namespace streamalloc::detail
