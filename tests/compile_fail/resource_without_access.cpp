// A resource says where its memory can be used from.
// expect: name what the memory is accessible from
#include <streamalloc/resource.hpp>

void use(streamalloc::pool& pool) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::pool_resource<> r(pool);
#else
  streamalloc::pool_resource<streamalloc::device_accessible> r(pool);
#endif
  (void)r;
}
int main() { return 0; }
