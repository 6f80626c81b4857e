# Included by the config Conan's CMakeDeps generates for streamalloc, after its targets: gives
# streamalloc::streamalloc what the package's own config gives it (C++20 for C++ and CUDA
# sources, the toolkit's runtime and CCCL headers), which CMakeDeps cannot express.
include("${CMAKE_CURRENT_LIST_DIR}/streamallocCudaDeps.cmake")
include("${CMAKE_CURRENT_LIST_DIR}/streamallocCuda20.cmake")
streamalloc_know_cuda20()
set_property(TARGET streamalloc::streamalloc APPEND PROPERTY INTERFACE_COMPILE_FEATURES cxx_std_20)
set_property(TARGET streamalloc::streamalloc APPEND PROPERTY INTERFACE_LINK_LIBRARIES streamalloc::cuda)
