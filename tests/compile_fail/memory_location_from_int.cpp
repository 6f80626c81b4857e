// An integer is not a location: is 0 device 0 or NUMA node 0? Use the named factories.
// expect: conversion from .*int.* to non-scalar type .*streamalloc::memory_location.* requested
#include <streamalloc/memory_location.hpp>

int main() {
#ifdef STREAMALLOC_EXPECT_FAIL
  streamalloc::memory_location where = 0;
#else
  streamalloc::memory_location where = streamalloc::memory_location::device(0);
#endif
  return where.id();
}
