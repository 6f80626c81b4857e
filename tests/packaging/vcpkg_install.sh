#!/usr/bin/env bash
# Installs the vcpkg port (ports/streamalloc, as an overlay port) in classic mode and builds and
# runs a consumer (tests/packaging/vcpkg_consumer: a host-only program and a CUDA program) with
# vcpkg's toolchain file, offline: installed, packages, buildtrees and downloads of its own in the
# work directory, no binary cache, no asset download, no metrics, system tools only.
#   vcpkg_install.sh SOURCE_DIR WORK_DIR CMAKE
# vcpkg: $VCPKG_ROOT (the test sets it from the cache variable STREAMALLOC_VCPKG_ROOT), a clone of
# the vcpkg registry with the vcpkg tool built or bootstrapped in it; where it is not set, exits 77
# (reported as skipped). CMake: the one given (the one that configured the tests), for the port's
# build (first on PATH, which vcpkg searches with VCPKG_FORCE_SYSTEM_BINARIES) and the consumer's.
set -euo pipefail
source_dir=$1
work=$2
cmake=$3

if [ -z "${VCPKG_ROOT:-}" ]; then
  echo "skipped: VCPKG_ROOT is not set. To run this test: clone the vcpkg registry, put the vcpkg"
  echo "tool in it (its bootstrap-vcpkg.sh, or a build of the vcpkg-tool sources as"
  echo "docs/installing.md describes), then run VCPKG_ROOT=/path/to/vcpkg ctest -L vcpkg (or"
  echo "configure with -DSTREAMALLOC_VCPKG_ROOT=/path/to/vcpkg)"
  exit 77
fi
# Asked for: anything missing from it is a mistake to report, not a reason to skip.
vcpkg=$VCPKG_ROOT/vcpkg
toolchain=$VCPKG_ROOT/scripts/buildsystems/vcpkg.cmake
if ! version=$("$vcpkg" version --disable-metrics 2>&1); then
  echo "VCPKG_ROOT=$VCPKG_ROOT: $vcpkg does not run: $version"
  exit 1
fi
version=${version%%$'\n'*}  # the first line
for f in "$toolchain" "$VCPKG_ROOT/ports/vcpkg-cmake/portfile.cmake" \
         "$VCPKG_ROOT/ports/vcpkg-cmake-config/portfile.cmake"; do
  if [ ! -f "$f" ]; then
    echo "VCPKG_ROOT=$VCPKG_ROOT is not a vcpkg registry checkout: no $f"
    exit 1
  fi
done
if ! command -v ninja >/dev/null; then
  echo "vcpkg, with VCPKG_FORCE_SYSTEM_BINARIES=1, builds with the ninja on PATH, and there is none:"
  echo "install it (Debian: apt-get install ninja-build)"
  exit 1
fi
case $(uname -m) in
  x86_64) triplet=x64-linux ;;
  aarch64 | arm64) triplet=arm64-linux ;;
  *) echo "no vcpkg triplet known here for $(uname -m)"; exit 1 ;;
esac
echo "using $version ($vcpkg), registry $VCPKG_ROOT, $("$cmake" --version | head -1) ($cmake), $triplet"

rm -rf "$work" && mkdir -p "$work"
cd "$work"  # no vcpkg.json above it matters: --classic
# Tools from the system (no download of CMake or ninja), the given CMake first; nothing from the
# user's vcpkg settings that could add ports, triplets or caches.
export VCPKG_FORCE_SYSTEM_BINARIES=1
PATH="$(dirname "$cmake"):$PATH"
export PATH
unset VCPKG_OVERLAY_PORTS VCPKG_OVERLAY_TRIPLETS VCPKG_BINARY_SOURCES X_VCPKG_ASSET_SOURCES \
      VCPKG_DOWNLOADS VCPKG_DEFAULT_TRIPLET VCPKG_DEFAULT_HOST_TRIPLET VCPKG_FEATURE_FLAGS
install=("$vcpkg" install streamalloc --classic --vcpkg-root="$VCPKG_ROOT"
         --overlay-ports="$source_dir/ports" --triplet="$triplet" --host-triplet="$triplet"
         --x-install-root="$work/installed" --x-packages-root="$work/packages"
         --x-buildtrees-root="$work/buildtrees" --downloads-root="$work/downloads"
         --binarysource=clear "--x-asset-sources=clear;x-block-origin" --disable-metrics)
echo "${install[*]}"
"${install[@]}"

configure=("$cmake" -S "$source_dir/tests/packaging/vcpkg_consumer" -B "$work/consumer"
           -DCMAKE_BUILD_TYPE=Release "-DCMAKE_TOOLCHAIN_FILE=$toolchain"
           "-DVCPKG_TARGET_TRIPLET=$triplet" "-DVCPKG_INSTALLED_DIR=$work/installed"
           -DVCPKG_MANIFEST_MODE=OFF)
echo "${configure[*]}"
"${configure[@]}"
"$cmake" --build "$work/consumer"
for program in test_host test_cuda; do
  echo "$program:"
  "$work/consumer/$program"
done
