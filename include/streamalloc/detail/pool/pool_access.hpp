#pragma once

// Which devices may use a pool's memory (see `pool::set_access`): the flags each device has,
// read on the allocation path of another device's stream; the devices ever granted, whose
// work a synchronization of the pool's memory must cover; the checks of a grant against what
// the memory allows; and the peers of graph memory (spec 003: devices only, read-write only).
// Part of pool_state (pool_state.hpp), which owns one and applies the changes to its backend.

#include <streamalloc/access.hpp>
#include <streamalloc/detail/config.hpp>
#include <streamalloc/detail/core/ordering.hpp>
#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/driver.hpp>
#include <streamalloc/memory_location.hpp>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace streamalloc::detail {

class pool_access {
 public:
  /// The memory's location and the device whose streams allocate from it, which has
  /// read-write access for good.
  pool_access(memory_location location, int device) : location_(location), device_(device) {
    flags_[static_cast<std::size_t>(device)].store(access_flags::read_write, std::memory_order_relaxed);
    users_.store(std::uint64_t{1} << device, std::memory_order_relaxed);
  }
  pool_access(const pool_access&) = delete;
  pool_access& operator=(const pool_access&) = delete;

  /// The synchronization domain (ordering.hpp) that grants add their devices to.
  void set_sync_domain(int domain) noexcept { sync_domain_ = domain; }

