// A logging resource over anything but a pool resource cannot back a buffer either: the buffer
// grows in place through the pool under it.
// expect: allocate from a streamalloc pool_resource
#include <streamalloc/logging_resource.hpp>
#include <streamalloc/stream_buffer.hpp>

#include <iostream>

void use(streamalloc::pool& pool, streamalloc::stream_ref s) {
  streamalloc::device_resource r(pool);
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::logging_resource mr(cuda::mr::async_resource_ref<cuda::mr::device_accessible>(r), std::cerr);
#else
  streamalloc::logging_resource mr(r, std::cerr);
#endif
  streamalloc::stream_buffer<int> b(10, s, mr);
}
int main() { return 0; }
