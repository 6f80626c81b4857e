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
//              the recording stream was itself ordered after). `max_clock_entries` to twice as many
//              streams, those of the most recent waits: forgetting an ordering only costs
//              reuse, and it keeps every record, capture and wait at a cost independent of how
//              many streams were ever ordered after each other (a ring of 1,024 streams walked
//              1,024 entries at every wait)
//
// Work ordered with raw CUDA calls is invisible here; it is never wrong, it only gives less
// reuse, because nothing is concluded without evidence.
//
// A record lives while it is held (`record_ref`: the `stream` that owns the stream, each pool
// state of the stream, each buffer the stream read) or its stream has not retired. A retired
// stream's id never returns, so once the last holder lets go nothing can ask for the record
// again and it is dropped: a process that makes and destroys streams all day holds records
// for the streams alive, not for every stream it ever made. Clocks and tokens may still name
// a dropped stream by id; that proves nothing any more, and every record made afterwards
// starts its epochs above all the dropped ones', so such a stale name never matches a new
// stamp either.

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <utility>
#include <vector>

namespace streamalloc::detail {

/// The streams a clock is sure to remember (its most recent waits'); it holds up to twice as
/// many before it forgets the oldest.
inline constexpr std::size_t clock_kept = 8;

/// (stream, epoch) pairs sorted by stream, at most 2 * clock_kept of them, held inline: a
/// stream's clock and an event's snapshot of it are a few cache lines with nothing behind a
/// pointer, which is what a ring over thousands of streams, each cold, pays for at every record
/// and wait.
class ordered_after_list {
 public:
  using value_type = std::pair<std::uint64_t, std::uint64_t>;
  static constexpr std::size_t capacity = 2 * clock_kept;

  [[nodiscard]] const value_type* begin() const noexcept { return items_.data(); }
  [[nodiscard]] const value_type* end() const noexcept { return items_.data() + count_; }
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
  void clear() noexcept { count_ = 0; }
  /// Appends, keeping the order by stream (the caller's job); beyond capacity, drops it.
  void push_back(std::uint64_t stream, std::uint64_t epoch) noexcept {
    if (count_ < capacity) items_[count_++] = {stream, epoch};
  }

 private:
  std::array<value_type, capacity> items_;
  std::uint32_t count_ = 0;
};

/// A point on a stream, and everything that point was ordered after.
struct clock_snapshot {
  std::uint64_t stream = 0;  ///< 0: no point (an event never recorded through streamalloc)
  std::uint64_t epoch = 0;
  ordered_after_list after;  ///< (stream, epoch), sorted by stream
};

// A cache line of its own: every free does a read-modify-write on `epoch_`, and records made
// one after another would otherwise share lines between threads on different streams.
class alignas(128) stream_record {
 public:
  /// `first_epoch`: above every epoch of a record dropped before this one was made.
  explicit stream_record(std::uint64_t id, std::uint64_t first_epoch = 1) noexcept : id_(id), epoch_(first_epoch) {}
  stream_record(const stream_record&) = delete;
  stream_record& operator=(const stream_record&) = delete;

  [[nodiscard]] std::uint64_t id() const noexcept { return id_; }

  /// The device the stream belongs to; -1 until known.
  [[nodiscard]] int device() const noexcept { return device_.load(std::memory_order_relaxed); }
  void set_device(int d) noexcept { device_.store(d, std::memory_order_relaxed); }
  /// The stream's context (a CUcontext; this layer makes no CUDA call), or null until known:
  /// kept so that the pools need not ask CUDA, which refuses to tell a capturing stream's.
  [[nodiscard]] void* context() const noexcept { return context_.load(std::memory_order_acquire); }
  void set_context(void* c) noexcept { context_.store(c, std::memory_order_release); }

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
    capture_into(s);
    return s;
  }
  /// As capture, into `s`.
  void capture_into(clock_snapshot& s) {
    s.stream = id_;
    s.after.clear();
    std::lock_guard lock(mutex_);
    s.epoch = epoch_.fetch_add(1, std::memory_order_acq_rel);
    for (std::uint32_t i = 0; i < clock_size_; ++i) s.after.push_back(clock_[i].stream, clock_[i].epoch);
  }

