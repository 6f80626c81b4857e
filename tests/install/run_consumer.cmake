# Builds and runs tests/install/consumer against streamalloc, the way an outside project would:
#   MODE=find_package      install this build tree into a prefix, then find_package(streamalloc)
#   MODE=fetch_content     FetchContent from the local source tree
#   MODE=add_subdirectory  add_subdirectory of the local source tree
# Arguments: SOURCE_DIR, BUILD_DIR, WORK_DIR, GENERATOR, CUDA_ARCHITECTURES, STANDARD (how the
# consumer asks for C++20: consumer/CMakeLists.txt).

foreach(_v SOURCE_DIR BUILD_DIR WORK_DIR GENERATOR MODE STANDARD)
  if(NOT DEFINED ${_v})
    message(FATAL_ERROR "run_consumer.cmake needs -D${_v}=...")
  endif()
endforeach()

set(_work ${WORK_DIR}/${MODE})
file(REMOVE_RECURSE ${_work})
file(MAKE_DIRECTORY ${_work})

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
  message(STATUS "${_out}")
  if(NOT _rc EQUAL 0)
    message(FATAL_ERROR "command failed (${_rc}): ${ARGN}\n${_out}\n${_err}")
  endif()
endfunction()

set(_configure ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install/consumer -B ${_work}/build
    -G "${GENERATOR}" -DCONSUME=${MODE} -DSTANDARD=${STANDARD} -DSTREAMALLOC_SOURCE_DIR=${SOURCE_DIR})
if(CUDA_ARCHITECTURES)
  list(APPEND _configure "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}")
endif()

if(MODE STREQUAL "find_package")
  run(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${_work}/prefix)
  # The package must be self-contained: nothing of the source or build tree is on its paths.
  file(GLOB_RECURSE _config ${_work}/prefix/*/streamallocConfig.cmake)
  if(NOT _config)
    message(FATAL_ERROR "no streamallocConfig.cmake under ${_work}/prefix")
  endif()
  file(GLOB_RECURSE _installed LIST_DIRECTORIES false ${_work}/prefix/*.cmake)
  foreach(_f IN LISTS _installed)
    file(READ ${_f} _text)
    string(FIND "${_text}" "${SOURCE_DIR}" _at)
    if(NOT _at EQUAL -1)
      message(FATAL_ERROR "${_f} refers to the source tree ${SOURCE_DIR}")
    endif()
  endforeach()
  list(APPEND _configure -DCMAKE_PREFIX_PATH=${_work}/prefix)
endif()

run(${_configure})
run(${CMAKE_COMMAND} --build ${_work}/build)
# Both programs must start and answer without a GPU (the driver is loaded at run time).
run(${_work}/build/consumer_cxx)
run(${_work}/build/consumer_cuda)
