// Host code cannot read device memory; copy it to the host on the buffer's stream.
// expect: host code cannot access device memory
#include <streamalloc/stream_buffer.hpp>

#include <vector>

int first(streamalloc::stream_buffer<int>& buf) {
#ifdef STREAMALLOC_EXPECT_FAIL
  return buf[0];
#else
  std::vector<int> h(1);
  buf.copy_to(h);
  buf.stream().synchronize();
  return h[0];
#endif
}
int main() { return 0; }