  /// This stream now waits for `point`: it is ordered after it and after all it was after.
  void wait_for(const clock_snapshot& point) {
    if (point.stream == 0 || point.stream == id_) return;
    std::lock_guard lock(mutex_);
    // The stream waited for directly ranks above those it was itself ordered after.
    const std::uint64_t tick = ++waits_;
    merge_in(point, tick);
  }

  /// The epoch of stream `other` this stream is known to be ordered after (0: none).
  [[nodiscard]] std::uint64_t ordered_after(std::uint64_t other) const {
    std::lock_guard lock(mutex_);
    for (std::uint32_t i = 0; i < clock_size_; ++i) {
      if (clock_[i].stream == other) return clock_[i].epoch;
    }
    return 0;
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

  /// What `owner` (a pool's stream table, by its serial, never reused) left here for this
  /// stream: its state, found without a lock or a table lookup, on the line a free stamps
  /// anyway. Null if another owner wrote the slot last. One slot, read with a sequence check
  /// (two fields cannot be read as one), so a reader never takes one owner's pointer for
  /// another's.
  [[nodiscard]] void* hint_for(std::uint64_t owner) const noexcept {
    // Acquire loads throughout, no fences (which ThreadSanitizer cannot follow): the second
    // read of the sequence cannot move above the fields' loads, and a field written after a
    // writer's odd mark carries that mark with it.
    const std::uint32_t before = hint_seq_.load(std::memory_order_acquire);
    const std::uint64_t o = hint_owner_.load(std::memory_order_acquire);
    void* p = hint_.load(std::memory_order_acquire);
    if ((before & 1) != 0 || hint_seq_.load(std::memory_order_relaxed) != before || o != owner) return nullptr;
    return p;
  }
  /// Leaves `p` for `owner` (see hint_for). `p == nullptr` clears the slot if `owner` has it.
  void set_hint(std::uint64_t owner, void* p) noexcept {
    std::lock_guard lock(mutex_);  // writers one at a time: the sequence needs it
    if (p == nullptr && hint_owner_.load(std::memory_order_relaxed) != owner) return;
    const std::uint32_t seq = hint_seq_.load(std::memory_order_relaxed);
    hint_seq_.store(seq + 1, std::memory_order_relaxed);
    // Release stores: the odd mark above cannot move below them (see hint_for).
    hint_owner_.store(p == nullptr ? 0 : owner, std::memory_order_release);
    hint_.store(p, std::memory_order_release);
    hint_seq_.store(seq + 2, std::memory_order_release);
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

  /// The legacy default stream. It cannot be captured, so a pool asks it whether it is idle
  /// from any call (completion.hpp), where another `stream` is asked only during its own calls.
  void mark_legacy() noexcept { legacy_.store(true, std::memory_order_release); }
  [[nodiscard]] bool legacy() const noexcept { return legacy_.load(std::memory_order_acquire); }

  /// The stream was destroyed through streamalloc: its handle must not be used any more.
  void mark_retired() noexcept { retired_.store(true, std::memory_order_release); }
  [[nodiscard]] bool retired() const noexcept { return retired_.load(std::memory_order_acquire); }

  /// How many streamalloc clock entries this record holds (for counting what the library keeps).
  [[nodiscard]] std::size_t clock_entries() const {
    std::lock_guard lock(mutex_);
    return clock_size_;
  }

  /// What this stream is ordered after, for completing it when the stream completes.
  [[nodiscard]] ordered_after_list clock() const {
    std::lock_guard lock(mutex_);
    ordered_after_list out;
    for (std::uint32_t i = 0; i < clock_size_; ++i) out.push_back(clock_[i].stream, clock_[i].epoch);
    return out;
  }

  /// The streams a clock is sure to remember (the most recent waits'); it holds at most twice
  /// as many.
  static constexpr std::size_t max_clock_entries = clock_kept;

 private:
  friend class ordering_registry;

  struct entry {
    std::uint64_t stream;
    std::uint64_t epoch;
    std::uint64_t touched;  // 2 * the wait that last raised or confirmed it (+1: waited for directly)
  };

  /// Merges `point` (ranked 2 * tick + 1: waited for directly) and what it was ordered after
  /// (ranked 2 * tick) into the clock, in one pass over both sorted lists into a buffer on the
  /// stack; past capacity, only the `max_clock_entries` entries touched most recently stay.
  void merge_in(const clock_snapshot& point, std::uint64_t tick) {
    std::array<entry, 2 * capacity + 1> out;
    std::size_t n = 0;
    const entry direct{point.stream, point.epoch, 2 * tick + 1};
    bool direct_done = false;
    auto put = [&](const entry& x) {
      if (n > 0 && out[n - 1].stream == x.stream) {  // the same stream from both sides
        out[n - 1].epoch = std::max(out[n - 1].epoch, x.epoch);
        out[n - 1].touched = std::max(out[n - 1].touched, x.touched);
      } else {
        out[n++] = x;
      }
    };
    const entry* a = clock_.data();
    const entry* const a_end = a + clock_size_;
    const auto* b = point.after.begin();
    const auto* const b_end = point.after.end();
    while (a != a_end || b != b_end || !direct_done) {
      // The smallest stream id of the three heads goes next.
      std::uint64_t next = ~0ull;
      if (a != a_end) next = a->stream;
      if (b != b_end) next = std::min(next, b->first);
      if (!direct_done) next = std::min(next, direct.stream);
      if (a != a_end && a->stream == next) put(*a++);
      if (b != b_end && b->first == next) {
        if (b->first != id_) put({b->first, b->second, 2 * tick});  // ordered after itself: nothing
        ++b;
      }
      if (!direct_done && direct.stream == next) {
        put(direct);
        direct_done = true;
      }
    }
    if (n <= capacity) {
      std::copy(out.begin(), out.begin() + n, clock_.begin());
      clock_size_ = static_cast<std::uint32_t>(n);
      return;
    }
    // Past capacity the `max_clock_entries` entries touched most recently stay, in stream
    // order. Those of this wait (touched >= 2 * tick) are the newest; in a ring over many
    // streams they alone fill the clock, so the threshold needs no selection at all.
    const std::uint64_t now = 2 * tick;
    std::size_t incoming = 0;
    for (std::size_t i = 0; i < n; ++i) incoming += out[i].touched >= now;
    std::uint64_t threshold = now;  // entries above it stay; at it, the first in stream order
    if (incoming < max_clock_entries) {
      std::array<std::uint64_t, 2 * capacity + 1> older;
      std::size_t m = 0;
      for (std::size_t i = 0; i < n; ++i) {
        if (out[i].touched < now) older[m++] = out[i].touched;
      }
      const std::size_t k = max_clock_entries - incoming;  // the k-th newest of the older ones
      std::nth_element(older.begin(), older.begin() + (k - 1), older.begin() + m, std::greater<>());
      threshold = older[k - 1];
    }
    std::size_t above = 0;
    for (std::size_t i = 0; i < n; ++i) above += out[i].touched > threshold;
    std::size_t at_threshold = max_clock_entries - above;
    std::size_t kept = 0;
    for (std::size_t i = 0; i < n; ++i) {
      if (out[i].touched > threshold || (out[i].touched == threshold && at_threshold > 0 && at_threshold--)) {
        clock_[kept++] = out[i];
      }
    }
    clock_size_ = static_cast<std::uint32_t>(kept);
  }

  const std::uint64_t id_;
  std::atomic<int> device_{-1};
  std::atomic<void*> context_{nullptr};
  // Epoch 0 is never a stamp, so "ordered after 0" and "completed 0" mean nothing is known.
  std::atomic<std::uint64_t> epoch_;
  std::atomic<std::uint64_t> completed_{0};
  std::atomic<bool> retired_{false};
  std::atomic<bool> handle_stable_{false};
  std::atomic<bool> legacy_{false};
  std::atomic<std::uint32_t> hint_seq_{0};  // odd while a writer changes the slot
  std::atomic<std::uint64_t> hint_owner_{0};
  std::atomic<void*> hint_{nullptr};
  mutable std::mutex mutex_;
  static constexpr std::size_t capacity = ordered_after_list::capacity;
  std::array<entry, capacity> clock_;  // the first clock_size_, sorted by stream id
  std::uint32_t clock_size_ = 0;
  std::uint64_t waits_ = 0;
  std::atomic<std::uint64_t> holders_{0};  // record_refs; see the top of the file
};

/// Listens for completions learned at host synchronizations (the pools, to release memory).
class completion_listener {
 public:
  virtual void on_synchronize(std::uint64_t stream) noexcept = 0;
  /// The stream is about to be destroyed, or is gone: record nothing on it after this returns.
  /// `handle_valid`: its handle may still be used during this call (a `stream` being
  /// destroyed); false for a raw stream found destroyed after the fact (retire_gone).
  virtual void on_retire(std::uint64_t stream, bool handle_valid) noexcept = 0;

 protected:
  ~completion_listener() = default;
};

class record_ref;

class ordering_registry {
 public:
  ordering_registry() = default;
  ordering_registry(const ordering_registry&) = delete;
  ordering_registry& operator=(const ordering_registry&) = delete;

  /// The record of stream `id`, created on first use. It stays while the stream has not
  /// retired or anything holds it (see the top of the file).
  stream_record& record(std::uint64_t id) {
    {
      std::shared_lock lock(mutex_);
      if (auto it = records_.find(id); it != records_.end()) return *it->second;
    }
    std::unique_lock lock(mutex_);
    auto& slot = records_[id];
    if (!slot) slot = std::make_unique<stream_record>(id, epoch_floor_ + 1);
    return *slot;
  }

  /// The record of stream `id` if there is one; never creates one.
  stream_record* find(std::uint64_t id) {
    std::shared_lock lock(mutex_);
    auto it = records_.find(id);
    return it != records_.end() ? it->second.get() : nullptr;
  }

  /// A snapshot's point (and all it was after) has executed. Streams whose records are gone
  /// are skipped: nothing waits on them any more.
  void complete(const clock_snapshot& point) {
    if (point.stream == 0) return;
    if (stream_record* r = find(point.stream)) r->mark_completed(point.epoch);
    complete_each(point.after);
  }

  /// Stream `r` has executed everything up to `epoch`: so has all it was ordered after.
  /// Tells no listener (for a pool that learned it itself, under its own lock).
  void complete_stream_quietly(stream_record& r, std::uint64_t epoch) {
    r.mark_completed(epoch);
    complete_each(r.clock());
  }

  /// As `complete_stream_quietly`, after a host synchronization: listeners hear of it.
  void complete_stream(stream_record& r, std::uint64_t epoch) {
    complete_stream_quietly(r, epoch);
    notify(r.id());
  }

  /// Tells listeners that work was completed (a device-wide synchronization).
  void notify(std::uint64_t stream) {
    // Under the lock, shared: a pool being destroyed waits in remove_listener until no call is
    // told of it any more (told from a copy of the list, a pool destroyed meanwhile was called
    // after it was gone), and the list is not copied (which needed host memory).
    std::shared_lock lock(listener_mutex_);
    for (auto* l : listeners_) l->on_synchronize(stream);
  }

  /// Every record, held, with an epoch each; frees stamped up to it precede this call.
  inline std::vector<std::pair<record_ref, std::uint64_t>> begin_synchronize_all();

  /// Marks every record of `points` completed up to its epoch (after a device or context
  /// synchronization that covers all of them).
  inline void complete_all(const std::vector<std::pair<record_ref, std::uint64_t>>& points);

  /// Device-wide synchronizations, numbered in one sequence for all devices as they begin, and
  /// per device the highest number of one that has ended: work enqueued on `device`'s streams
  /// before `device_syncs_begun(device)` returned g is done once `device_syncs_done(device)`
  /// exceeds g (for what no stream's record can prove: pool_graphs.hpp). Devices beyond the
  /// first 64 are never counted as synchronized.
  std::uint64_t begin_device_sync(int device) noexcept {
    return in_range(device) ? syncs_begun_.fetch_add(1, std::memory_order_acq_rel) + 1 : 0;
  }
  void end_device_sync(int device, std::uint64_t begun) noexcept {
    if (!in_range(device)) return;
    std::uint64_t done = device_syncs_done_[device].load(std::memory_order_relaxed);
    while (begun > done && !device_syncs_done_[device].compare_exchange_weak(done, begun, std::memory_order_release)) {
    }
  }
  /// As above for a device, or for a synchronization domain (below): the same sequence.
  [[nodiscard]] std::uint64_t device_syncs_begun(int device) const noexcept {
    return in_range(device) || device >= counted_devices ? syncs_begun_.load(std::memory_order_acquire) : 0;
  }
  /// For a device, the highest number of its synchronizations that has ended; for a domain,
  /// the least of that over the domain's devices.
  [[nodiscard]] std::uint64_t device_syncs_done(int device) const noexcept {
    if (device < counted_devices) return in_range(device) ? device_syncs_done_[device].load(std::memory_order_acquire) : 0;
    std::uint64_t done = device_syncs_done_[device % counted_devices].load(std::memory_order_acquire);
    std::uint64_t users = 0;
    // Every pool asks at every device-wide synchronization: no lock while no pool has peers.
    if (domains_with_users_.load(std::memory_order_acquire) != 0) {
      std::shared_lock lock(domains_mutex_);
      if (auto it = domain_users_.find(device); it != domain_users_.end()) users = it->second;
    }
    for (int d = 0; d < counted_devices; ++d) {
      if ((users >> d & 1) != 0) done = std::min(done, device_syncs_done_[d].load(std::memory_order_acquire));
    }
    return done;
  }

  /// Synchronization domains: the devices whose work one pool's memory may be waiting for. A
  /// pool's memory lives on one device, but streams of other devices may use it once the pool
  /// grants them access; "every piece of work that may use it is done" then needs a device-wide
  /// synchronization of each of those devices (of the memory's device alone it proves nothing
  /// about a peer's streams). A domain's id stands where a device's does in `device_syncs_begun`
  /// and `device_syncs_done` (the pool core is given it as its device); ids are 64 and above,
  /// the domain's first device being `id % 64`, so a domain without other devices costs no
  /// lookup. Ids of closed domains are reused.
  [[nodiscard]] int open_sync_domain(int device) {
    if (!in_range(device)) return device;  // never counted as synchronized either way
    std::unique_lock lock(domains_mutex_);
    int serial = 0;
    if (!free_domains_.empty()) {
      serial = free_domains_.back();
      free_domains_.pop_back();
    } else {
      serial = ++domains_made_;
    }
    return serial * counted_devices + device;
  }
  /// Streams of device `user` may use the memory of `domain` from now on (for the domain's
  /// life: work they enqueued may outlive a revocation).
  void add_domain_user(int domain, int user) {
    if (domain < counted_devices || !in_range(user) || user == domain % counted_devices) return;
    std::unique_lock lock(domains_mutex_);
    std::uint64_t& users = domain_users_[domain];
    if (users == 0) domains_with_users_.fetch_add(1, std::memory_order_acq_rel);
    users |= std::uint64_t{1} << user;
  }
  /// The devices of `domain` besides its first, as a bit mask.
  [[nodiscard]] std::uint64_t domain_users(int domain) const noexcept {
    std::shared_lock lock(domains_mutex_);
    auto it = domain_users_.find(domain);
    return it != domain_users_.end() ? it->second : 0;
  }
  /// Nothing asks about `domain` any more (its pool core is gone); its id may be handed out again.
  void close_sync_domain(int domain) noexcept {
    if (domain < counted_devices) return;
    std::unique_lock lock(domains_mutex_);
    if (domain_users_.erase(domain) != 0) domains_with_users_.fetch_sub(1, std::memory_order_acq_rel);
    try {
      free_domains_.push_back(domain / counted_devices);
    } catch (...) {  // out of host memory: the id is not reused
    }
  }

  /// Stream `id` is being destroyed (by streamalloc's `stream`); listeners let go of it.
  /// Held meanwhile, so that the record is dropped here, at the end, if nothing else holds it.
  /// `handle_valid`: listeners may still use the stream's handle during the call.
  inline void retire(std::uint64_t id, bool handle_valid = true);

  /// Raw stream handles and the stream each named when streamalloc first met that stream.
  /// CUDA gives a destroyed stream's handle to a stream made later, and two live streams never
  /// share one; so a handle met again naming another stream is the news that the stream it
  /// named before is gone, which is how streamalloc learns that a raw stream (or a thread's
  /// per-thread default stream, see stream.hpp) was destroyed. Returns the id `handle` named
  /// before, if it named another stream (the caller retires it: retire_gone), else 0.
  std::uint64_t note_handle(const void* handle, std::uint64_t id) {
    std::lock_guard lock(handles_mutex_);
    auto [it, inserted] = handles_.try_emplace(handle, id);
    if (inserted || it->second == id) return 0;
    return std::exchange(it->second, id);
  }
  /// `handle` no longer names stream `id` (a `stream` destroying its own).
  void forget_handle(const void* handle, std::uint64_t id) noexcept {
    std::lock_guard lock(handles_mutex_);
    if (auto it = handles_.find(handle); it != handles_.end() && it->second == id) handles_.erase(it);
  }
  /// Stream `id` was destroyed without streamalloc being told (its handle now names another
  /// stream, or its thread ended): as retire, without using its handle, which is gone.
  void retire_gone(std::uint64_t id) { retire(id, /*handle_valid=*/false); }

  /// Stream `id` is gone, learned where nothing may be done about it yet (a thread ending:
  /// the driver's and other thread-local state may be gone): retired, as by retire_gone, at
  /// the next retire_found_gone. Out of host memory, it is never retired, which is safe.
  void note_gone(std::uint64_t id) noexcept {
    try {
      std::lock_guard lock(gone_mutex_);
      gone_.push_back(id);
      gone_waiting_.store(true, std::memory_order_release);
    } catch (...) {
    }
  }
  /// Retires the streams note_gone was told of (called where streams are met, and before a
  /// device-wide synchronization). Nothing to do costs one load.
  void retire_found_gone() {
    if (!gone_waiting_.load(std::memory_order_acquire)) [[likely]] return;
    std::vector<std::uint64_t> ids;
    {
      std::lock_guard lock(gone_mutex_);
      ids.swap(gone_);
      gone_waiting_.store(false, std::memory_order_relaxed);
    }
    for (const std::uint64_t id : ids) retire_gone(id);
  }

  void add_listener(completion_listener* l) {
    std::unique_lock lock(listener_mutex_);
    listeners_.push_back(l);
  }
  void remove_listener(completion_listener* l) {
    std::unique_lock lock(listener_mutex_);
    listeners_.erase(std::remove(listeners_.begin(), listeners_.end(), l), listeners_.end());
  }

  /// Is a block freed on `freed_on` with stamp `stamp` reusable by stream `user`?
  /// `follow_events`: accept an ordering proven through streamalloc's event waits.
  [[nodiscard]] bool reusable(std::uint64_t freed_on, std::uint64_t stamp, const stream_record& user,
                              bool follow_events) {
    if (freed_on == user.id()) return true;
    if (const stream_record* r = find(freed_on); r != nullptr && r->completed() >= stamp) return true;
    return follow_events && user.ordered_after(freed_on) >= stamp;
  }

  /// What the registry holds: records, clock entries in all of them, raw handles known.
  struct census_counts {
    std::size_t records = 0, clock_entries = 0, handles = 0;
  };
  [[nodiscard]] census_counts census() {
    census_counts c;
    {
      std::shared_lock lock(mutex_);
      c.records = records_.size();
      for (auto& [id, r] : records_) c.clock_entries += r->clock_entries();
    }
    std::lock_guard lock(handles_mutex_);
    c.handles = handles_.size();
    return c;
  }

 private:
  friend class record_ref;

  void hold(stream_record& r) noexcept { r.holders_.fetch_add(1, std::memory_order_relaxed); }
  void let_go(stream_record& r) noexcept {
    const std::uint64_t id = r.id();
    // retire() holds the record while it marks it, so the last let_go comes after the mark.
    if (r.holders_.fetch_sub(1, std::memory_order_acq_rel) == 1 && r.retired()) drop(id);
  }

  /// Drops the record of `id` if it is retired and nobody holds it (looked up again under the
  /// lock: two callers may race here, and only one finds it).
  void drop(std::uint64_t id) noexcept {
    std::unique_ptr<stream_record> gone;
    {
      std::unique_lock lock(mutex_);
      auto it = records_.find(id);
      if (it == records_.end() || !it->second->retired() ||
          it->second->holders_.load(std::memory_order_acquire) != 0) {
        return;
      }
      epoch_floor_ = std::max(epoch_floor_, it->second->current_epoch());
      gone = std::move(it->second);
      records_.erase(it);
    }
  }

  void complete_each(const ordered_after_list& points) {
    for (const auto& [s, e] : points) {
      if (stream_record* r = find(s)) r->mark_completed(e);
    }
  }

  std::shared_mutex mutex_;
  std::unordered_map<std::uint64_t, std::unique_ptr<stream_record>> records_;
  std::uint64_t epoch_floor_ = 0;  // the highest epoch of a dropped record
  // Shared by the calls that tell the listeners (any number at once), exclusive to add or
  // remove one.
  std::shared_mutex listener_mutex_;
  std::vector<completion_listener*> listeners_;
  std::mutex gone_mutex_;
  std::vector<std::uint64_t> gone_;  // note_gone's, not retired yet
  std::atomic<bool> gone_waiting_{false};
  std::mutex handles_mutex_;
  std::unordered_map<const void*, std::uint64_t> handles_;  // raw handle -> the stream it names
  static constexpr int counted_devices = 64;
  static bool in_range(int device) noexcept { return device >= 0 && device < counted_devices; }
  std::atomic<std::uint64_t> syncs_begun_{0};
  std::array<std::atomic<std::uint64_t>, counted_devices> device_syncs_done_{};
  mutable std::shared_mutex domains_mutex_;
  std::unordered_map<int, std::uint64_t> domain_users_;  // domain -> bit d: device d's streams use it
  std::atomic<int> domains_with_users_{0};                // entries of domain_users_
  std::vector<int> free_domains_;                        // serials of closed domains
  int domains_made_ = 0;
};

/// The process's registry. Never destroyed: pools and handles may outlive main's locals.
inline ordering_registry& ordering() {
  static ordering_registry* r = new ordering_registry;
  return *r;
}

/// A counted hold on a stream record: while one exists, the record is not dropped.
class record_ref {
 public:
  record_ref() noexcept = default;
  explicit record_ref(stream_record& r) noexcept : r_(&r) { ordering().hold(r); }
  explicit record_ref(stream_record* r) noexcept : r_(r) {
    if (r_ != nullptr) ordering().hold(*r_);
  }
  record_ref(const record_ref& o) noexcept : record_ref(o.r_) {}
  record_ref(record_ref&& o) noexcept : r_(std::exchange(o.r_, nullptr)) {}
  record_ref& operator=(record_ref o) noexcept {
    std::swap(r_, o.r_);
    return *this;
  }
  ~record_ref() { reset(); }

  void reset() noexcept {
    if (r_ != nullptr) ordering().let_go(*std::exchange(r_, nullptr));
  }
  [[nodiscard]] stream_record* get() const noexcept { return r_; }
  stream_record* operator->() const noexcept { return r_; }
  stream_record& operator*() const noexcept { return *r_; }
  explicit operator bool() const noexcept { return r_ != nullptr; }

 private:
  stream_record* r_ = nullptr;
};

inline void ordering_registry::retire(std::uint64_t id, bool handle_valid) {
  const record_ref keep(record(id));
  if (keep->retired()) return;  // told twice (a handle met again after its stream retired)
  keep->mark_retired();
  // As notify: under the shared lock, with no copy of the list. Streams retire in destructors,
  // which may not throw (a copy refused for lack of host memory ended the process there).
  std::shared_lock lock(listener_mutex_);
  for (auto* l : listeners_) l->on_retire(id, handle_valid);
}

inline std::vector<std::pair<record_ref, std::uint64_t>> ordering_registry::begin_synchronize_all() {
  std::vector<std::pair<record_ref, std::uint64_t>> out;
  std::shared_lock lock(mutex_);
  out.reserve(records_.size());
  for (auto& [id, r] : records_) out.emplace_back(record_ref(*r), r->begin_synchronize());
  return out;
}

inline void ordering_registry::complete_all(const std::vector<std::pair<record_ref, std::uint64_t>>& points) {
  for (const auto& [r, e] : points) r->mark_completed(e);
  notify(0);
}

}  // namespace streamalloc::detail
