// An imported pool cannot be a device's current pool: it cannot allocate.
// expect: an imported_pool cannot be a current pool
#include <streamalloc/ipc.hpp>

void use(streamalloc::imported_pool& from, streamalloc::pool& mine) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::set_current_pool(0, from);
#else
  (void)from;
  streamalloc::set_current_pool(0, mine);
#endif
}
int main() { return 0; }
