// A mapping has one owner: a copy would unmap the range twice.
// expect: use of deleted function .*mapping::mapping\(const streamalloc::mapping&\)
#include <streamalloc/mapping.hpp>

#include <utility>

int main() {
  streamalloc::mapping a;  // maps nothing: no driver needed
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::mapping b(a);
#else
  streamalloc::mapping b(std::move(a));
#endif
  return b ? 1 : 0;
}
