// Physical memory has one owner: copying a physical_allocation would release it twice.
// expect: use of deleted function .*physical_allocation::physical_allocation\(const streamalloc::physical_allocation&\)
#include <streamalloc/physical_allocation.hpp>

#include <utility>

int main() {
  streamalloc::physical_allocation a;  // empty: no driver needed
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::physical_allocation b = a;
#else
  streamalloc::physical_allocation b = std::move(a);
#endif
  return b ? 1 : 0;
}
