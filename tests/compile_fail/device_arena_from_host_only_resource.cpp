// Kernels allocate from an arena: its memory cannot come from a resource that claims host
// access only.
// expect: device_arena: kernels allocate from an arena, but the resource does not claim device_accessible
#include <streamalloc/device_arena.hpp>

void use(streamalloc::pool& host_pool, streamalloc::stream_ref s) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::device_arena a(1 << 20, s, streamalloc::host_resource(host_pool));
#else
  streamalloc::device_arena a(1 << 20, s, streamalloc::host_device_resource(host_pool));
#endif
}
int main() { return 0; }
