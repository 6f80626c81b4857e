#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include <cstddef>
#include <stdexcept>
#include <type_traits>

using streamalloc::stream_ref;

// The handle is cheap to pass around and only made on purpose.
static_assert(std::is_trivially_copyable_v<stream_ref>);
static_assert(std::is_constructible_v<stream_ref, cudaStream_t>);
static_assert(!std::is_convertible_v<cudaStream_t, stream_ref>);  // explicit only
static_assert(!std::is_constructible_v<stream_ref, int>);
static_assert(!std::is_constructible_v<stream_ref, std::nullptr_t>);
static_assert(!std::is_default_constructible_v<stream_ref>);
static_assert(!std::is_convertible_v<stream_ref, cudaStream_t>);  // explicit back, too

TEST_CASE("stream_ref round-trips the handle") {
  auto fake = reinterpret_cast<cudaStream_t>(0x1234);
  const stream_ref s{fake};
  CHECK(s.get() == fake);
  CHECK(static_cast<cudaStream_t>(s) == fake);
  CHECK(s == stream_ref{fake});
  CHECK(s != stream_ref::legacy_default());
}

TEST_CASE("the default streams have names, not numbers") {
  CHECK(stream_ref::legacy_default().get() == cudaStreamLegacy);
  CHECK(stream_ref::per_thread_default().get() == cudaStreamPerThread);
  CHECK(stream_ref::legacy_default() != stream_ref::per_thread_default());
}

// Runs with no driver: a bad ordinal is refused before one would be needed.
TEST_CASE("a device ordinal streamalloc cannot index is a bad argument, found before the driver") {
  CHECK_THROWS_WITH_AS((void)streamalloc::synchronize_device(-2), doctest::Contains("device ordinal -2 is out of range"),
                       std::invalid_argument);
  CHECK_THROWS_WITH_AS((void)streamalloc::synchronize_device(streamalloc::detail::max_devices),
                       doctest::Contains("is out of range"), std::invalid_argument);
  CHECK_THROWS_WITH_AS((void)streamalloc::stream(-5), doctest::Contains("device -5 is not a device ordinal"),
                       std::invalid_argument);
}
