// A stream is not a proof of ordering: naming the old stream orders nothing.
// expect: a stream or an event proves nothing
#include <streamalloc/stream_buffer.hpp>

void use(streamalloc::stream_buffer<int>& buf, streamalloc::stream_ref b) {
  const streamalloc::stream_ref a = buf.stream();
#ifdef STREAMALLOC_EXPECT_FAIL
  buf.set_stream(b, a);
#else
  buf.set_stream(b, a.synchronize());
#endif
}
int main() { return 0; }
