#!/usr/bin/env bash
# Build libfabric (and its fabtests) with CUDA support into a local prefix.
#
# Debian's libfabric cannot register GPU memory (FI_HMEM_CUDA fails with
# -FI_ENOSYS), so chapters 06+ with --gpu need a build of their own.
#
#   scripts/build_libfabric.sh                    # official release tarball
#   LIBFABRIC_TARBALL=path/to/libfabric.tar.xz scripts/build_libfabric.sh
#
# Variables: LIBFABRIC_VERSION (2.1.0), LIBFABRIC_TARBALL (a local source
# tarball instead of the download), PREFIX (.deps/libfabric in this repo),
# CUDA_HOME (/usr/local/cuda), JOBS (number of cores).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
version=${LIBFABRIC_VERSION:-2.1.0}
prefix=${PREFIX:-$repo/.deps/libfabric}
cuda=${CUDA_HOME:-/usr/local/cuda}
jobs=${JOBS:-$(nproc)}
work=$repo/.deps/build
die() { echo "build_libfabric: $*" >&2; exit 1; }

[ -f "$cuda/include/cuda_runtime.h" ] || die "no CUDA toolkit at $cuda (set CUDA_HOME)"
if ! command -v autoreconf >/dev/null || ! command -v libtoolize >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq autoconf automake libtool make
    else
        die "autotools missing: run 'sudo apt-get install autoconf automake libtool make'"
    fi
fi

mkdir -p "$work"
tarball=${LIBFABRIC_TARBALL:-$work/libfabric-$version.tar.bz2}
if [ ! -f "$tarball" ]; then
    url=https://github.com/ofiwg/libfabric/releases/download/v$version/libfabric-$version.tar.bz2
    echo "downloading $url"
    curl -fsSL -o "$tarball.part" "$url" || die "cannot download $url (set LIBFABRIC_TARBALL to a local copy)"
    mv "$tarball.part" "$tarball"
fi

# nvml.h is not part of every CUDA toolkit; the PyPI wheel nvidia-nvml-dev ships it.
nvml=$work/nvml
if [ ! -f "$cuda/include/nvml.h" ] && [ -z "$(find "$nvml" -name nvml.h 2>/dev/null)" ]; then
    python3 -m pip download -q --no-deps -d "$nvml" nvidia-nvml-dev || die "cannot fetch nvidia-nvml-dev from PyPI"
    (cd "$nvml" && python3 -m zipfile -e nvidia_nvml_dev-*.whl .)
fi
nvml_inc=$(dirname "$(find "$cuda/include" "$nvml" -name nvml.h 2>/dev/null | head -n 1)")

src=$work/src
rm -rf "$src" && mkdir -p "$src"
tar -xf "$tarball" -C "$src" --strip-components=1
cd "$src"
[ -x configure ] || ./autogen.sh >/dev/null

echo "configuring libfabric $version (CUDA $cuda) -> $prefix"
./configure -q --prefix="$prefix" --with-cuda="$cuda" --enable-cuda-dlopen \
    --disable-efa --disable-verbs --disable-psm2 --disable-psm3 --disable-usnic \
    --disable-opx --disable-lpp CPPFLAGS="-I$nvml_inc"
make -s -j"$jobs" >/dev/null && make -s install >/dev/null

echo "building fabtests"
cd fabtests
[ -x configure ] || ./autogen.sh >/dev/null
./configure -q --prefix="$prefix" --with-libfabric="$prefix" --with-cuda="$cuda" CPPFLAGS="-I$nvml_inc"
make -s -j"$jobs" >/dev/null && make -s install >/dev/null

cat <<DONE
libfabric $version with CUDA is in $prefix (fabtests: $prefix/bin/fi_rma_bw).
Point the project at it and rebuild the binding:
    export LIBFABRIC_PREFIX=$prefix
    export LD_LIBRARY_PATH=$cuda/lib64:\$LD_LIBRARY_PATH    # libcudart, loaded at run time
    bash scripts/setup.sh
DONE
