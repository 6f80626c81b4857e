# Compiles this directory's CUDA sources as C++20 (the tests, examples and benches). Older CMake
# knows nvcc's flag for it once streamallocCuda20.cmake (included by the top level) taught it.
set(CMAKE_CUDA_STANDARD 20)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
