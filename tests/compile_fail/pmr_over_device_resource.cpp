// std::pmr containers construct their elements in host code: device memory is rejected.
// expect: the resource must be host_accessible
#include <streamalloc/resource.hpp>

void use(streamalloc::pool& device_pool, streamalloc::pool& host_pool) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::pmr_resource mr(streamalloc::device_resource{device_pool});
  (void)host_pool;
#else
  streamalloc::pmr_resource mr(streamalloc::host_resource{host_pool});
  (void)device_pool;
#endif
}
int main() { return 0; }
