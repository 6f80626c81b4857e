// Freeing an arena on another stream needs proof that the kernels that allocated from it run
// before the free.
// expect: device_arena::free_on: freeing on another stream needs proof
#include <streamalloc/device_arena.hpp>

#include <utility>

void use(streamalloc::device_arena arena, streamalloc::stream_ref b) {
#ifdef STREAMALLOC_EXPECT_FAIL
  std::move(arena).free_on(b);
#else
  std::move(arena).free_on(b, streamalloc::order_after(b, arena.stream()));
#endif
}
int main() { return 0; }
