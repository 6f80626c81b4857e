#pragma once

// What streamalloc knows about the order of work on streams, process-wide.
//
// Each stream (by its CUDA stream id, unique for the process's life, unlike handle values,
// which CUDA reuses) has a record with:
//   epoch      frees are stamped with the current epoch; an event record or a host
//              synchronization captures the epoch and advances it, so "stamp <= captured"
//              means "the free was enqueued before that point of the stream"
//   completed  every free stamped <= completed has executed on the device (known from a host
//              synchronization, a completed event, or a query)
//   clock      for other streams, the epoch this stream is known to be ordered after, through
//              event waits made with streamalloc's handles (a vector clock: waits carry what
//              the recording stream was itself ordered after). At most `max_clock_entries`
//              streams, those of the most recent waits: forgetting an ordering only costs
//              reuse, and it keeps every record, capture and wait at a cost independent of how
//              many streams were ever ordered after each other (a ring of 1,024 streams walked
//              1,024 entries at every wait)
//
// Work ordered with raw CUDA calls is invisible here; it is never wrong, it only gives less
// reuse, because nothing is concluded without evidence.

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace streamalloc::detail {

/// A point on a stream, and everything that point was ordered after.
struct clock_snapshot {
  std::uint64_t stream = 0;  ///< 0: no point (an event never recorded through streamalloc)
  std::uint64_t epoch = 0;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> after;  ///< (stream, epoch), sorted
};

// A cache line of its own: every free does a read-modify-write on `epoch_`, and records made
// one after another would otherwise share lines between threads on different streams.
class alignas(128) stream_record {
 public:
  explicit stream_record(std::uint64_t id) noexcept : id_(id) {}
  stream_record(const stream_record&) = delete;
  stream_record& operator=(const stream_record&) = delete;

  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }

  /// The device the stream belongs to; -1 until known.
  [[nodiscard]] int device() const noexcept { return device_.load(std::memory_order_relaxed); }
  void set_device(int d) noexcept { device_.store(d, std::memory_order_relaxed); }

  /// The stamp of a free enqueued now. A read-modify-write, so that a host synchronization
  /// that advances the epoch afterwards is ordered after everything this thread enqueued
  /// before the free (and so covers it).
  [[nodiscard]] std::uint64_t stamp() noexcept { return epoch_.fetch_add(0, std::memory_order_acq_rel); }

  /// The epoch now, for a point of work enqueued before any later capture on this thread
  /// (no read-modify-write: enough for comparing with proofs made afterwards).
  [[nodiscard]] std::uint64_t current_epoch() const noexcept { return epoch_.load(std::memory_order_acquire); }
  /// A point on this stream (an event record): captures and advances the epoch.
  [[nodiscard]] clock_snapshot capture() {
    clock_snapshot s;
    s.stream = id_;
    std::lock_guard lock(mutex_);
    s.epoch = epoch_.fetch_add(1, std::memory_order_acq_rel);
    s.after.reserve(clock_.size());
    for (const entry& x : clock_) s.after.emplace_back(x.stream, x.epoch);
    return s;
  }

  /// This stream now waits for `point`: it is ordered after it and after all it was after.
  void wait_for(const clock_snapshot& point) {
    if (point.stream == 0 || point.stream == id_) return;
    std::lock_guard lock(mutex_);
    // The stream waited for directly ranks above those it was itself ordered after.
    const std::uint64_t tick = ++waits_;
    merge_sorted(point.after, 2 * tick);
    merge(point.stream, point.epoch, 2 * tick + 1);
    // Trimmed back to `max_clock_entries` only past twice that: the trim's sort is paid once
    // every many waits, not at each.
    if (clock_.size() > 2 * max_clock_entries) forget_oldest();
  }

  /// The epoch of stream `other` this stream is known to be ordered after (0: none).
  [[nodiscard]] std::uint64_t ordered_after(std::uint64_t other) const {
    std::lock_guard lock(mutex_);
    auto it = find(other);
    return it != clock_.end() && it->stream == other ? it->epoch : 0;
  }

  /// Frees stamped <= the returned epoch are before a host synchronization that starts now.
  [[nodiscard]] std::uint64_t begin_synchronize() noexcept {
    return epoch_.fetch_add(1, std::memory_order_acq_rel);
  }

  /// Everything stamped <= `epoch` has executed.
  void mark_completed(std::uint64_t epoch) noexcept {
    std::uint64_t c = completed_.load(std::memory_order_relaxed);
    while (c < epoch && !completed_.compare_exchange_weak(c, epoch, std::memory_order_release,
                                                          std::memory_order_relaxed)) {
    }
  }
  [[nodiscard]] std::uint64_t completed() const noexcept {
    return completed_.load(std::memory_order_acquire);
  }

  /// The stream's handle stays valid until the stream retires, so a pool may use it at any time
  /// (to record an event or ask whether the stream is idle): a stream streamalloc owns, or the
  /// legacy default stream. Any other handle is only known valid during a call that was given
  /// it: a raw stream may be destroyed and its value handed to the next stream created, and the
  /// per-thread default stream's handle names another stream on every thread.
  void mark_handle_stable() noexcept { handle_stable_.store(true, std::memory_order_release); }
  [[nodiscard]] bool handle_stable() const noexcept {
    return handle_stable_.load(std::memory_order_acquire) && !retired();
  }

  /// The stream was destroyed through streamalloc: its handle must not be used any more.
  void mark_retired() noexcept { retired_.store(true, std::memory_order_release); }
  [[nodiscard]] bool retired() const noexcept { return retired_.load(std::memory_order_acquire); }

  /// What this stream is ordered after, for completing it when the stream completes.
  [[nodiscard]] std::vector<std::pair<std::uint64_t, std::uint64_t>> clock() const {
    std::lock_guard lock(mutex_);
    std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
    out.reserve(clock_.size());
    for (const entry& x : clock_) out.emplace_back(x.stream, x.epoch);
    return out;
  }

  /// The streams a clock is sure to remember (the most recent waits'); it holds at most twice
  /// as many.
  static constexpr std::size_t max_clock_entries = 32;

 private:
  struct entry {
    std::uint64_t stream;
    std::uint64_t epoch;
    std::uint64_t touched;  // 2 * the wait that last raised or confirmed it (+1: waited for directly)
  };

  std::vector<entry>::const_iterator find(std::uint64_t s) const {
    return std::lower_bound(clock_.begin(), clock_.end(), s,
                            [](const entry& x, std::uint64_t v) { return x.stream < v; });
  }

  void merge(std::uint64_t s, std::uint64_t e, std::uint64_t touched) {
    auto it = clock_.begin() + (find(s) - clock_.cbegin());
    if (it != clock_.end() && it->stream == s) {
      it->epoch = std::max(it->epoch, e);
      it->touched = touched;
    } else {
      clock_.insert(it, {s, e, touched});
    }
  }

  /// Merges a clock (sorted by stream) into this one in one pass.
  void merge_sorted(const std::vector<std::pair<std::uint64_t, std::uint64_t>>& other, std::uint64_t touched) {
    if (other.empty()) return;
    std::vector<entry>& out = scratch_;  // kept between merges: no allocation once warm
    out.clear();
    out.reserve(clock_.size() + other.size());
    auto a = clock_.begin();
    auto b = other.begin();
    while (a != clock_.end() || b != other.end()) {
      if (b != other.end() && b->first == id_) {
        ++b;  // what this stream is ordered after itself says nothing
      } else if (b == other.end() || (a != clock_.end() && a->stream < b->first)) {
        out.push_back(*a++);
      } else if (a == clock_.end() || b->first < a->stream) {
        out.push_back({b->first, b->second, touched});
        ++b;
      } else {
        out.push_back({a->stream, std::max(a->epoch, b->second), touched});
        ++a, ++b;
      }
    }
    clock_.swap(out);
  }

  /// Keeps the `max_clock_entries` entries touched most recently.
  void forget_oldest() {
    std::nth_element(clock_.begin(), clock_.begin() + max_clock_entries - 1, clock_.end(),
                     [](const entry& x, const entry& y) { return x.touched > y.touched; });
    clock_.resize(max_clock_entries);
    std::sort(clock_.begin(), clock_.end(), [](const entry& x, const entry& y) { return x.stream < y.stream; });
  }

  const std::uint64_t id_;
  std::atomic<int> device_{-1};
  // Epoch 0 is never a stamp, so "ordered after 0" and "completed 0" mean nothing is known.
  std::atomic<std::uint64_t> epoch_{1};
  std::atomic<std::uint64_t> completed_{0};
  std::atomic<bool> retired_{false};
  std::atomic<bool> handle_stable_{false};
  mutable std::mutex mutex_;
  std::vector<entry> clock_;  // sorted by stream id
  std::vector<entry> scratch_;
  std::uint64_t waits_ = 0;
};

