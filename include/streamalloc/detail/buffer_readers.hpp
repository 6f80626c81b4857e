#pragma once

// The streams that read a buffer and must be ordered before its memory is freed.
//
// `stream_buffer::copy_from(other, proof)` reads `other` on the copying buffer's stream. The
// proof orders that read after `other`'s last use, not `other`'s later free after the read: the
// free goes on `other`'s own stream, which may not be ordered after the reader at all. So the
// buffer remembers each such reader, and before its memory goes back to the pool (free, or the
// part a shrink gives back) orders its own stream after every reader it cannot already see
// finished or followed. A reader whose handle may not be used later (a raw stream, which may be
// destroyed and its handle given to the next stream made; the per-thread default stream, whose
// handle names another stream on each thread) is covered at the read by an event.

#include <streamalloc/stream.hpp>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace streamalloc::detail {

class buffer_readers {
 public:
  /// Stream `s` has just read the buffer.
  void note(stream_ref s) {
    stream_record& r = s.record();
    const std::uint64_t stamp = r.stamp();
    std::unique_ptr<event> after;
    if (!r.handle_stable()) after = event_after(s);
    readers_.push_back({s, record_ref(r), stamp, std::move(after)});
  }

  /// Orders `owner` (the buffer's stream, which frees it) after every reader not known to be
  /// done or followed, then forgets them all. Throws when an ordering cannot be made (a dead
  /// context): the caller must not free then.
  void order_before_free(stream_ref owner) {
    for (const reader& r : readers_) {
      if (r.record.get() == &owner.record()) continue;  // the same stream (not merely the same handle)
      if (owner.record().ordered_after(r.record->id()) >= r.stamp || r.record->completed() >= r.stamp) continue;
      if (r.after) {
        (void)owner.wait(*r.after);
      } else if (r.record->retired()) {
        // The reader's stream is gone (destroyed with work perhaps still queued) and its
        // handle may already name another stream: wait for its device instead, so the memory
        // is neither freed under a reader nor leaked.
        (void)synchronize_device(r.record->device());
      } else {
        (void)order_after(owner, r.stream);
      }
    }
    readers_.clear();
  }

  /// Forgets every reader: the memory they read is not freed by this buffer (gone with a
  /// closed pool, or its free refused).
  void clear() noexcept { readers_.clear(); }

 private:
  struct reader {
    stream_ref stream;
    record_ref record;  // held: the stream may be gone when the buffer is freed
    std::uint64_t stamp;
    // For a stream whose handle may not be used later: an event recorded right after the
    // read, while the handle was in hand.
    std::unique_ptr<event> after;
  };

  /// An event recorded on `s` now, made in `s`'s context (an event is recorded only on streams
  /// of the context it was made in).
  static std::unique_ptr<event> event_after(stream_ref s) {
    std::unique_ptr<event> e = make_event_in(context_of(s));
    e->record(s);
    return e;
  }

  std::vector<reader> readers_;
};

}  // namespace streamalloc::detail
