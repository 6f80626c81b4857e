# Finds NCCL for the programs that show pool memory in collectives (tests/gpu/nccl_test.cu,
# examples/nccl_collectives.cu, bench/multigpu.cu). The library itself never needs NCCL.
#
# Looked for, in order:
#   1. STREAMALLOC_NCCL_ROOT (cache variable or environment), a directory with include/nccl.h;
#   2. the system and the CUDA toolkit's directories (NCCL's packages install there);
#   3. the `nvidia-nccl` wheel of the Python on PATH (the NCCL PyTorch ships with), found by
#      asking that Python where the `nvidia.nccl` package lives.
# Defines the imported target streamalloc_nccl and STREAMALLOC_NCCL_FOUND; where NCCL is not
# found, STREAMALLOC_NCCL_WHY says what was looked for, for the skip messages.

# Included by each directory that needs it (tests, examples, bench): the results of the searches
# are cached, the target is global, and the finding is reported once.
set(STREAMALLOC_NCCL_ROOT "$ENV{STREAMALLOC_NCCL_ROOT}" CACHE PATH "Directory with include/nccl.h and lib/libnccl.so")

set(_nccl_hints "")
if(STREAMALLOC_NCCL_ROOT)
  list(APPEND _nccl_hints ${STREAMALLOC_NCCL_ROOT})
endif()
list(APPEND _nccl_hints ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})

find_program(_nccl_python NAMES python3 python)
if(_nccl_python)
  # nvidia.nccl is a namespace package in some wheel versions (no __file__): use __path__.
  execute_process(
    COMMAND ${_nccl_python} -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
    OUTPUT_VARIABLE _nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _nccl_rc)
  if(_nccl_rc EQUAL 0 AND IS_DIRECTORY "${_nccl_wheel}")
    list(APPEND _nccl_hints ${_nccl_wheel})
  endif()
endif()

find_path(STREAMALLOC_NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS}
          PATH_SUFFIXES include)
# The wheel ships libnccl.so.2 only (no unversioned link).
find_library(STREAMALLOC_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} ${CUDAToolkit_LIBRARY_DIR}
             PATH_SUFFIXES lib lib64)

if(STREAMALLOC_NCCL_INCLUDE_DIR AND STREAMALLOC_NCCL_LIBRARY)
  set(STREAMALLOC_NCCL_FOUND TRUE)
  if(NOT TARGET streamalloc_nccl)
    add_library(streamalloc_nccl UNKNOWN IMPORTED GLOBAL)
    set_target_properties(streamalloc_nccl PROPERTIES IMPORTED_LOCATION ${STREAMALLOC_NCCL_LIBRARY}
                                                      INTERFACE_INCLUDE_DIRECTORIES ${STREAMALLOC_NCCL_INCLUDE_DIR})
  endif()
  file(STRINGS ${STREAMALLOC_NCCL_INCLUDE_DIR}/nccl.h _nccl_version REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE "[^0-9;]" "" _nccl_version "${_nccl_version}")
  string(REPLACE ";" "." _nccl_version "${_nccl_version}")
  set(_nccl_said "NCCL ${_nccl_version}: ${STREAMALLOC_NCCL_LIBRARY}")
else()
  set(STREAMALLOC_NCCL_FOUND FALSE)
  set(STREAMALLOC_NCCL_WHY "NCCL was not found (nccl.h and libnccl in STREAMALLOC_NCCL_ROOT, the system, the CUDA toolkit, or the nvidia-nccl wheel of ${_nccl_python})")
  set(_nccl_said "${STREAMALLOC_NCCL_WHY}: the NCCL test, example and bench are skipped")
endif()
get_property(_nccl_reported GLOBAL PROPERTY STREAMALLOC_NCCL_REPORTED)
if(NOT _nccl_reported)
  message(STATUS "streamalloc: ${_nccl_said}")
  set_property(GLOBAL PROPERTY STREAMALLOC_NCCL_REPORTED TRUE)
endif()
