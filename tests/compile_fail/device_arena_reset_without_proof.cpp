// A reset on another stream than the arena's could run while kernels still allocate from it
// (spec/002's race): it needs proof that the stream runs after them.
// expect: reset\(\) empties the arena on its own stream; on another stream it needs proof
#include <streamalloc/device_arena.hpp>

void use(streamalloc::device_arena& arena, streamalloc::stream_ref b) {
#ifdef STREAMALLOC_EXPECT_FAIL
  arena.reset(b);
#else
  arena.reset();                                              // on its own stream
  arena.reset(b, streamalloc::order_after(b, arena.stream()));  // on b, after it
#endif
}
int main() { return 0; }
