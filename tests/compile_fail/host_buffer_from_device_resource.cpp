// A buffer read by host code cannot come from a device pool's resource.
// expect: does not claim host_accessible
#include <streamalloc/stream_buffer.hpp>

void use(streamalloc::pool& device_pool, streamalloc::pool& host_pool, streamalloc::stream_ref s) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::host_stream_buffer<int> b(10, s, streamalloc::device_resource(device_pool));
  (void)host_pool;
#else
  streamalloc::host_stream_buffer<int> b(10, s, streamalloc::host_device_resource(host_pool));
  (void)device_pool;
#endif
}
int main() { return 0; }
