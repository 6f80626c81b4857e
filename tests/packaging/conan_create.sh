#!/usr/bin/env bash
# Builds the Conan package from a copy of the source tree and runs its test_package (a host-only
# program and a CUDA program, through CMakeDeps and through the package's own config), offline:
# a Conan home of its own in the build tree, no remote.
#   conan_create.sh SOURCE_DIR WORK_DIR CMAKE
# Conan: $STREAMALLOC_CONAN (the test sets it from the cache variable of that name), else `conan`
# on PATH; where there is none, or it is not Conan 2, exits 77 (reported as skipped). CMake: the
# one given (the one that configured the tests), for the recipe's build and the test package's.
set -euo pipefail
source_dir=$1
work=$2
cmake=$3

install_hint="python3 -m venv venv && venv/bin/pip install 'conan>=2,<3', then configure with
-DSTREAMALLOC_CONAN=\$PWD/venv/bin/conan (or set STREAMALLOC_CONAN, or put conan on PATH)"
if [ -n "${STREAMALLOC_CONAN:-}" ]; then
  conan=$STREAMALLOC_CONAN
  # Asked for by name: a wrong path is a mistake to report, not a reason to skip.
  if ! version=$("$conan" --version 2>&1); then
    echo "STREAMALLOC_CONAN=$conan does not run: $version"
    exit 1
  fi
else
  conan=$(command -v conan || true)
  if [ -z "$conan" ]; then
    echo "skipped: Conan 2 not found. To run this test: $install_hint"
    exit 77
  fi
  version=$("$conan" --version 2>&1 || true)
fi
if ! grep -q "version 2\." <<<"$version"; then
  echo "skipped: $conan is not Conan 2 ($version). To run this test: $install_hint"
  exit 77
fi
echo "using $version ($conan), $("$cmake" --version | head -1) ($cmake)"

# A copy, so that the test package's build stays out of the source tree.
rm -rf "$work" && mkdir -p "$work/src"
for f in conanfile.py CMakeLists.txt LICENSE include cmake test_package; do
  if [ -e "$source_dir/$f" ]; then cp -r "$source_dir/$f" "$work/src/"; fi  # LICENSE may be absent
done
rm -rf "$work/src/test_package/build" "$work/src/test_package/CMakeUserPresets.json"

export CONAN_HOME=$work/conan-home
"$conan" profile detect --exist-ok
create=("$conan" create "$work/src" -s compiler.cppstd=20 --build=missing --no-remote
        -c tools.cmake:cmake_program="$cmake")
# Conan's toolchain requires the profile's C++ standard before project(), which applies it to
# CUDA too; CMake before 3.26 knows no nvcc flag for C++20 and stops in project(... CUDA). A
# consumer on such a CMake tells it the flag in its profile, as docs/installing.md says; so
# does this test, which then covers the oldest CMake the project supports.
if [ "$(printf '%s\n3.26\n' "$("$cmake" --version | head -1 | sed 's/[^0-9.]//g')" | sort -V | head -1)" != 3.26 ]; then
  printf 'set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")\nset(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")\n' \
    >"$work/cuda20.cmake"
  create+=(-c tools.cmake.cmaketoolchain:user_toolchain+="$work/cuda20.cmake")
fi
echo "${create[*]}"
"${create[@]}"
