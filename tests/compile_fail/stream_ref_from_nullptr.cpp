// A stream handle cannot be made from nullptr: say which default stream is meant.
// expect: use of deleted function .*stream_ref::stream_ref\(std::nullptr_t\)
#include <streamalloc/stream.hpp>

int main() {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::stream_ref s(nullptr);
#else
  streamalloc::stream_ref s = streamalloc::stream_ref::per_thread_default();
#endif
  return s.get() == cudaStreamPerThread ? 0 : 1;
}