/// Listens for completions learned at host synchronizations (the pools, to release memory).
class completion_listener {
 public:
  virtual void on_synchronize(std::uint64_t stream) noexcept = 0;
  /// The stream is about to be destroyed: record nothing on it after this returns.
  virtual void on_retire(std::uint64_t stream) noexcept = 0;

 protected:
  ~completion_listener() = default;
};

class ordering_registry {
 public:
  /// The record of stream `id`, created on first use. Records live as long as the process
  /// (a few dozen bytes per stream ever used), so pointers to them stay valid.
  stream_record& record(std::uint64_t id) {
    {
      std::shared_lock lock(mutex_);
      if (auto it = records_.find(id); it != records_.end()) return *it->second;
    }
    std::unique_lock lock(mutex_);
    auto& slot = records_[id];
    if (!slot) slot = std::make_unique<stream_record>(id);
    return *slot;
  }

  /// A snapshot's point (and all it was after) has executed.
  void complete(const clock_snapshot& point) {
    if (point.stream == 0) return;
    record(point.stream).mark_completed(point.epoch);
    for (const auto& [s, e] : point.after) record(s).mark_completed(e);
  }

  /// Stream `r` has executed everything up to `epoch`: so has all it was ordered after.
  /// Tells no listener (for a pool that learned it itself, under its own lock).
  void complete_stream_quietly(stream_record& r, std::uint64_t epoch) {
    r.mark_completed(epoch);
    for (const auto& [s, e] : r.clock()) record(s).mark_completed(e);
  }

