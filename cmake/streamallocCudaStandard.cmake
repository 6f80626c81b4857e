# Compiles this directory's CUDA sources as C++20. CMake before 3.26 does not know nvcc's C++20
# flag (its CUDA compile features stop at cuda_std_17), so there the flag is given directly.
if("cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
else()
  add_compile_options($<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>)
endif()
