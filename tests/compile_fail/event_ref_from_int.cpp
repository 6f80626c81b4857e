// An integer is not an event.
// expect: use of deleted function .*event_ref::event_ref\(int\)
#include <streamalloc/stream.hpp>

int main() {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::event_ref e(0);
#else
  streamalloc::event_ref e(cudaEvent_t{});
#endif
  return e.get() == nullptr ? 0 : 1;
}
