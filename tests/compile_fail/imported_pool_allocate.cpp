// An imported pool cannot allocate: the message says where allocations come from.
// expect: imported_pool cannot allocate: allocate in the exporting process
#include <streamalloc/ipc.hpp>

void use(streamalloc::imported_pool& from, const streamalloc::ipc_descriptor& d) {
#ifdef STREAMALLOC_EXPECT_FAIL
  void* x = from.allocate(256, streamalloc::stream_ref::legacy_default());
  (void)x;
#else
  streamalloc::ipc_handle h = from.import_pointer(d);
  h.release(streamalloc::stream_ref::legacy_default());
#endif
}
int main() { return 0; }
