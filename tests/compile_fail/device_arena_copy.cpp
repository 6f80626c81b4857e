// An arena owns its memory: a copy would free it twice, and two copies resetting it on two
// streams would race. Move it, or hand kernels its view.
// expect: use of deleted function .*device_arena::device_arena\(const streamalloc::(ordering_(un)?checked::)?device_arena
#include <streamalloc/device_arena.hpp>

#include <utility>

void use(streamalloc::device_arena& a) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::device_arena b(a);
#else
  streamalloc::device_arena b(std::move(a));
  const streamalloc::device_arena_view v = b.view();  // what kernels take: a trivially copyable view
  (void)v;
#endif
}
int main() { return 0; }
