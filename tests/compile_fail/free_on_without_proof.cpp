// Freeing on another stream needs proof that the streams that used the buffer run before it.
// expect: freeing on another stream needs proof
#include <streamalloc/stream_buffer.hpp>

#include <utility>

void use(streamalloc::stream_buffer<int> buf, streamalloc::stream_ref b) {
#ifdef STREAMALLOC_EXPECT_FAIL
  std::move(buf).free_on(b);
#else
  std::move(buf).free_on(b, streamalloc::order_after(b, buf.stream()));
#endif
}
int main() { return 0; }
