// A const device buffer cannot be iterated by host code either, and gets the same message;
// yet a device buffer is no host range to generic code (std::ranges, std::span): the
// overloads that carry the message do not look like iterators.
// expect: a device buffer cannot be iterated by host code.*copy_to\(host range\)
#include <streamalloc/stream_buffer.hpp>

#include <ranges>
#include <span>
#include <type_traits>

static_assert(!std::ranges::range<streamalloc::stream_buffer<float>&>);
static_assert(!std::ranges::range<const streamalloc::stream_buffer<float>&>);
static_assert(!std::is_constructible_v<std::span<float>, streamalloc::stream_buffer<float>&>);
static_assert(std::ranges::contiguous_range<streamalloc::host_stream_buffer<float>&>);

float sum(const streamalloc::stream_buffer<float>& y) {
  float total = 0;
#ifdef STREAMALLOC_EXPECT_FAIL
  for (float x : y) total += x;
#else
  for (float x : y.to_host()) total += x;
#endif
  return total;
}
int main() { return 0; }
