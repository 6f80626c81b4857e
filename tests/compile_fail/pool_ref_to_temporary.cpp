// A temporary pool dies at the end of the expression, taking its memory: a ref to it would
// dangle at once. Keep the pool in a variable and take the ref from that.
// expect: use of deleted function .*pool_ref::pool_ref\(streamalloc::pool&&\)
#include <streamalloc/pool.hpp>

streamalloc::pool make_pool() { return streamalloc::pool{}; }

void use() {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::pool_ref r = make_pool();
#else
  streamalloc::pool p = make_pool();
  streamalloc::pool_ref r = p;
#endif
  (void)r;
}
int main() { return 0; }
