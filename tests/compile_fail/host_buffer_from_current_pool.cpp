// The current pool of a device holds device memory: a host-accessible buffer names a host pool.
// expect: a host-accessible buffer needs a host pool's resource
#include <streamalloc/stream_buffer.hpp>

void use(streamalloc::pool& host_pool, streamalloc::stream_ref s) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::host_stream_buffer<int> b(10, s);
  (void)host_pool;
#else
  streamalloc::host_stream_buffer<int> b(10, s, streamalloc::host_device_resource(host_pool));
#endif
}
int main() { return 0; }
