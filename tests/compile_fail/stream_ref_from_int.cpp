// A stream handle cannot be made from an integer: `stream_ref(0)` would silently mean the
// legacy default stream.
// expect: an integer is not a stream: stream_ref::legacy_default\(\) is stream 0
#include <streamalloc/stream.hpp>

int main() {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::stream_ref s(0);
#else
  streamalloc::stream_ref s = streamalloc::stream_ref::legacy_default();
#endif
  return s.get() == cudaStreamLegacy ? 0 : 1;
}
