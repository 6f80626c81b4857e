// Contexts against the fake driver (two devices): device ordinals streamalloc cannot index are
// bad arguments, and every place that pushes a context for one call leaves the thread's current
// context as it found it, on success and on failure.

#include <streamalloc/detail/driver/context.hpp>
#include <streamalloc/pool.hpp>
#include <streamalloc/stream.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <stdexcept>
#include <string>
#include <type_traits>

using namespace streamalloc;
using streamalloc_test::contains;

namespace {
CUcontext current_context() {
  CUcontext c = nullptr;
  detail::cu::cuCtxGetCurrent(&c);
  return c;
}

// Sets the thread's current context for a test case, and clears it again afterwards, so cases
// do not see each other's.
class current_for_case {
 public:
  explicit current_for_case(CUcontext c) { detail::cu::cuCtxSetCurrent(c); }
  ~current_for_case() { (void)detail::cu::cuCtxSetCurrent_nothrow(nullptr); }
  current_for_case(const current_for_case&) = delete;
  current_for_case& operator=(const current_for_case&) = delete;
};
}  // namespace

// The guard owns one push; copying or moving it would pop twice.
static_assert(!std::is_copy_constructible_v<detail::scoped_context>);
static_assert(!std::is_copy_assignable_v<detail::scoped_context>);
static_assert(!std::is_move_constructible_v<detail::scoped_context>);
static_assert(!std::is_move_assignable_v<detail::scoped_context>);
static_assert(std::is_nothrow_destructible_v<detail::scoped_context>);

TEST_SUITE("context") {
  TEST_CASE("a device ordinal streamalloc cannot index is a bad argument, not a driver error") {
    for (int bad : {-1, -7, detail::max_devices, detail::max_devices + 100}) {
      CAPTURE(bad);
      CHECK_THROWS_WITH_AS((void)detail::primary_context(bad),
                           doctest::Contains(("device ordinal " + std::to_string(bad) + " is out of range").c_str()),
                           std::invalid_argument);
    }
    const int streams_before = streamalloc_test::fake_live().streams;
    CHECK_THROWS_WITH_AS((void)stream(detail::max_devices), doctest::Contains("is out of range"),
                         std::invalid_argument);
    CHECK_THROWS_AS((void)synchronize_device(-1), std::invalid_argument);
    CHECK(streamalloc_test::fake_live().streams == streams_before);
  }

  TEST_CASE("a device the driver does not have is the driver's error, naming the call made") {
    try {
      (void)detail::primary_context(5);  // two fake devices
      FAIL("should have thrown");
    } catch (const cuda_error& e) {
      CHECK(e.code() == CUDA_ERROR_INVALID_DEVICE);
      CHECK(e.call() == "cuDeviceGet");
      CHECK(contains(e.what(), "device ordinal 5"));
    }
  }

  TEST_CASE("scoped_context makes a context current for its scope, then restores the one before") {
    const CUcontext ctx0 = detail::primary_context(0);
    const CUcontext ctx1 = detail::primary_context(1);
    REQUIRE(ctx0 != ctx1);
    current_for_case none(nullptr);
    {
      detail::scoped_context outer(ctx0);
      CHECK(current_context() == ctx0);
      {
        detail::scoped_context inner(ctx1);
        CHECK(current_context() == ctx1);
      }
      CHECK(current_context() == ctx0);
    }
    CHECK(current_context() == nullptr);  // the thread had none, and has none again
    try {
      detail::scoped_context g(ctx1);
      throw std::runtime_error("leaving the scope by an exception");
    } catch (const std::runtime_error&) {
    }
    CHECK(current_context() == nullptr);
  }

  TEST_CASE("each call that pushes a context leaves the caller's current context alone") {
    const CUcontext ctx0 = detail::primary_context(0);
    current_for_case on_device0(ctx0);

    stream s1(1);  // made in device 1's context
    CHECK(current_context() == ctx0);
    CHECK(s1.device() == 1);

    // A raw handle streamalloc has not seen is looked up in its own context.
    CUstream raw = nullptr;
    {
      detail::scoped_context in_device1(detail::primary_context(1));
      REQUIRE(detail::cu::cuStreamCreateWithPriority_nothrow(&raw, 0u, 0) == CUDA_SUCCESS);
    }
    CHECK(current_context() == ctx0);
    CHECK(stream_ref{reinterpret_cast<cudaStream_t>(raw)}.device() == 1);
    CHECK(current_context() == ctx0);

    // Ordering device 1's streams makes an event in device 1's context.
    stream t1(1);
    (void)order_after(t1, s1);
    CHECK(current_context() == ctx0);

    (void)synchronize_device(1);
    CHECK(current_context() == ctx0);

    // A device 1 pool makes its events in the freeing stream's context.
    {
      pool p1(pool_properties{.location = memory_location::device(1)});
      void* x = p1.allocate(1024, s1);
      p1.deallocate(x, s1);
      p1.deallocate(p1.allocate(1024, t1), t1);
      CHECK(current_context() == ctx0);
    }
    CHECK(current_context() == ctx0);
    REQUIRE(detail::cu::cuStreamDestroy_nothrow(raw) == CUDA_SUCCESS);

    // A device the driver refuses is reported before anything is pushed.
    CHECK_THROWS_AS((void)stream(5), cuda_error);
    CHECK_THROWS_AS((void)synchronize_device(5), cuda_error);
    CHECK(current_context() == ctx0);
  }
}
