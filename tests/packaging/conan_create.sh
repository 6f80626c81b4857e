#!/usr/bin/env bash
# Builds the Conan package from a copy of the source tree and runs its test_package (a host-only
# program and a CUDA program, through CMakeDeps and through the package's own config), offline:
# a Conan home of its own, no remote. Exits 77 (skipped) where Conan 2 or CMake 3.26 is missing.
#   conan_create.sh SOURCE_DIR WORK_DIR
# Conan: $STREAMALLOC_CONAN, else `conan` on PATH. CMake: the one beside that conan (a virtual
# environment with both, as .ci/run makes), else `cmake` on PATH.
set -euo pipefail
source_dir=$1
work=$2

conan=${STREAMALLOC_CONAN:-$(command -v conan || true)}
if [ -z "$conan" ] || ! "$conan" --version 2>/dev/null | grep -q "version 2\."; then
  echo "skipped: Conan 2 not found (python3 -m venv v && v/bin/pip install 'conan>=2,<3' 'cmake>=3.26';"
  echo "then STREAMALLOC_CONAN=v/bin/conan)"
  exit 77
fi
cmake=$(dirname "$conan")/cmake
[ -x "$cmake" ] || cmake=$(command -v cmake)
# Conan's toolchain asks for C++20 before project(); CMake 3.25 knows no nvcc flag for it and
# stops there, in any CUDA project (docs/installing.md).
version=$("$cmake" --version | head -1 | sed 's/[^0-9.]//g')
if [ "$(printf '%s\n3.26\n' "$version" | sort -V | head -1)" != "3.26" ]; then
  echo "skipped: a CUDA consumer through Conan needs CMake 3.26 or newer; $cmake is $version"
  exit 77
fi

# A copy, so that the test package's build stays out of the source tree.
rm -rf "$work" && mkdir -p "$work/src"
cp -r "$source_dir"/{conanfile.py,CMakeLists.txt,LICENSE,include,cmake,test_package} "$work/src/"
export CONAN_HOME=$work/conan-home
"$conan" profile detect --exist-ok
"$conan" create "$work/src" -s compiler.cppstd=20 --build=missing --no-remote \
  -c tools.cmake:cmake_program="$cmake"
