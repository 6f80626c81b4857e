"""Builds a host-only program and a CUDA program against the streamalloc package, twice: through
Conan's CMakeDeps config, and through the package's own CMake config (what find_package users
of an installed streamalloc get). Both must see the same target, streamalloc::streamalloc."""

import os

from conan import ConanFile
from conan.tools.build import can_run
from conan.tools.cmake import CMake, CMakeDeps, CMakeToolchain, cmake_layout


class StreamallocTestConan(ConanFile):
    settings = "os", "arch", "compiler", "build_type"

    def requirements(self):
        self.requires(self.tested_reference_str)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        CMakeDeps(self).generate()
        CMakeToolchain(self).generate()

    def build(self):
        # Through CMakeDeps (the usual Conan way).
        cmake = CMake(self)
        cmake.configure()
        cmake.build()
        # Through the package's own config, in a build folder of its own.
        own = os.path.join(self.build_folder, "own-config")
        config_dir = os.path.join(self.dependencies["streamalloc"].package_folder, "share", "cmake", "streamalloc")
        toolchain = os.path.join(self.generators_folder, "conan_toolchain.cmake")
        cmake_program = self.conf.get("tools.cmake:cmake_program", default="cmake")
        self.run('"%s" -S "%s" -B "%s" -DCMAKE_TOOLCHAIN_FILE="%s" -DCMAKE_BUILD_TYPE=%s -DOWN_CONFIG_DIR="%s"'
                 % (cmake_program, self.source_folder, own, toolchain, self.settings.build_type, config_dir))
        self.run('"%s" --build "%s"' % (cmake_program, own))

    def test(self):
        if not can_run(self):
            return
        for folder in (self.cpp.build.bindirs[0], os.path.join(self.build_folder, "own-config")):
            for program in ("test_host", "test_cuda"):
                self.run(os.path.join(folder, program), env="conanrun")
