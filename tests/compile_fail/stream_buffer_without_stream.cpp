// A buffer is allocated in the order of a stream: there is no default one.
// expect: a buffer is allocated in the order of a stream
#include <streamalloc/stream_buffer.hpp>

void use(streamalloc::stream_ref s) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::stream_buffer<int> b(10);
#else
  streamalloc::stream_buffer<int> b(10, s);
#endif
}
int main() { return 0; }