  /// Applies `who` (see `pool::set_access`): checked whole first, then `apply(changes)` asks
  /// the driver for what differs from the access in force. A revoked device's streams are
  /// refused before its access goes, a granted one's are served only once it has it; a
  /// failing `apply` leaves the flags as they were.
  template <class Apply>
  void set(std::span<const access_descriptor> who, Apply&& apply) {
    // One change at a time: each is checked against the access in force, and the flags read
    // by allocate follow the driver's state in the order the changes are made.
    std::lock_guard lock(change_);
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
      if (check_grant(d) && slot(d.location.id()).load(std::memory_order_relaxed) != d.flags) changes.push_back(d);
    }
    if (changes.empty()) return;
    for (const access_descriptor& d : changes) {
      // Before the driver is asked: from now on, work of that device may use the memory, and
      // a synchronization of the pool's memory must cover it (for the rest of its life: work
      // it enqueued may outlive a revocation).
      if (d.flags != access_flags::none) add_user(d.location.id());
    }
    std::vector<std::pair<int, access_flags>> lowered;
    for (const access_descriptor& d : changes) {
      auto& s = slot(d.location.id());
      const access_flags was = s.load(std::memory_order_relaxed);
      if (rank(d.flags) < rank(was)) {
        lowered.emplace_back(d.location.id(), was);
        s.store(d.flags, std::memory_order_release);
      }
    }
    try {
      apply(std::as_const(changes));
    } catch (...) {
      for (const auto& [dev, was] : lowered) slot(dev).store(was, std::memory_order_release);
      throw;
    }
    for (const access_descriptor& d : changes) slot(d.location.id()).store(d.flags, std::memory_order_release);
  }

  /// What `where` may do with the memory now.
  [[nodiscard]] access_flags of(memory_location where) const noexcept {
    if (where.is_host()) return location_.is_host() ? access_flags::read_write : access_flags::none;
    if (where.id() < 0 || where.id() >= max_devices) return access_flags::none;
    return slot(where.id()).load(std::memory_order_acquire);
  }

  /// May streams of `device` allocate here and free here? Its own device's, and those of
  /// devices granted access (read or read-write).
  [[nodiscard]] bool serves(int device) const noexcept {
    if (device == device_) return true;
    return device >= 0 && device < max_devices && slot(device).load(std::memory_order_acquire) != access_flags::none;
  }

  /// Refuses a stream of `stream_device` unless that device has access, naming what to do.
  void require(const char* member, int stream_device) const {
    if (!serves(stream_device)) throw_wrong_device(member, stream_device);
  }

  /// The devices other than the pool's own with access now (bit d: device d): what a graph
  /// allocation captured now keeps for the graph's life.
  [[nodiscard]] std::uint64_t peers_now() const noexcept {
    std::uint64_t peers = 0;
    for_each_user([&](int d) {
      if (d != device_ && slot(d).load(std::memory_order_acquire) != access_flags::none) peers |= std::uint64_t{1} << d;
    });
    return peers;
  }

  /// The devices `access` names for a graph allocation, as a mask (bit d: device d), checked
  /// as spec 003 says of an allocation node's access descriptors: devices only, read-write
  /// only; the pool's own device may be named (it has access anyway). Throws
  /// std::invalid_argument or not_supported, naming the descriptor, before anything changes.
  [[nodiscard]] std::uint64_t graph_peers(std::span<const access_descriptor> access, const char* caller) const {
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

  /// Devices given access to graph memory run work on the pool's memory: a synchronization of
  /// it covers them from now on (as set's grants do).
  void note_graph_peers(std::uint64_t peers) {
    if ((users_.load(std::memory_order_acquire) & peers) == peers) return;
    std::lock_guard lock(change_);
    for (int d = 0; d < max_devices; ++d) {
      if ((peers >> d & 1) != 0) add_user(d);
    }
  }

  /// Calls `f(device)` for the pool's device and every device ever granted access.
  template <class F>
  void for_each_user(F&& f) const {
    const std::uint64_t users = users_.load(std::memory_order_acquire);
    for (int d = 0; d < max_devices; ++d) {
      if ((users >> d & 1) != 0) f(d);
    }
  }

 private:
  [[nodiscard]] std::atomic<access_flags>& slot(int device) noexcept { return flags_[static_cast<std::size_t>(device)]; }
  [[nodiscard]] const std::atomic<access_flags>& slot(int device) const noexcept {
    return flags_[static_cast<std::size_t>(device)];
  }

  /// Under change_: `device`'s work may use the memory from now on.
  void add_user(int device) {
    if ((users_.load(std::memory_order_relaxed) >> device & 1) != 0) return;
    users_.fetch_or(std::uint64_t{1} << device, std::memory_order_acq_rel);
    ordering().add_domain_user(sync_domain_, device);
  }

  /// none < read < read_write.
  static int rank(access_flags f) noexcept {
    return f == access_flags::read_write ? 2 : f == access_flags::read ? 1 : 0;
  }

  /// Checks one change against what the memory allows, before anything is changed. False
  /// when it changes nothing (read-write for the memory's own location).
  bool check_grant(const access_descriptor& d, const std::string& who = "streamalloc::pool::set_access: ") const {
    if (d.flags != access_flags::none && d.flags != access_flags::read && d.flags != access_flags::read_write) {
      throw std::invalid_argument(who + "access_flags " + std::to_string(static_cast<unsigned>(d.flags)) +
                                  " for " + d.location.to_string() + " is none of none, read, read_write");
    }
    const char* const flags_name = d.flags == access_flags::read ? "read" : "none";
    if (d.location.is_host()) {
      if (location_.is_device()) {
        throw std::invalid_argument(who + "the host cannot be given access to this pool's memory, which lives on " +
                                    location_.to_string() +
                                    " (the CPU cannot map device memory: make a pool on a host location for memory "
                                    "the CPU uses)");
      }
      if (d.flags != access_flags::read_write) {
        throw std::invalid_argument(who + "the host's access to this pool's memory, which lives on " +
                                    location_.to_string() + ", cannot be reduced (asked: " + flags_name + ")");
      }
      return false;
    }
    const int dev = d.location.id();
    if (dev >= device_count()) throw std::invalid_argument(who + "there is no device " + std::to_string(dev));
    if (dev >= max_devices) {
      throw std::invalid_argument(who + "device " + std::to_string(dev) + " is beyond the devices streamalloc serves (0 to " +
                                  std::to_string(max_devices - 1) + ")");
    }
    if (dev == device_) {
      if (d.flags != access_flags::read_write) {
        const std::string why = location_.is_device() ? "the memory lives there"
                                                      : "the pool was made for it (its streams allocate here)";
        throw std::invalid_argument(who + "device " + std::to_string(dev) +
                                    "'s access to this pool's memory cannot be removed or reduced (asked: " +
                                    flags_name + "): " + why);
      }
      return false;
    }
    if (d.flags == access_flags::none) return true;  // revoking needs no capability
    if (location_.is_device()) {
      int can = 0;
      check(cu::cuDeviceCanAccessPeer_nothrow(&can, device_handle(dev), device_handle(device_)), "cuDeviceCanAccessPeer",
            [&] {
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
    const bool numa = location_.type() == memory_location::kind::host_numa;
    const char* missing = !c.virtual_memory                   ? "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
                          : numa && !c.host_numa_memory       ? "HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
                          : !numa && !c.host_memory           ? "HOST_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"
                                                              : nullptr;
    if (missing != nullptr) {
      throw not_supported(who + "device " + std::to_string(dev) + " cannot access this pool's memory on " +
                          location_.to_string() + ": it cannot map " + (numa ? "host NUMA" : "host") +
                          " memory through the VMM API (CU_DEVICE_ATTRIBUTE_" + missing + " is 0)");
    }
    return true;
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
                                std::to_string(stream_device) + ", but this pool's memory (" + location_.to_string() +
                                ") is for device " + std::to_string(device_) +
                                " and the devices granted access, and device " + std::to_string(stream_device) +
                                " has none; " + advice);
  }

  const memory_location location_;
  const int device_;
  int sync_domain_ = 0;
  std::array<std::atomic<access_flags>, max_devices> flags_{};
  std::atomic<std::uint64_t> users_{0};  // bit d: device d was ever granted (or is the pool's)
  std::mutex change_;
};

}  // namespace streamalloc::detail
