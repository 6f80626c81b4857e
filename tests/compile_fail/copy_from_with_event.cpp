// Reading another stream's buffer needs the token the wait returns, not the event itself:
// recording an event orders nothing until a stream waits on it.
// expect: the second argument must prove the ordering
#include <streamalloc/stream_buffer.hpp>

void use(streamalloc::stream_buffer<int>& dst, const streamalloc::stream_buffer<int>& src, streamalloc::event& e) {
  e.record(src.stream());
#ifdef STREAMALLOC_EXPECT_FAIL
  dst.copy_from(src, e);
#else
  dst.copy_from(src, dst.stream().wait(e));
#endif
}
int main() { return 0; }
