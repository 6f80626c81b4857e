#include <streamalloc/memory_location.hpp>

#include <doctest/doctest.h>

#include <stdexcept>
#include <type_traits>

using streamalloc::memory_location;

// An integer must not silently become a location.
static_assert(!std::is_constructible_v<memory_location, int>);
static_assert(!std::is_convertible_v<int, memory_location>);
static_assert(std::is_trivially_copyable_v<memory_location>);
static_assert(memory_location::device(3).id() == 3);

TEST_CASE("locations describe themselves to the driver") {
  const auto d = memory_location::device(2);
  CHECK(d.is_device());
  CHECK_FALSE(d.is_host());
  CHECK(d.native().type == CU_MEM_LOCATION_TYPE_DEVICE);
  CHECK(d.native().id == 2);
  CHECK(d.to_string() == "device 2");

  const auto n = memory_location::host_numa(1);
  CHECK(n.is_host());
  CHECK(n.native().type == CU_MEM_LOCATION_TYPE_HOST_NUMA);
  CHECK(n.native().id == 1);
  CHECK(n.to_string() == "host NUMA node 1");

  CHECK(memory_location::host().native().type == CU_MEM_LOCATION_TYPE_HOST);
  CHECK(memory_location::host().to_string() == "host");
}

TEST_CASE("locations compare by kind and id") {
  CHECK(memory_location::device(0) == memory_location::device(0));
  CHECK(memory_location::device(0) != memory_location::device(1));
  CHECK(memory_location::device(0) != memory_location::host_numa(0));
}

TEST_CASE("negative ids are rejected") {
  CHECK_THROWS_AS(memory_location::device(-1), std::invalid_argument);
  CHECK_THROWS_AS(memory_location::host_numa(-1), std::invalid_argument);
}
