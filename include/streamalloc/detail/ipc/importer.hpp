#pragma once

// The importing side: one connection to an exporting pool, the chunks of it this process has
// imported (each imported once, kept while an import lies on it), and each import's own
// addresses with the pieces mapped into them. Imports end in one of two ways:
// - now (`release`): the caller has made sure no work uses the memory any more;
// - after an event (`release_after`): a thread of the importer's own waits for the event, then
//   unmaps; the exporter is told only after the unmap, so it never reuses memory this process
//   may still touch.

#include <streamalloc/access.hpp>
#include <streamalloc/address_reservation.hpp>
#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/ipc/channel.hpp>
#include <streamalloc/detail/ipc/protocol.hpp>
#include <streamalloc/mapping.hpp>
#include <streamalloc/physical_allocation.hpp>
#include <streamalloc/pool_statistics.hpp>

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace streamalloc::detail::ipc {

class importer {
 public:
  /// Connects to the pool exported at `path` and learns what it is.
  explicit importer(std::string path) : path_(std::move(path)), socket_(connect_to(path_)) {
    request r;
    r.what = kind::hello;
    send_message(socket_.get(), &r, sizeof r);
    if (receive_message(socket_.get(), &hello_, sizeof hello_) != sizeof hello_ || hello_.magic != magic ||
        hello_.version != version) {
      throw std::invalid_argument("streamalloc::imported_pool: '" + path_ +
                                  "' did not answer as a streamalloc pool of this version");
    }
    location_ = hello_.location_kind == static_cast<int>(memory_location::kind::device)
                    ? memory_location::device(hello_.location_id)
                : hello_.location_kind == static_cast<int>(memory_location::kind::host_numa)
                    ? memory_location::host_numa(hello_.location_id)
                    : memory_location::host();
    // The exporter's device, as this process numbers devices (CUDA_VISIBLE_DEVICES may differ):
    // the only one with access at first, as the driver's imported pools have.
    device_ = device_with_uuid(hello_.device);
    if (device_ >= 0) access_.push_back({memory_location::device(device_), access_flags::read_write});
    reaper_ = std::thread([this] { reap(); });
  }
  importer(const importer&) = delete;
  importer& operator=(const importer&) = delete;

  /// Ends the queued releases (their events first), then closes the connection.
  ~importer() {
    {
      std::lock_guard lock(reaper_mutex_);
      stopping_ = true;
    }
    reaper_wake_.notify_all();
    reaper_.join();
  }

  struct imported {
    std::uint64_t id = 0;
    CUdeviceptr address = 0;
    std::size_t size = 0;
  };

  /// Maps the allocation `d` describes; throws std::invalid_argument saying why it cannot.
  imported import(const ipc_descriptor& d) {
    if (d.magic != magic || d.version != version) {
      throw std::invalid_argument("streamalloc::imported_pool::import_pointer: not a descriptor streamalloc made "
                                  "(or of another version)");
    }
    if (d.pool_id != hello_.pool_id) {
      throw std::invalid_argument("streamalloc::imported_pool::import_pointer: the descriptor belongs to another pool "
                                  "than the one exported at '" + path_ + "' (a foreign descriptor)");
    }
    std::lock_guard lock(mutex_);
    request r;
    r.what = kind::import;
    r.descriptor = d;
    import_reply* reply = reply_.get();
    reply->clear();
    exchange(r, reply, sizeof *reply);
    if (reply->refusal.refused()) {
      throw std::invalid_argument(std::string("streamalloc::imported_pool::import_pointer: ") + reply->refusal.text);
    }
    try {
      return map_import(*reply, d.size);
    } catch (...) {
      tell_release(reply->id);
      throw;
    }
  }

  /// Unmaps import `id` and tells the exporter; no work may use it any more.
  void release(std::uint64_t id) noexcept {
    std::lock_guard lock(mutex_);
    const auto it = imports_.find(id);
    if (it == imports_.end()) return;
    imported_bytes_ -= it->second.bytes;
    const std::vector<std::uint64_t> chunks = std::move(it->second.chunks);
    imports_.erase(it);  // its own mappings, if any, go first
    for (auto c : chunks) {
      if (auto ch = chunks_.find(c); ch != chunks_.end() && --ch->second.uses == 0) chunks_.erase(ch);
    }
    tell_release(id);  // after the unmaps: the exporter may reuse the memory from here
  }

  /// Releases import `id` once event `e` (of this process, recorded after the last work on it)
  /// has completed; destroys the event then.
  void release_after(std::uint64_t id, CUevent e) {
    {
      std::lock_guard lock(reaper_mutex_);
      queue_.push_back({id, e});
    }
    reaper_wake_.notify_one();
  }

  /// Waits for every device that may access the imports (before a release without an event).
  /// Allocates nothing: an import given back while the host is out of memory must still wait.
  void synchronize_accessors() {
    std::array<std::uint64_t, (max_devices + 63) / 64> devices{};
    {
      std::lock_guard lock(mutex_);
      for (const auto& a : access_) {
        if (a.location.is_device() && a.flags != access_flags::none && a.location.id() >= 0 &&
            a.location.id() < max_devices) {
          devices[static_cast<std::size_t>(a.location.id()) / 64] |= std::uint64_t{1} << (a.location.id() % 64);
        }
      }
    }
    for (int d = 0; d < max_devices; ++d) {
      if ((devices[static_cast<std::size_t>(d) / 64] >> (d % 64)) & 1) wait_for_device(d);
    }
  }

  /// Grants (or revokes, with access_flags::none) device `who` access to every import, now and later.
  void set_access(memory_location who, access_flags flags) {
    std::lock_guard lock(mutex_);
    std::vector<access_descriptor> next = access_;
    bool found = false;
    for (auto& a : next) {
      if (a.location == who) {
        a.flags = flags;
        found = true;
      }
    }
    if (!found) next.push_back({who, flags});
    for (auto& [key, c] : chunks_) grant(c.va.address(), c.va.size(), next);
    for (auto& [id, imp] : imports_) {
      if (imp.va) grant(imp.va.address(), imp.va.size(), next);
    }
    std::erase_if(next, [](const access_descriptor& a) { return a.flags == access_flags::none; });
    access_ = std::move(next);
  }
  [[nodiscard]] access_flags access(memory_location who) {
    std::lock_guard lock(mutex_);
    for (const auto& a : access_) {
      if (a.location == who) return a.flags;
    }
    return access_flags::none;
  }

  /// Only what this process imported: its allocations (used) and the chunks under them (reserved).
  [[nodiscard]] pool_statistics statistics() {
    std::lock_guard lock(mutex_);
    pool_statistics s;
    s.live_allocations = imports_.size();
    s.used_current = imported_bytes_;
    for (const auto& [id, c] : chunks_) s.reserved_current += c.memory.size();
    s.chunks = chunks_.size();
    return s;
  }

  [[nodiscard]] memory_location location() const noexcept { return location_; }
  /// This process's ordinal of the exporter's device; -1 when it does not see it.
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

 private:
  /// A chunk of the exporter's, imported and mapped whole at addresses of its own.
  struct chunk_entry {
    physical_allocation memory;
    address_reservation va;  // freed after the mapping (declared before it)
    mapping whole;
    std::size_t uses = 0;  // imports on it
  };
  struct import_entry {
    std::vector<std::uint64_t> chunks;
    // Only for a block on several chunks: its own addresses, those chunks mapped there.
    address_reservation va;
    std::vector<mapping> maps;
    std::size_t bytes = 0;
  };
  struct queued {
    std::uint64_t id;
    CUevent event;
  };

  static int device_with_uuid(const CUuuid& u) {
    int n = 0;
    if (cu::cuDeviceGetCount_nothrow(&n) != CUDA_SUCCESS) return -1;
    for (int i = 0; i < n; ++i) {
      CUdevice d = 0;
      CUuuid mine{};
      if (cu::cuDeviceGet_nothrow(&d, i) == CUDA_SUCCESS && cu::cuDeviceGetUuid_nothrow(&mine, d) == CUDA_SUCCESS &&
          std::memcmp(mine.bytes, u.bytes, sizeof mine.bytes) == 0) {
        return i;
      }
    }
    return -1;
  }

  static void wait_for_device(int d) {
    ensure_context(d);
    relaxed_capture_mode relaxed;
    check(cu::cuCtxSynchronize_nothrow(), "cuCtxSynchronize");
  }

  /// Sends `r` and receives the answer (and a descriptor with it); throws when the exporter is gone.
  void exchange(const request& r, void* reply, std::size_t capacity, unique_fd* fd = nullptr) {
    if (!closed_) {
      try {
        send_message(socket_.get(), &r, sizeof r);
        if (receive_message(socket_.get(), reply, capacity, fd, spin_before_sleep) != 0) return;
      } catch (const std::system_error&) {
      }
      closed_ = true;
    }
    throw std::invalid_argument("streamalloc::imported_pool: the pool exported at '" + path_ +
                                "' is gone (its process closed the pool or exited)");
  }

  void tell_release(std::uint64_t id) noexcept {
    if (closed_) return;
    request r;
    r.what = kind::release;
    r.id = id;
    try {
      send_message(socket_.get(), &r, sizeof r);
    } catch (...) {
      closed_ = true;  // the exporter is gone, and with it what it held for us
    }
  }

  /// The chunk `p` lies on, imported once.
  chunk_entry& chunk_of(const piece& p) {
    if (auto it = chunks_.find(p.chunk); it != chunks_.end()) return it->second;
    request r;
    r.what = kind::fetch;
    r.id = p.chunk;
    fetch_reply f;
    unique_fd fd;
    exchange(r, &f, sizeof f, &fd);
    if (f.refusal.refused()) {
      throw std::invalid_argument(std::string("streamalloc::imported_pool::import_pointer: ") + f.refusal.text);
    }
    chunk_entry c;
    c.memory = f.handle_type == static_cast<std::uint32_t>(shareable_handle_type::fabric)
                   ? physical_allocation::import_from_fabric(f.fabric, p.chunk_size)
                   : physical_allocation::import_from_fd(fd.get(), p.chunk_size);
    c.va = address_reservation(p.chunk_size, hello_.granularity);
    c.whole = mapping(c.va.address(), c.memory);
    grant(c.va.address(), c.va.size(), access_);
    return chunks_.emplace(p.chunk, std::move(c)).first->second;
  }

  imported map_import(const import_reply& reply, std::size_t bytes) {
    // The driver maps imported memory only whole (cuMemMap's offset must be 0), so each chunk
    // is mapped once, whole, at addresses of its own, and shared by the imports on it. A block
    // on several chunks (it runs on into the next chunk of the exporter's mapped run) gets
    // addresses of its own with those chunks mapped whole, one after another, as there.
    for (std::uint32_t i = 0; i < reply.count; ++i) {
      const piece& p = reply.pieces[i];
      const bool joins = (i == 0 || p.offset == 0) && (i + 1 == reply.count || p.offset + p.length == p.chunk_size);
      if (!joins || p.offset + p.length > p.chunk_size || reply.count == 0) {
        throw std::invalid_argument("streamalloc::imported_pool::import_pointer: the exporter described pieces that "
                                    "do not form one allocation");
      }
    }
    import_entry e;
    e.bytes = bytes;
    std::vector<chunk_entry*> used;
    CUdeviceptr at = 0;
    try {
      // Room first, so that a chunk is counted only once it is in both lists: out of host
      // memory part-way, the catch below undoes exactly what was counted.
      used.reserve(reply.count);
      e.chunks.reserve(reply.count);
      for (std::uint32_t i = 0; i < reply.count; ++i) {
        chunk_entry& c = chunk_of(reply.pieces[i]);
        used.push_back(&c);
        e.chunks.push_back(reply.pieces[i].chunk);
        ++c.uses;
      }
      if (reply.count == 1) {
        at = used[0]->va.address() + reply.pieces[0].offset;
      } else {
        std::uint64_t total = 0;
        for (auto* c : used) total += c->memory.size();
        e.va = address_reservation(total, hello_.granularity);
        std::uint64_t offset = 0;
        for (auto* c : used) {
          e.maps.emplace_back(e.va.address() + offset, c->memory);
          offset += c->memory.size();
        }
        grant(e.va.address(), e.va.size(), access_);
        at = e.va.address() + reply.pieces[0].offset;
      }
      // Out of host memory: e is destroyed or intact. An id given twice (a faulty exporter):
      // refused, the maps made for it undone.
      if (!imports_.emplace(reply.id, std::move(e)).second) {
        throw std::invalid_argument("streamalloc::imported_pool::import_pointer: the exporter gave an import id twice");
      }
    } catch (...) {
      e.maps.clear();
      for (std::size_t i = 0; i < used.size(); ++i) {  // the pieces name the chunks, whatever became of e
        if (--used[i]->uses == 0) chunks_.erase(reply.pieces[i].chunk);
      }
      throw;
    }
    imported_bytes_ += bytes;
    return imported{reply.id, at, bytes};
  }

  static void grant(CUdeviceptr va, std::size_t bytes, const std::vector<access_descriptor>& who) {
    if (!who.empty()) streamalloc::set_access(va, bytes, std::span<const access_descriptor>(who));
  }

  void reap() {
    for (;;) {
      queued q{};
      {
        std::unique_lock lock(reaper_mutex_);
        reaper_wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
        q = queue_.front();
        queue_.pop_front();
      }
      (void)cu::cuEventSynchronize_nothrow(q.event);  // a lost context: no work of it runs any more
      (void)cu::cuEventDestroy_nothrow(q.event);
      release(q.id);
    }
  }

  std::string path_;
  unique_fd socket_;
  hello_reply hello_{};
  memory_location location_ = memory_location::host();
  int device_ = -1;
  std::mutex mutex_;  // the socket (one request at a time) and everything below
  bool closed_ = false;
  std::vector<access_descriptor> access_;
  std::unordered_map<std::uint64_t, chunk_entry> chunks_;
  std::unordered_map<std::uint64_t, import_entry> imports_;
  std::size_t imported_bytes_ = 0;
  std::unique_ptr<import_reply> reply_ = std::make_unique_for_overwrite<import_reply>();  // 64 KiB, reused

  std::mutex reaper_mutex_;
  std::condition_variable reaper_wake_;
  std::deque<queued> queue_;
  bool stopping_ = false;
  std::thread reaper_;
};

}  // namespace streamalloc::detail::ipc
