// Using a buffer on another stream needs proof that the stream runs after the buffer's.
// expect: moves to another stream only with proof
#include <streamalloc/stream_buffer.hpp>

void use(streamalloc::stream_buffer<int>& buf, streamalloc::stream_ref b) {
#ifdef STREAMALLOC_EXPECT_FAIL
  buf.set_stream(b);
#else
  buf.set_stream(b, streamalloc::order_after(b, buf.stream()));
#endif
}
int main() { return 0; }
