// detail::buffer_readers against the fake driver: the streams that read a stream_buffer are
// ordered before its free, through the stream's record or, for a raw stream whose handle may
// name another stream by then, through the event recorded at the read. The GPU test
// (tests/gpu/stream_buffer_test.cu) frees buffers behind slow kernels of their readers.

#include <streamalloc/detail/buffer_readers.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <cstdint>

using namespace streamalloc;

namespace {
/// How far `s` is known to be ordered after stream `other`'s work (an epoch of `other`).
std::uint64_t ordered_after(const stream& s, const stream_ref other) {
  return s.ref().record().ordered_after(other.record().id());
}

/// Work on `s`: an event recorded there moves its epoch on.
void work_on(stream_ref s) {
  event e;
  e.record(s);
}
}  // namespace

TEST_SUITE("buffer_readers") {

TEST_CASE("a reader on another stream: the buffer's stream is ordered after the read, once") {
  stream owner(0), reader(0);
  (void)order_after(owner.ref(), reader.ref());  // ordered after the reader's work so far
  work_on(reader.ref());                         // and not after this, nor the read
  detail::buffer_readers readers;
  const std::uint64_t read_at = reader.ref().record().current_epoch();
  readers.note(reader.ref());
  CHECK(ordered_after(owner, reader.ref()) < read_at);
  readers.order_before_free(owner.ref());
  CHECK(ordered_after(owner, reader.ref()) >= read_at);
  // Forgotten once ordered: the reader's later work is not waited for again.
  work_on(reader.ref());
  const std::uint64_t ordered = ordered_after(owner, reader.ref());
  readers.order_before_free(owner.ref());
  CHECK(ordered_after(owner, reader.ref()) == ordered);
}

TEST_CASE("a raw reader destroyed before the free: ordered through the event of its read") {
  stream owner(0);
  CUstream raw = nullptr;
  detail::cu::cuStreamCreateWithPriority(&raw, CU_STREAM_NON_BLOCKING, 0);
  const stream_ref read_on{raw};
  detail::stream_record& old_record = read_on.record();
  CHECK_FALSE(old_record.handle_stable());
  work_on(read_on);
  detail::buffer_readers readers;
  const std::uint64_t read_at = old_record.current_epoch();
  readers.note(read_on);
  detail::cu::cuStreamDestroy(raw);
  // CUDA hands the destroyed stream's handle to the next stream made: the free must not
  // order after that one in the old one's place.
  CUstream next = nullptr;
  detail::cu::cuStreamCreateWithPriority(&next, CU_STREAM_NON_BLOCKING, 0);
  readers.order_before_free(owner.ref());
  CHECK(owner.ref().record().ordered_after(old_record.id()) >= read_at);
  detail::cu::cuStreamDestroy(next);
}

TEST_CASE("no ordering where none is needed: the buffer's own stream, a reader known done, readers cleared") {
  stream owner(0), done(0), cleared(0);
  work_on(done.ref());
  work_on(cleared.ref());
  detail::buffer_readers readers;
  readers.note(owner.ref());
  readers.note(done.ref());
  (void)done.synchronize();  // through streamalloc: the read is known complete
  const std::uint64_t before = ordered_after(owner, done.ref());
  readers.order_before_free(owner.ref());
  CHECK(ordered_after(owner, done.ref()) == before);

  readers.note(cleared.ref());
  readers.clear();
  const std::uint64_t cleared_before = ordered_after(owner, cleared.ref());
  readers.order_before_free(owner.ref());
  CHECK(ordered_after(owner, cleared.ref()) == cleared_before);
  CHECK(cleared_before < cleared.ref().record().current_epoch());  // it would have been ordered
}

}  // TEST_SUITE
