// The driver loader and capability queries, one scenario per process (CTest runs this binary
// once per suite, each with its own STREAMALLOC_LIBCUDA and fake-driver settings).

#include <streamalloc/driver.hpp>
#include <streamalloc/mapping.hpp>

#include <doctest/doctest.h>

#include "fake_driver.hpp"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

using namespace streamalloc;
using streamalloc_test::contains;
using streamalloc_test::fake_lookups;

TEST_SUITE("missing") {
  TEST_CASE("without a driver library nothing is available, and every use says why") {
    CHECK_FALSE(driver_available());
    CHECK(contains(driver_problem(), "could not be loaded"));
    CHECK(contains(driver_problem(), "no-such-libcuda.so"));
    try {
      (void)device_count();
      FAIL("device_count should have thrown");
    } catch (const driver_unavailable& e) {
      CHECK(e.code() == CUDA_ERROR_NO_DEVICE);
      CHECK(contains(e.what(), "could not be loaded"));
      CHECK(e.name() == "CUDA_ERROR_NO_DEVICE");  // the fallback name, no driver to ask
    }
    CHECK_THROWS_AS((void)driver_version(), driver_unavailable);
    CHECK_THROWS_AS(address_reservation(1 << 21), driver_unavailable);
  }
  TEST_CASE("the nothrow forms return the reason's code") {
    std::size_t free = 0, total = 0;
    CHECK(detail::cu::cuMemGetInfo_nothrow(&free, &total) == CUDA_ERROR_NO_DEVICE);
  }
}

TEST_SUITE("stub") {
  TEST_CASE("the toolkit's stub library is recognised as no driver") {
    CHECK_FALSE(driver_available());
    CHECK(contains(driver_problem(), "stub"));
    CHECK_THROWS_AS((void)device_count(), driver_unavailable);
  }
}

TEST_SUITE("too_old") {
  TEST_CASE("a driver older than 12.0 is refused with its version in the message") {
    CHECK_FALSE(driver_available());
    CHECK(contains(driver_problem(), "too old"));
    CHECK(contains(driver_problem(), "11.8"));
    try {
      (void)device_count();
      FAIL("device_count should have thrown");
    } catch (const driver_unavailable& e) {
      CHECK(e.code() == CUDA_ERROR_NOT_SUPPORTED);
    }
  }
}

TEST_SUITE("no_device") {
  TEST_CASE("a driver without devices is reported as such") {
    CHECK_FALSE(driver_available());
    CHECK(contains(driver_problem(), "no CUDA device"));
    CHECK_THROWS_AS((void)device_count(), driver_unavailable);
  }
}

TEST_SUITE("missing_symbol") {
  TEST_CASE("a driver lacking one entry point fails only the call that needs it") {
    CHECK(driver_available());
    CHECK(device_count() == 1);
    address_reservation va(8 << 20);
    physical_allocation mem(2 << 20, memory_location::device(0));
    try {
      mapping m(va, 0, mem);
      FAIL("mapping should have thrown");
    } catch (const cuda_error& e) {
      CHECK(e.code() == CUDA_ERROR_NOT_FOUND);
      CHECK(e.call() == "cuMemMap");
    }
  }
}

TEST_SUITE("fake") {
  TEST_CASE("a usable driver answers the queries") {
    REQUIRE(driver_available());
    CHECK(driver_problem().empty());
    CHECK(driver_version() == 13000);
    CHECK(device_count() == 2);
    CHECK(device_name(1) == "Fake GPU 1");
    const auto caps = query_capabilities(1);
    CHECK(caps.virtual_memory);
    CHECK(caps.posix_fd_handles);
    CHECK(caps.compute_capability == 90);
    CHECK_NOTHROW(require_virtual_memory(0));
    CHECK_NOTHROW(require_handle_types(0, shareable_handle_type::posix_fd));
  }

  TEST_CASE("an unknown device is a cuda_error naming the device") {
    try {
      (void)device_name(5);
      FAIL("device_name(5) should have thrown");
    } catch (const cuda_error& e) {
      CHECK(e.code() == CUDA_ERROR_INVALID_DEVICE);
      CHECK(e.call() == "cuDeviceGet");
      CHECK(contains(e.what(), "device 5"));
    }
  }

  TEST_CASE("each entry point is looked up once, however many threads race to use it first") {
    CHECK(fake_lookups("cuMemGetAllocationGranularity") == 0);
    std::atomic<bool> go{false};
    std::atomic<int> ok{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < 16; ++i) {
      threads.emplace_back([&] {
        while (!go.load()) std::this_thread::yield();
        if (allocation_granularity(memory_location::device(0)) == (2u << 20)) ++ok;
      });
    }
    go = true;
    for (auto& t : threads) t.join();
    CHECK(ok == 16);
    CHECK(fake_lookups("cuMemGetAllocationGranularity") == 1);
    CHECK(fake_lookups("cuInit") == 1);
  }

  TEST_CASE("device_memory reports the device's free memory") {
    const auto before = device_memory(0);
    CHECK(before.total == (8ULL << 30));
    physical_allocation mem(64 << 20, memory_location::device(0));
    CHECK(device_memory(0).free == before.free - (64 << 20));
  }
}

TEST_SUITE("no_vmm") {
  TEST_CASE("a device without VMM is named in a not_supported error") {
    CHECK(driver_available());
    CHECK_FALSE(query_capabilities(0).virtual_memory);
    try {
      require_virtual_memory(0);
      FAIL("should have thrown");
    } catch (const not_supported& e) {
      CHECK(e.code() == CUDA_ERROR_NOT_SUPPORTED);
      CHECK(contains(e.what(), "virtual memory management"));
    }
    // The driver's refusal to create memory is explained the same way.
    CHECK_THROWS_AS(physical_allocation(2 << 20, memory_location::device(0)), not_supported);
  }
}
