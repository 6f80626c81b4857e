"""Conan 2 recipe for streamalloc: a header-only package.

The CUDA toolkit (12.0 or newer: cuda.h, the runtime, CCCL) is a system requirement that the
recipe checks, never packages. Consumers get the target `streamalloc::streamalloc`, the same as
find_package(streamalloc) users, both from Conan's CMakeDeps and from the package's own CMake
config (installed under share/cmake/streamalloc).
"""

import os
import re
import shutil

from conan import ConanFile
from conan.errors import ConanInvalidConfiguration
from conan.tools.build import check_min_cppstd
from conan.tools.cmake import CMake, CMakeToolchain
from conan.tools.files import copy, load


def _cuda_toolkit_include():
    """The include directory of the system's CUDA toolkit, or None."""
    roots = [os.environ.get(v) for v in ("CUDAToolkit_ROOT", "CUDA_PATH", "CUDA_HOME")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append("/usr/local/cuda")
    for root in filter(None, roots):
        include = os.path.join(root, "include")
        if os.path.isfile(os.path.join(include, "cuda.h")):
            return include
    return None


class StreamallocConan(ConanFile):
    name = "streamalloc"
    description = "A stream-ordered CUDA memory allocator built on the virtual memory management API"
    license = "MIT"
    topics = ("cuda", "allocator", "memory-pool", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    exports_sources = "CMakeLists.txt", "LICENSE", "include/*", "cmake/*"
    no_copy_source = True

    def set_version(self):
        text = load(self, os.path.join(self.recipe_folder, "include", "streamalloc", "version.hpp"))
        parts = [re.search(r"#define STREAMALLOC_VERSION_%s (\d+)" % p, text).group(1)
                 for p in ("MAJOR", "MINOR", "PATCH")]
        self.version = ".".join(parts)

    def package_id(self):
        self.info.clear()  # headers alone: one package for every configuration

    def validate(self):
        if self.settings.os != "Linux":
            raise ConanInvalidConfiguration("streamalloc supports Linux only")
        check_min_cppstd(self, 20)  # e.g. -s compiler.cppstd=20
        include = _cuda_toolkit_include()
        if include is None:
            raise ConanInvalidConfiguration(
                "streamalloc needs the CUDA toolkit 12.0 or newer installed on this system (cuda.h and the "
                "runtime; the recipe does not package it): install it, or point CUDAToolkit_ROOT at it")
        version = re.search(r"#define CUDA_VERSION (\d+)", load(self, os.path.join(include, "cuda.h")))
        if version is None or int(version.group(1)) < 12000:
            raise ConanInvalidConfiguration(
                "streamalloc needs the CUDA toolkit 12.0 or newer; the one at %s is older" % include)

    def generate(self):
        # Only the install rules: nothing of the tests, examples or benches, and no nvcc needed.
        tc = CMakeToolchain(self)
        for option in ("TESTS", "EXAMPLES", "BENCH"):
            tc.cache_variables["STREAMALLOC_BUILD_" + option] = "OFF"
        tc.cache_variables["STREAMALLOC_INSTALL"] = "ON"
        tc.generate()

    def build(self):
        CMake(self).configure()

    def package(self):
        CMake(self).install()  # headers, and the package's own config in share/cmake/streamalloc
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))
        copy(self, "streamallocConan.cmake", os.path.join(self.source_folder, "cmake"),
             os.path.join(self.package_folder, "share", "cmake", "streamalloc"))

    def package_info(self):
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        self.cpp_info.set_property("cmake_file_name", "streamalloc")
        self.cpp_info.set_property("cmake_target_name", "streamalloc::streamalloc")
        self.cpp_info.defines = ["LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE"]
        self.cpp_info.system_libs = ["dl"]
        # What CMakeDeps cannot say: C++20 for C++ and CUDA sources, and the toolkit's runtime
        # and CCCL headers, found on the consuming machine (the package's own CMake does it).
        self.cpp_info.set_property("cmake_build_modules",
                                   [os.path.join("share", "cmake", "streamalloc", "streamallocConan.cmake")])
