#pragma once

// The exporting side of a pool: a thread that serves importers on the pool's socket. Each
// importer is a session; what it imports is held in the pool core (pool_exports.hpp) until it
// releases it or its socket closes, so an importer that crashes or is killed gives back what it
// held. Chunks are handed out only to a session with an import on them, and only while it has.

#include <streamalloc/detail/core/pool_core.hpp>
#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/ipc/channel.hpp>
#include <streamalloc/detail/ipc/protocol.hpp>
#include <streamalloc/detail/pool/vmm_backend.hpp>

#include <fcntl.h>
#include <poll.h>

#include <atomic>
#include <cstdio>
#include <list>
#include <memory>
#include <new>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

namespace streamalloc::detail::ipc {

/// What the exporter says of its pool in a hello.
struct pool_identity {
  memory_location location;
  int device = 0;  ///< the pool's device (for a host pool: the device it serves)
  shareable_handle_type handle_types = shareable_handle_type::none;
};

class exporter {
 public:
  using core = pool_core<vmm_backend>;

  /// Serves importers at `path` (see channel.hpp for the forms) until destroyed.
  exporter(std::shared_ptr<core> c, pool_identity who, std::string path)
      : core_(std::move(c)), who_(who), path_(std::move(path)), listener_(listen_at(path_)) {
    std::random_device rd;
    for (auto& w : id_) w = (std::uint64_t{rd()} << 32) ^ rd();
    int wake[2];
    if (::pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) throw_errno("pipe");
    wake_read_ = unique_fd(wake[0]);
    wake_write_ = unique_fd(wake[1]);
    fds_.reserve(3);  // the wake pipe, the listener and a first importer: the thread cannot throw for them
    thread_ = std::thread([this] { serve(); });
  }
  exporter(const exporter&) = delete;
  exporter& operator=(const exporter&) = delete;

  /// Stops serving: every session's imports are released (the importers keep the memory they
  /// mapped: the driver frees physical memory only when its last mapping in any process goes).
  ~exporter() {
    stop_.store(true);
    const char c = 1;
    (void)!::write(wake_write_.get(), &c, 1);
    thread_.join();
    for (auto& s : sessions_) drop(s);
    if (path_.front() != '@') ::unlink(path_.c_str());
  }

  [[nodiscard]] const std::array<std::uint64_t, 2>& id() const noexcept { return id_; }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

  /// The descriptor of live allocation `p` (throws std::invalid_argument for anything else).
  [[nodiscard]] ipc_descriptor describe(std::uint64_t p) {
    const auto e = core_->export_block(p);
    ipc_descriptor d;
    d.magic = magic;
    d.version = version;
    d.pool_id = id_;
    d.address = p;
    d.size = e.size;
    d.serial = e.serial;
    return d;
  }

  /// Importers connected now.
  [[nodiscard]] std::size_t sessions() const noexcept { return session_count_.load(); }

 private:
  static constexpr std::string_view out_of_host_memory =
      "the exporting process is out of host memory; the import may be tried again";

  struct session {
    unique_fd socket;
    std::unordered_map<std::uint64_t, block*> imports;          // by import id
    std::unordered_map<std::uint64_t, std::size_t> chunk_uses;  // chunk id -> imports on it
    std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> chunks_of;  // import id -> chunk ids
    std::uint64_t next_id = 0;
  };

  void serve() {
    ensure_context(who_.device);  // exports of physical memory need a context
    std::vector<pollfd>& fds = fds_;  // room for every session is made as each is accepted
    // After a request it polls without sleeping for a while (channel.hpp: spin_before_sleep):
    // an importer importing many pointers then finds it awake.
    auto busy_until = std::chrono::steady_clock::now();
    while (!stop_.load()) {
      fds.clear();
      fds.push_back({wake_read_.get(), POLLIN, 0});
      fds.push_back({listener_.get(), POLLIN, 0});
      for (auto& s : sessions_) fds.push_back({s.socket.get(), POLLIN, 0});
      const bool busy = std::chrono::steady_clock::now() < busy_until;
      const int ready = ::poll(fds.data(), fds.size(), busy ? 0 : -1);
      if (ready < 0) {
        if (errno == EINTR) continue;
        std::perror("streamalloc IPC: poll");  // cannot happen with valid descriptors
        return;
      }
      if (ready == 0) continue;
      busy_until = std::chrono::steady_clock::now() + spin_before_sleep;
      if ((fds[1].revents & POLLIN) != 0) accept_one();
      auto it = sessions_.begin();
      for (std::size_t i = 2; i < fds.size(); ++i) {
        auto here = it++;
        if (fds[i].revents == 0) continue;
        if (!serve_one(*here)) {
          drop(*here);
          sessions_.erase(here);
          session_count_.store(sessions_.size());
        }
      }
    }
  }

