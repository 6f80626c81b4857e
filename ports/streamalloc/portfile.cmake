# streamalloc, built from the repository this port lives in (ports/streamalloc/ at its root):
# use it as an overlay port, `vcpkg install streamalloc --overlay-ports=<repository>/ports`.
# A header-only package: the headers and the project's own CMake install (its package config),
# nothing compiled. The CUDA toolkit is a system requirement, checked here, never packaged.

get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
set(_version_header "${SOURCE_PATH}/include/streamalloc/version.hpp")
if(NOT EXISTS "${_version_header}")
  message(FATAL_ERROR "This port builds the streamalloc repository it lives in (ports/streamalloc/ "
                      "at its root); ${SOURCE_PATH} is not one: no include/streamalloc/version.hpp.")
endif()

# The version is written twice, here in vcpkg.json and in the header that CMake reads: they
# must agree.
file(STRINGS "${_version_header}" _version_lines REGEX "#define STREAMALLOC_VERSION_(MAJOR|MINOR|PATCH) ")
foreach(_line IN LISTS _version_lines)
  string(REGEX MATCH "STREAMALLOC_VERSION_([A-Z]+) ([0-9]+)" _ "${_line}")
  set(_version_${CMAKE_MATCH_1} "${CMAKE_MATCH_2}")
endforeach()
set(_source_version "${_version_MAJOR}.${_version_MINOR}.${_version_PATCH}")
if(NOT _source_version STREQUAL VERSION)
  message(FATAL_ERROR "ports/streamalloc/vcpkg.json says version ${VERSION} but "
                      "include/streamalloc/version.hpp says ${_source_version}: make them agree.")
endif()

# The CUDA toolkit (cuda.h, the runtime, CCCL), where CMake's FindCUDAToolkit would look:
# CUDAToolkit_ROOT, CUDA_PATH, CUDA_HOME, the nvcc on PATH, /usr/local/cuda.
set(_cuda_roots "$ENV{CUDAToolkit_ROOT}" "$ENV{CUDA_PATH}" "$ENV{CUDA_HOME}")
find_program(_nvcc NAMES nvcc NO_CACHE)
if(_nvcc)
  file(REAL_PATH "${_nvcc}" _nvcc)
  get_filename_component(_nvcc_root "${_nvcc}" DIRECTORY)
  get_filename_component(_nvcc_root "${_nvcc_root}" DIRECTORY)
  list(APPEND _cuda_roots "${_nvcc_root}")
endif()
list(APPEND _cuda_roots "/usr/local/cuda")
set(_cuda_root "")
foreach(_root IN LISTS _cuda_roots)
  if(_root AND EXISTS "${_root}/include/cuda.h")
    set(_cuda_root "${_root}")
    break()
  endif()
endforeach()
if(NOT _cuda_root)
  message(FATAL_ERROR "streamalloc needs the CUDA toolkit 12.0 or newer installed on this system "
                      "(cuda.h and the runtime; this port does not package it), and none was found "
                      "(looked at CUDAToolkit_ROOT, CUDA_PATH, CUDA_HOME, the nvcc on PATH and "
                      "/usr/local/cuda): install it, or point CUDAToolkit_ROOT at it.")
endif()
file(STRINGS "${_cuda_root}/include/cuda.h" _cuda_version REGEX "#define CUDA_VERSION [0-9]+")
string(REGEX MATCH "[0-9]+" _cuda_version "${_cuda_version}")
if(NOT _cuda_version OR _cuda_version LESS 12000)
  message(FATAL_ERROR "streamalloc needs the CUDA toolkit 12.0 or newer; the one at ${_cuda_root} "
                      "is older (CUDA_VERSION ${_cuda_version}).")
endif()
message(STATUS "CUDA toolkit: ${_cuda_root} (CUDA_VERSION ${_cuda_version})")

# Headers only: one configuration is all there is to install, and no binary whose RPATH vcpkg
# would fix up afterwards (that step would fetch patchelf, 0.19 or newer, for the usage file alone).
set(VCPKG_BUILD_TYPE release)
set(VCPKG_FIXUP_ELF_RPATH OFF)

# Only the install rules: nothing of the tests, examples or benches, and no nvcc needed.
vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DSTREAMALLOC_BUILD_TESTS=OFF
    -DSTREAMALLOC_BUILD_EXAMPLES=OFF
    -DSTREAMALLOC_BUILD_BENCH=OFF
    -DSTREAMALLOC_INSTALL=ON
    "-DCUDAToolkit_ROOT=${_cuda_root}"
)
vcpkg_cmake_install()
# The project installs its config in share/cmake/streamalloc; vcpkg wants it in share/streamalloc.
vcpkg_cmake_config_fixup(PACKAGE_NAME streamalloc CONFIG_PATH share/cmake/streamalloc)

file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug")

file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
