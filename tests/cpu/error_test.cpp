#include <streamalloc/error.hpp>

#include <doctest/doctest.h>

#include <string>
#include <type_traits>

using namespace streamalloc;

namespace {
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("a runtime call's failure is named as the runtime names it") {
  // cudaErrorInvalidDevicePointer (17) has no driver result of that number: the driver's name
  // for 17 would be wrong, so the runtime's name and text are kept.
  const cuda_error e = cuda_error::from_runtime(17, "cudaMemcpyAsync", "cudaErrorInvalidDevicePointer",
                                                "invalid device pointer", "copying 4096 bytes");
  CHECK(e.code() == static_cast<CUresult>(17));
  CHECK(e.call() == "cudaMemcpyAsync");
  CHECK(e.name() == "cudaErrorInvalidDevicePointer");
  CHECK(e.description() == "invalid device pointer");
  CHECK(std::string(e.what()) ==
        "streamalloc: cudaMemcpyAsync failed: cudaErrorInvalidDevicePointer (invalid device pointer): copying 4096 bytes");
}

TEST_CASE("cuda_error carries the result, the call and the context") {
  const cuda_error e(CUDA_ERROR_INVALID_VALUE, "cuMemMap", "mapping 4096 bytes");
  CHECK(e.code() == CUDA_ERROR_INVALID_VALUE);
  CHECK(e.call() == "cuMemMap");
  const std::string what = e.what();
  CHECK(contains(what, "cuMemMap"));
  CHECK(contains(what, "mapping 4096 bytes"));
  CHECK(contains(what, e.name()));
  // The name comes from the driver when there is one, else from streamalloc's fallback.
  CHECK((e.name() == "CUDA_ERROR_INVALID_VALUE" || e.name() == "CUresult 1"));
}

TEST_CASE("the exception hierarchy lets callers catch by what went wrong") {
  static_assert(std::is_base_of_v<std::runtime_error, cuda_error>);
  static_assert(std::is_base_of_v<cuda_error, driver_unavailable>);
  static_assert(std::is_base_of_v<cuda_error, not_supported>);

  const not_supported ns("no VMM here");
  CHECK(ns.code() == CUDA_ERROR_NOT_SUPPORTED);
  CHECK(contains(ns.what(), "no VMM here"));

  try {
    throw driver_unavailable(CUDA_ERROR_NO_DEVICE, "driver load", "no driver");
  } catch (const cuda_error& e) {  // caught as its base, with its code intact
    CHECK(e.code() == CUDA_ERROR_NO_DEVICE);
    CHECK(dynamic_cast<const driver_unavailable*>(&e) != nullptr);
  }
}

TEST_CASE("a message without context has no dangling separator") {
  const cuda_error e(CUDA_ERROR_OUT_OF_MEMORY, "cuMemCreate");
  const std::string what = e.what();
  CHECK(what.back() != ' ');
  CHECK(what.back() != ':');
  CHECK(contains(what, "cuMemCreate failed"));
}