  void accept_one() {
    unique_fd s(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!s) return;  // the peer gave up already
    try {
      sessions_.push_back(session{std::move(s), {}, {}, {}, 0});
    } catch (...) {  // out of host memory: the importer sees its socket closed
      return;
    }
    try {
      fds_.reserve(sessions_.size() + 2);  // the wake pipe, the listener, every session
    } catch (...) {  // as above: serve() must find room for every session's descriptor
      sessions_.pop_back();
      return;
    }
    try {
      // Room for the next importer too, made now: when host memory runs out later, the
      // reservation above then needs none, and that importer is served.
      fds_.reserve(sessions_.size() + 3);
    } catch (...) {
    }
    session_count_.store(sessions_.size());
  }

  /// Answers one request; false when the session is over (closed, or not speaking the protocol).
  bool serve_one(session& s) noexcept {
    try {
      request r;
      const std::size_t n = receive_message(s.socket.get(), &r, sizeof r);
      if (n != sizeof r || r.magic != magic) return false;
      switch (r.what) {
        case kind::hello: return hello(s);
        case kind::import: return import(s, r.descriptor);
        case kind::fetch: return fetch(s, r.id);
        case kind::release: release(s, r.id); return true;
      }
      return false;
    } catch (...) {  // the socket failed, or no host memory: the session ends, releasing all
      return false;
    }
  }

  bool hello(session& s) {
    hello_reply h;
    h.pool_id = id_;
    h.location_kind = static_cast<std::int32_t>(who_.location.type());
    h.location_id = who_.location.id();
    CUdevice dev = 0;
    check(cu::cuDeviceGet_nothrow(&dev, who_.device), "cuDeviceGet");
    check(cu::cuDeviceGetUuid_nothrow(&h.device, dev), "cuDeviceGetUuid");
    h.granularity = core_->granularity();
    h.handle_types = static_cast<std::uint32_t>(who_.handle_types);
    send_message(s.socket.get(), &h, sizeof h);
    return true;
  }

  bool import(session& s, const ipc_descriptor& d) {
    import_reply* reply = reply_.get();
    reply->clear();
    block* b = nullptr;
    // A refusal answers the request and keeps the session: its other imports stay held (ending
    // it would release memory the importer still maps).
    auto refuse = [&](std::string_view why) {
      if (b != nullptr) core_->release_import(b);
      reply->count = 0;
      reply->refusal.set(why);
      send_message(s.socket.get(), reply, reply->bytes());
      return true;
    };
    try {
      if (d.magic != magic || d.version != version) {
        throw std::invalid_argument("the descriptor is not one streamalloc made (or of another version)");
      }
      if (d.pool_id != id_) throw std::invalid_argument("the descriptor belongs to another pool (a foreign descriptor)");
      b = core_->import_block(d.address, d.serial, d.size);
      core_->for_each_piece(b, d.size, [&](std::uint64_t, const auto& c, std::uint64_t offset, std::uint64_t length) {
        if (reply->count == max_pieces) return;
        reply->pieces[reply->count++] = piece{c.h.handle(), c.size, offset, length};
      });
      std::uint64_t covered = 0;
      for (std::uint32_t i = 0; i < reply->count; ++i) covered += reply->pieces[i].length;
      if (covered != d.size) {
        throw std::invalid_argument("the allocation lies on more than " + std::to_string(max_pieces) +
                                    " chunks of the pool, more than an import can map");
      }
    } catch (const std::invalid_argument& e) {
      return refuse(e.what());
    } catch (const std::bad_alloc&) {
      return refuse(out_of_host_memory);
    }
    const std::uint64_t id = ++s.next_id;
    // The session's books, undone in full when host memory runs out part-way, so that the
    // session's end does not release the import a second time.
    bool booked = false;
    std::uint32_t counted = 0;
    try {
      std::vector<std::uint64_t> chunks(reply->count);
      for (std::uint32_t i = 0; i < reply->count; ++i) chunks[i] = reply->pieces[i].chunk;
      s.imports.emplace(id, b);
      booked = true;
      for (; counted < reply->count; ++counted) ++s.chunk_uses[reply->pieces[counted].chunk];
      s.chunks_of.emplace(id, std::move(chunks));
    } catch (const std::bad_alloc&) {
      for (std::uint32_t i = 0; i < counted; ++i) {
        if (auto u = s.chunk_uses.find(reply->pieces[i].chunk); u != s.chunk_uses.end() && --u->second == 0) {
          s.chunk_uses.erase(u);
        }
      }
      if (booked) s.imports.erase(id);
      return refuse(out_of_host_memory);
    }
    reply->id = id;
    send_message(s.socket.get(), reply, reply->bytes());
    return true;
  }

