# Finds doctest for the tests and defines streamalloc_doctest. In order: an installed doctest
# package (Debian's doctest-dev), a doctest.h under STREAMALLOC_DOCTEST_DIR or the usual include
# paths, and last FetchContent from GitHub (for machines with network and nothing installed).

if(TARGET streamalloc_doctest)
  return()
endif()

add_library(streamalloc_doctest INTERFACE)
find_package(doctest CONFIG QUIET)
if(TARGET doctest::doctest)
  target_link_libraries(streamalloc_doctest INTERFACE doctest::doctest)
  return()
endif()

set(STREAMALLOC_DOCTEST_DIR "" CACHE PATH "A directory holding doctest/doctest.h")
find_path(STREAMALLOC_DOCTEST_INCLUDE doctest/doctest.h HINTS ${STREAMALLOC_DOCTEST_DIR})
if(STREAMALLOC_DOCTEST_INCLUDE)
  target_include_directories(streamalloc_doctest SYSTEM INTERFACE ${STREAMALLOC_DOCTEST_INCLUDE})
  return()
endif()

message(STATUS "doctest not found here; fetching it (apt-get install doctest-dev avoids this)")
include(FetchContent)
FetchContent_Declare(doctest
  GIT_REPOSITORY https://github.com/doctest/doctest.git
  GIT_TAG v2.4.11
  GIT_SHALLOW TRUE)
FetchContent_MakeAvailable(doctest)
target_link_libraries(streamalloc_doctest INTERFACE doctest::doctest)
