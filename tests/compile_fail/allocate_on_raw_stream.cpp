// The current-pool allocate takes its stream as a stream_ref, like pool::allocate: a raw
// cudaStream_t (as cudaMallocAsync takes) is made one explicitly, and the message says how.
// expect: streamalloc::allocate: pass a cudaStream_t s as streamalloc::stream_ref\{s\}
#include <streamalloc/pool.hpp>

void use(cudaStream_t s) {
#ifdef STREAMALLOC_EXPECT_FAIL
  void* p = streamalloc::allocate(256, s);
#else
  void* p = streamalloc::allocate(256, streamalloc::stream_ref{s});
#endif
  streamalloc::deallocate(p, streamalloc::stream_ref{s});
}
int main() { return 0; }
