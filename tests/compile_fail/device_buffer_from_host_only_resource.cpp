// The reverse: a buffer for kernels cannot come from a resource that claims host access only.
// expect: does not claim device_accessible
#include <streamalloc/stream_buffer.hpp>

void use(streamalloc::pool& host_pool, streamalloc::stream_ref s) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::stream_buffer<int> b(10, s, streamalloc::host_resource(host_pool));
#else
  streamalloc::stream_buffer<int> b(10, s, streamalloc::host_device_resource(host_pool));
#endif
}
int main() { return 0; }
