// A stream is not a proof of ordering: naming the arena's stream orders nothing.
// expect: device_arena::reset: the second argument must prove the ordering
#include <streamalloc/device_arena.hpp>

void use(streamalloc::device_arena& arena, streamalloc::stream_ref b) {
  const streamalloc::stream_ref a = arena.stream();
#ifdef STREAMALLOC_EXPECT_FAIL
  arena.reset(b, a);
#else
  arena.reset(b, a.synchronize());
#endif
}
int main() { return 0; }
