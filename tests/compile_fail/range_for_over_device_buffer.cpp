// Host code cannot iterate device memory: the message says to copy it to the host first.
// expect: a device buffer cannot be iterated by host code.*copy_to\(host range\)
#include <streamalloc/stream_buffer.hpp>

#include <vector>

float sum(streamalloc::stream_buffer<float>& y) {
  float total = 0;
#ifdef STREAMALLOC_EXPECT_FAIL
  for (float x : y) total += x;
#else
  std::vector<float> host(y.size());
  y.copy_to(host);
  y.stream().synchronize();
  for (float x : host) total += x;
#endif
  return total;
}
int main() { return 0; }
