#pragma once

// What a pool says when an allocation fails (see `out_of_memory`): the core's reason, in the
// pool's words, with what blames the addresses when they are short and the device's free
// memory; and the handler a user may set to free memory and ask for a retry
// (`pool::set_out_of_memory_handler`). Part of pool_state (pool_state.hpp).

#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/detail/pool/pool_registry.hpp>
#include <streamalloc/detail/pool/snapshot_json.hpp>
#include <streamalloc/driver.hpp>
#include <streamalloc/memory_location.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace streamalloc::detail {

/// The device's free and total memory (cuMemGetInfo in its primary context), for memory on a
/// device; unknown for host memory, or when the driver does not answer.
inline device_memory_info device_memory_now(memory_location location) noexcept {
  if (!location.is_device()) return {};
  try {
    const scoped_context on_device(primary_context(location.id()));
    std::size_t free = 0, total = 0;
    if (cu::cuMemGetInfo_nothrow(&free, &total) == CUDA_SUCCESS) return {true, free, total};
  } catch (...) {  // no context: the report says less
  }
  return {};
}

class out_of_memory_report {
 public:
  using handler_type = std::function<bool(const out_of_memory&)>;

  /// The failure of a request for `bytes` that `core` refused with `e`, in the pool's words.
  [[nodiscard]] static out_of_memory describe(std::size_t bytes, const core_out_of_memory& e, vmm_pool_core& core,
                                              memory_location location) {
    std::string words = "streamalloc: cannot allocate " + std::to_string(bytes) + " bytes from a pool on " +
                        location.to_string() + ": " + e.reason + address_shortage(core, bytes);
    if (const device_memory_info m = device_memory_now(location); m.known) {
      words += "; the device has " + std::to_string(m.free) + " bytes free of " + std::to_string(m.total);
    }
    return out_of_memory(bytes, std::move(words));
  }

  /// Replaces the handler (an empty one removes it).
  void set_handler(handler_type handler) {
    auto h = handler ? std::make_shared<const handler_type>(std::move(handler)) : nullptr;
    std::lock_guard lock(mutex_);
    handler_ = std::move(h);
  }

  /// Asks the handler whether to try `failure`'s request again: false without one. Called
  /// with no lock of the pool held, so the handler may free, synchronize or trim; it runs
  /// outside this object's lock too, and may replace itself.
  [[nodiscard]] bool retry(const out_of_memory& failure) const {
    std::shared_ptr<const handler_type> h;
    {
      std::lock_guard lock(mutex_);
      h = handler_;
    }
    return h != nullptr && (*h)(failure);
  }

 private:
  /// The part of the message that blames the addresses, when they are short: when the least
  /// the pool could have grown by for `bytes` does not fit in the addresses it may still use
  /// (every mapped byte takes one address, so at most `address_space - reserved` are left),
  /// or when the driver refused to reserve more (the process's addresses ran out), growing
  /// was impossible whatever memory the device has. Addresses too fragmented for the growth
  /// are not detected: the message then says nothing rather than blame them wrongly.
  static std::string address_shortage(vmm_pool_core& core, std::size_t bytes) {
    const auto& o = core.options();
    const std::uint64_t g = core.granularity();
    const std::uint64_t space = core.address_space();
    const std::uint64_t mapped = core.statistics().reserved_current;
    const std::uint64_t taken = core.addresses_reserved();
    // A request grows the pool by whole chunks, at least one (fewer bytes when extending a
    // free tail, but never less than a chunk), except under max_size, where a single granule
    // may do; with own_chunk_for_large, one of a chunk or more by its own size, rounded to the
    // granularity. (One that asks for room to grow may get its own size; a chunk is still the
    // least it could have grown by.)
    std::uint64_t least = o.max_size == 0 ? o.chunk_size : g;
    if (o.own_chunk_for_large && bytes >= o.chunk_size) least = (bytes + g - 1) / g * g;
    if (const std::uint64_t refused = core.refused_reservation(); refused != 0) {
      return " (the process's virtual addresses ran out: the driver refused to reserve " + std::to_string(refused) +
             " more bytes of addresses for the pool, which holds " + std::to_string(taken) + " bytes of addresses, " +
             std::to_string(mapped) + " of them mapped)";
    }
    if (mapped <= space && least <= space - mapped) return {};
    return " (the pool's addresses are used up: it may reserve " + std::to_string(space) + " bytes of addresses, " +
           std::to_string(mapped) + " of them mapped, and growing for this request needs " + std::to_string(least) +
           " more: raise pool_properties::address_space)";
  }

  mutable std::mutex mutex_;
  std::shared_ptr<const handler_type> handler_;  // replaced whole, called outside the mutex
};

}  // namespace streamalloc::detail
