# Defines streamalloc::cuda: the CUDA runtime and the CCCL headers of the toolkit found by
# find_package(CUDAToolkit). Used by the source tree and by the installed package alike, so both
# compute the paths on the machine that consumes them.
#
# The runtime follows the consuming target's CUDA_RUNTIME_LIBRARY property (Shared, Static or
# None; Static when unset, as nvcc does), so a program never ends up with two runtimes.
# The driver (libcuda) is not linked: streamalloc loads it at run time.

if(TARGET streamalloc::cuda)
  return()
endif()

if(NOT CUDAToolkit_FOUND)
  find_package(CUDAToolkit REQUIRED)
endif()

# CUDA 13 keeps Thrust, CUB and libcu++ under include/cccl; CUDA 12 keeps them in include/.
set(_streamalloc_cccl_dirs "")
foreach(_dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
  if(EXISTS "${_dir}/cccl/cuda/std/version")
    list(APPEND _streamalloc_cccl_dirs "${_dir}/cccl")
  endif()
endforeach()

add_library(streamalloc::cuda INTERFACE IMPORTED GLOBAL)
target_include_directories(streamalloc::cuda SYSTEM INTERFACE
  ${CUDAToolkit_INCLUDE_DIRS} ${_streamalloc_cccl_dirs})
set(_streamalloc_rt "$<LOWER_CASE:$<TARGET_PROPERTY:CUDA_RUNTIME_LIBRARY>>")
target_link_libraries(streamalloc::cuda INTERFACE
  "$<$<STREQUAL:${_streamalloc_rt},shared>:CUDA::cudart>"
  "$<$<NOT:$<OR:$<STREQUAL:${_streamalloc_rt},shared>,$<STREQUAL:${_streamalloc_rt},none>>>:CUDA::cudart_static>"
  ${CMAKE_DL_LIBS})
unset(_streamalloc_rt)
unset(_streamalloc_cccl_dirs)
