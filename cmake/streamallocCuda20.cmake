# Teaches CMake nvcc's flag for C++20, where it does not know it (CMake 3.25 knows CUDA standards
# up to 17 for nvcc, whatever nvcc's version). Without it, a CUDA target that needs C++20 gets
# no flag at all (CMAKE_CUDA_STANDARD 20 is ignored, and the build stops at streamalloc's
# `#error`), or, when a standard is required (CMAKE_CXX_STANDARD_REQUIRED or
# CMAKE_CUDA_STANDARD_REQUIRED, as Conan's toolchain sets), configure stops with "CMake does not
# know the flags to enable CUDA20". With it, streamalloc's `cxx_std_20` requirement gives CUDA
# sources `-std=c++20` too. A CMake that knows the flag keeps its own: these are set only where
# none is. A macro, so that the variables land in the scope of whoever includes it: they are
# read in the directory that defines each CUDA target.
macro(streamalloc_know_cuda20)
  if(NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  endif()
  if(NOT DEFINED CMAKE_CUDA20_EXTENSION_COMPILE_OPTION)
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
endmacro()
