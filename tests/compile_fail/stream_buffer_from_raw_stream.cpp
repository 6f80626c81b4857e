// A raw cudaStream_t is taken as an explicit stream_ref: the message says how to write it.
// expect: pass a cudaStream_t s as streamalloc::stream_ref\{s\}
#include <streamalloc/stream_buffer.hpp>

void use(cudaStream_t s) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::stream_buffer<float> y(10, s);
#else
  streamalloc::stream_buffer<float> y(10, streamalloc::stream_ref{s});
#endif
}
int main() { return 0; }
