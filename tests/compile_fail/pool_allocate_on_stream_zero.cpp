// `0` is not a stream: the message names the default streams and how to pass a raw handle.
// expect: pool::allocate: pass a cudaStream_t s as streamalloc::stream_ref\{s\}.*legacy_default
#include <streamalloc/pool.hpp>

void use(streamalloc::pool& p) {
#ifdef STREAMALLOC_EXPECT_FAIL
  void* x = p.allocate(256, 0);
#else
  void* x = p.allocate(256, streamalloc::stream_ref::legacy_default());
#endif
  p.deallocate(x, streamalloc::stream_ref::legacy_default());
}
int main() { return 0; }
