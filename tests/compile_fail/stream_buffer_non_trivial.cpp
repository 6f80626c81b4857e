// A buffer's elements are moved with cudaMemcpy: no constructors, no destructors.
// expect: T must be trivially copyable
#include <streamalloc/stream_buffer.hpp>

#include <string>

struct point {
  float x, y;
};
void use(streamalloc::stream_ref s) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::stream_buffer<std::string> b(10, s);
#else
  streamalloc::stream_buffer<point> b(10, s);
#endif
}
int main() { return 0; }
