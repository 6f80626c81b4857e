// std::pmr containers construct their elements in host code: device memory is rejected, also
// under a logging resource.
// expect: the resource must be host_accessible
#include <streamalloc/logging_resource.hpp>

#include <iostream>

void use(streamalloc::pool& device_pool, streamalloc::pool& host_pool) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::logging_resource mr(streamalloc::device_resource{device_pool}, std::cerr);
  (void)host_pool;
#else
  streamalloc::logging_resource mr(streamalloc::host_resource{host_pool}, std::cerr);
  (void)device_pool;
#endif
  streamalloc::pmr_resource pmr(mr);
}
int main() { return 0; }
