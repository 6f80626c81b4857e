// Allocating from an arena on another stream needs proof that the stream runs after the kernels
// that allocated from it on its own (spec/002: two streams sharing one arena race).
// expect: an arena moves to another stream only with proof
#include <streamalloc/device_arena.hpp>

void use(streamalloc::device_arena& arena, streamalloc::stream_ref b) {
#ifdef STREAMALLOC_EXPECT_FAIL
  arena.set_stream(b);
#else
  arena.set_stream(b, streamalloc::order_after(b, arena.stream()));
#endif
}
int main() { return 0; }
