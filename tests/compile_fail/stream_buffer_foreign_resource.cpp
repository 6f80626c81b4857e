// A buffer grows in place through its pool: a std::pmr resource cannot back it.
// expect: allocate from a streamalloc pool_resource
#include <streamalloc/stream_buffer.hpp>

#include <memory_resource>

void use(streamalloc::pool& pool, streamalloc::stream_ref s) {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::stream_buffer<int> b(10, s, *std::pmr::new_delete_resource());
  (void)pool;
#else
  streamalloc::stream_buffer<int> b(10, s, streamalloc::device_resource(pool));
#endif
}
int main() { return 0; }
