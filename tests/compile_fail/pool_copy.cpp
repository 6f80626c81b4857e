// A pool owns physical memory: a copy would release it twice. Pass a pool_ref instead.
// expect: use of deleted function .*pool::pool\(const streamalloc::pool&\)
#include <streamalloc/pool.hpp>

void use(streamalloc::pool& a) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::pool b(a);
#else
  streamalloc::pool_ref b(a);
#endif
  (void)b;
}
int main() { return 0; }
