// `0` (or NULL) is not a stream: the message names the default streams to say instead.
// expect: for stream 0 say streamalloc::stream_ref::legacy_default\(\) \(or per_thread_default\(\)\)
#include <streamalloc/stream_buffer.hpp>

void use() {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::stream_buffer<float> y(10, 0);
#else
  streamalloc::stream_buffer<float> y(10, streamalloc::stream_ref::legacy_default());
#endif
}
int main() { return 0; }
