// The driver layer against the real driver.

#include <streamalloc/driver.hpp>

#include <doctest/doctest.h>

#include "gpu_support.hpp"

#include <cuda_runtime.h>

#include <string>

using namespace streamalloc;

TEST_CASE("the loaded driver agrees with the CUDA runtime") {
  REQUIRE(driver_available());
  int runtime_driver = 0;
  SA_CUDA_REQUIRE(cudaDriverGetVersion(&runtime_driver));
  CHECK(driver_version() == runtime_driver);
  CHECK(driver_version() >= 12000);

  int runtime_devices = 0;
  SA_CUDA_REQUIRE(cudaGetDeviceCount(&runtime_devices));
  CHECK(device_count() == runtime_devices);

  cudaDeviceProp prop{};
  SA_CUDA_REQUIRE(cudaGetDeviceProperties(&prop, 0));
  CHECK(device_name(0) == std::string(prop.name));
  MESSAGE("device 0: " << device_name(0) << ", driver " << driver_version());
}

TEST_CASE("capabilities match the runtime's attributes") {
  const auto caps = query_capabilities(0);
  int major = 0, minor = 0;
  SA_CUDA_REQUIRE(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  SA_CUDA_REQUIRE(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0));
  CHECK(caps.compute_capability == 10 * major + minor);
  // streamalloc needs VMM; every GPU it is tested on has it.
  REQUIRE(caps.virtual_memory);
  CHECK_NOTHROW(require_virtual_memory(0));
  MESSAGE("posix_fd=" << caps.posix_fd_handles << " fabric=" << caps.fabric_handles
                      << " host_numa=" << caps.host_numa_memory << " host=" << caps.host_memory
                      << " numa_id=" << caps.host_numa_id << " rdma=" << caps.gpu_direct_rdma);
}

TEST_CASE("handle-type checks throw exactly when the device lacks the type") {
  const auto caps = query_capabilities(0);
  if (caps.posix_fd_handles) {
    CHECK_NOTHROW(require_handle_types(0, shareable_handle_type::posix_fd));
  } else {
    CHECK_THROWS_AS(require_handle_types(0, shareable_handle_type::posix_fd), not_supported);
  }
  if (caps.fabric_handles) {
    CHECK_NOTHROW(require_handle_types(0, shareable_handle_type::fabric));
  } else {
    CHECK_THROWS_AS(require_handle_types(0, shareable_handle_type::fabric), not_supported);
  }
}

TEST_CASE("a device that does not exist is CUDA_ERROR_INVALID_DEVICE") {
  const int missing = device_count();
  try {
    (void)query_capabilities(missing);
    FAIL("should have thrown");
  } catch (const cuda_error& e) {
    CHECK(e.code() == CUDA_ERROR_INVALID_DEVICE);
    CHECK(std::string(e.what()).find("device " + std::to_string(missing)) != std::string::npos);
  }
}

TEST_CASE("device_memory agrees with cudaMemGetInfo") {
  SA_CUDA_REQUIRE(cudaSetDevice(0));
  std::size_t free = 0, total = 0;
  SA_CUDA_REQUIRE(cudaMemGetInfo(&free, &total));
  const auto info = device_memory(0);
  CHECK(info.total == total);
  // Free memory moves with other processes; within 256 MiB is the same reading.
  const auto diff = info.free > free ? info.free - free : free - info.free;
  CHECK(diff < (256u << 20));
}