  bool fetch(session& s, std::uint64_t chunk) {
    fetch_reply f;
    auto it = s.chunk_uses.find(chunk);
    if (it == s.chunk_uses.end() || it->second == 0) {
      f.refusal.set("that chunk lies under no allocation this importer holds");
      send_message(s.socket.get(), &f, sizeof f);
      return true;
    }
    // The chunk is alive: an import of this session lies on it, and the pool releases no chunk
    // under a held block.
    const auto h = static_cast<CUmemGenericAllocationHandle>(chunk);
    if (has_handle_type(who_.handle_types, shareable_handle_type::posix_fd)) {
      int fd = -1;
      const CUresult r = cu::cuMemExportToShareableHandle_nothrow(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
      if (r != CUDA_SUCCESS) {
        set_failure(f, "cuMemExportToShareableHandle failed", r);
        send_message(s.socket.get(), &f, sizeof f);
        return true;
      }
      const unique_fd owned(fd);  // the receiver gets its own copy
      f.handle_type = static_cast<std::uint32_t>(shareable_handle_type::posix_fd);
      send_message(s.socket.get(), &f, sizeof f, owned.get());
      return true;
    }
    const CUresult r = cu::cuMemExportToShareableHandle_nothrow(&f.fabric, h, CU_MEM_HANDLE_TYPE_FABRIC, 0);
    if (r != CUDA_SUCCESS) set_failure(f, "cuMemExportToShareableHandle (fabric) failed", r);
    f.handle_type = static_cast<std::uint32_t>(shareable_handle_type::fabric);
    send_message(s.socket.get(), &f, sizeof f);
    return true;
  }

  /// A refusal naming the driver's error; without host memory for the text, without the name.
  static void set_failure(fetch_reply& f, std::string_view what, CUresult r) noexcept {
    try {
      f.refusal.set(std::string(what) + ": " + detail::result_name(r));
    } catch (...) {
      f.refusal.set(what);
    }
  }

  void release(session& s, std::uint64_t id) noexcept {
    const auto it = s.imports.find(id);
    if (it == s.imports.end()) return;  // released twice, or never granted: nothing to do
    core_->release_import(it->second);
    s.imports.erase(it);
    if (auto c = s.chunks_of.find(id); c != s.chunks_of.end()) {
      for (auto chunk : c->second) {
        if (auto u = s.chunk_uses.find(chunk); u != s.chunk_uses.end() && --u->second == 0) s.chunk_uses.erase(u);
      }
      s.chunks_of.erase(c);
    }
  }

  /// The session is over: everything it imported goes back to the pool.
  void drop(session& s) noexcept {
    for (auto& [id, b] : s.imports) core_->release_import(b);
    s.imports.clear();
    s.chunk_uses.clear();
    s.chunks_of.clear();
  }

  std::shared_ptr<core> core_;
  pool_identity who_;
  std::string path_;
  std::array<std::uint64_t, 2> id_{};
  unique_fd listener_;
  unique_fd wake_read_, wake_write_;
  std::list<session> sessions_;  // the serving thread's only
  std::vector<pollfd> fds_;       // the serving thread's: what it polls, room made in accept_one
  std::atomic<std::size_t> session_count_{0};
  std::atomic<bool> stop_{false};
  std::unique_ptr<import_reply> reply_ = std::make_unique_for_overwrite<import_reply>();  // the thread's, reused
  std::thread thread_;
};

}  // namespace streamalloc::detail::ipc