  /// As `complete_stream_quietly`, after a host synchronization: listeners hear of it.
  void complete_stream(stream_record& r, std::uint64_t epoch) {
    complete_stream_quietly(r, epoch);
    notify(r.id());
  }

  /// Tells listeners that work was completed (a device-wide synchronization).
  void notify(std::uint64_t stream) {
    std::vector<completion_listener*> copy;
    {
      std::lock_guard lock(listener_mutex_);
      copy = listeners_;
    }
    for (auto* l : copy) l->on_synchronize(stream);
  }

  /// Marks every known stream completed up to its current epoch (after a device or context
  /// synchronization that covers all of them).
  void complete_all(const std::vector<std::pair<stream_record*, std::uint64_t>>& points) {
    for (auto [r, e] : points) r->mark_completed(e);
    notify(0);
  }

  /// Every record, with an epoch each; frees stamped up to it precede this call.
  std::vector<std::pair<stream_record*, std::uint64_t>> begin_synchronize_all() {
    std::vector<std::pair<stream_record*, std::uint64_t>> out;
    std::shared_lock lock(mutex_);
    out.reserve(records_.size());
    for (auto& [id, r] : records_) out.emplace_back(r.get(), r->begin_synchronize());
    return out;
  }

  /// Stream `id` is being destroyed (by streamalloc's `stream`); listeners let go of it.
  void retire(std::uint64_t id) {
    record(id).mark_retired();
    std::vector<completion_listener*> copy;
    {
      std::lock_guard lock(listener_mutex_);
      copy = listeners_;
    }
    for (auto* l : copy) l->on_retire(id);
  }

  void add_listener(completion_listener* l) {
    std::lock_guard lock(listener_mutex_);
    listeners_.push_back(l);
  }
  void remove_listener(completion_listener* l) {
    std::lock_guard lock(listener_mutex_);
    listeners_.erase(std::remove(listeners_.begin(), listeners_.end(), l), listeners_.end());
  }

  /// Is a block freed on `freed_on` with stamp `stamp` reusable by stream `user`?
  /// `follow_events`: accept an ordering proven through streamalloc's event waits.
  [[nodiscard]] bool reusable(std::uint64_t freed_on, std::uint64_t stamp, const stream_record& user,
                              bool follow_events) {
    if (freed_on == user.id()) return true;
    if (record(freed_on).completed() >= stamp) return true;
    return follow_events && user.ordered_after(freed_on) >= stamp;
  }

 private:
  std::shared_mutex mutex_;
  std::unordered_map<std::uint64_t, std::unique_ptr<stream_record>> records_;
  std::mutex listener_mutex_;
  std::vector<completion_listener*> listeners_;
};

/// The process's registry. Never destroyed: pools and handles may outlive main's locals.
inline ordering_registry& ordering() {
  static ordering_registry* r = new ordering_registry;
  return *r;
}

}  // namespace streamalloc::detail
