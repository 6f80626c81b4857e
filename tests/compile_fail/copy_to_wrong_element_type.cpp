// Copies move bytes: the host range must hold the buffer's element type, not a convertible one.
// expect: writable host range of the buffer's element type
#include <streamalloc/stream_buffer.hpp>

#include <vector>

void use(const streamalloc::stream_buffer<int>& buf) {
#ifdef STREAMALLOC_EXPECT_FAIL
  std::vector<float> h(buf.size());
#else
  std::vector<int> h(buf.size());
#endif
  buf.copy_to(h);
}
int main() { return 0; }
