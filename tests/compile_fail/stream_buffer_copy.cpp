// A buffer owns its memory: a copy would free it twice. Move it, or copy the contents with
// copy_from on a stream.
// expect: use of deleted function .*basic_stream_buffer<T, Properties>::basic_stream_buffer\(const streamalloc::(ordering_(un)?checked::)?basic_stream_buffer
#include <streamalloc/stream_buffer.hpp>

void use(streamalloc::stream_buffer<int>& a) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::stream_buffer<int> b(a);
#else
  streamalloc::stream_buffer<int> b(a.size(), a.stream());
  b.copy_from(a);
#endif
}
int main() { return 0; }
