#!/usr/bin/env bash
# Build libfabric and its fabtests into a local prefix, with the real providers.
#
# Debian's libfabric has no efa or verbs provider and cannot register GPU
# memory (FI_HMEM_CUDA fails with -FI_ENOSYS). This build has efa and verbs
# whenever rdma-core's headers are there (so `-p efa` / `-p verbs` run the
# providers' own code, up to "no device" on a machine without the NIC), CUDA
# whenever a CUDA toolkit is, and fabtests (fi_rma_bw, the baselines) always.
#
#   scripts/build_libfabric.sh                 # the source: see below
#   CUDA_HOME=/nonexistent scripts/build_libfabric.sh      # without CUDA
#
# The source: LIBFABRIC_TARBALL if set; else, beside this checkout, the vendored
# ../shared/vendor/libfabric-$LIBFABRIC_VERSION.tar.xz when LIBFABRIC_VERSION is set,
# or the newest vendored release when it is not; else the official release of
# LIBFABRIC_VERSION (default 2.6.0), downloaded. The version said is the one built
# (the source's configure.ac, then the installed fi_info), never a default.
# Other variables: PREFIX (.deps/libfabric in this repo), CUDA_HOME
# (/usr/local/cuda), JOBS (number of cores). 2-5 minutes on 2 cores.
set -euo pipefail
case "${1:-}" in  # what it builds: the variables above, not arguments
    "") ;;
    -h|--help) echo "usage: bash scripts/build_libfabric.sh"
               sed -n '2,/^set -euo/{s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "build_libfabric: no arguments (the variables it reads: --help)" >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "$0")/.." && pwd)
version=${LIBFABRIC_VERSION:-}
prefix=${PREFIX:-$repo/.deps/libfabric}
cuda=${CUDA_HOME:-/usr/local/cuda}
jobs=${JOBS:-$(nproc)}
work=$repo/.deps/build
log=$work/build.log
die() { echo "build_libfabric: $*" >&2; exit 1; }
say() { echo "build_libfabric: $*"; }
quietly() {  # run a build step into the log; on failure show its end
    "$@" >>"$log" 2>&1 || { tail -n 25 "$log" >&2; die "'$*' failed in $PWD (whole log: $log)"; }
}
headers() {  # are these headers on the compiler's include path?
    printf '#include <%s>\n' "$@" | cc -E -x c - >/dev/null 2>&1
}

mkdir -p "$work" && : >"$log"
vendor=$repo/../shared/vendor
if [ -n "$version" ]; then
    vendored=$vendor/libfabric-$version.tar.xz
else  # the newest release there, by version number (2.10 after 2.9)
    vendored=$(printf '%s\n' "$vendor"/libfabric-*.tar.xz | sort -V | tail -n 1)
    version=2.6.0  # to download when nothing is vendored
fi
if [ -n "${LIBFABRIC_TARBALL:-}" ]; then
    tarball=$LIBFABRIC_TARBALL
    [ -f "$tarball" ] || die "LIBFABRIC_TARBALL=$tarball: no such file"
elif [ -n "$vendored" ] && [ -f "$vendored" ]; then
    tarball=$(cd "$(dirname "$vendored")" && pwd)/$(basename "$vendored")
else
    tarball=$work/libfabric-$version.tar.bz2
    url=https://github.com/ofiwg/libfabric/releases/download/v$version/libfabric-$version.tar.bz2
    if [ ! -f "$tarball" ]; then
        say "downloading $url"
        curl -fsSL -o "$tarball.part" "$url" || die "cannot download $url (set LIBFABRIC_TARBALL to a local copy)"
        mv "$tarball.part" "$tarball"
    fi
fi

src=$work/src
rm -rf "$src" && mkdir -p "$src"
tar -xf "$tarball" -C "$src" --strip-components=1 || die "cannot unpack $tarball"
# The version of this source, whatever the tarball is called: AC_INIT([libfabric], [X.Y.Z], ...)
version=$(sed -n 's/^AC_INIT(\[libfabric\], *\[\([^]]*\)\].*/\1/p' "$src/configure.ac")
[ -n "$version" ] || die "$tarball: no libfabric version in its configure.ac"

# What the build needs from the system. A git-tree source (the vendored one)
# has no configure script yet: autogen.sh makes it, with the autotools.
missing=()
command -v cc >/dev/null || missing+=(gcc)
command -v make >/dev/null || missing+=(make)
[ -x "$src/configure" ] || command -v autoreconf >/dev/null || missing+=(autoconf automake)
[ -x "$src/configure" ] || command -v libtoolize >/dev/null || missing+=(libtool)
rdma=(libibverbs-dev librdmacm-dev)   # rdma-core: verbs.h, efadv.h, rdma_cma.h
rdma_headers=(infiniband/verbs.h infiniband/efadv.h rdma/rdma_cma.h)
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    command -v cc >/dev/null && headers "${rdma_headers[@]}" || missing+=("${rdma[@]}")
    if [ ${#missing[@]} -gt 0 ]; then
        say "installing ${missing[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
elif [ ${#missing[@]} -gt 0 ]; then
    die "missing system packages; run: sudo apt-get install -y ${missing[*]} ${rdma[*]}"
fi

if headers "${rdma_headers[@]}"; then
    providers=(--enable-efa --enable-verbs) with="efa, verbs"
else
    providers=(--disable-efa --disable-verbs) with="no efa/verbs"
    say "no rdma-core headers: building without efa and verbs (for them: sudo apt-get install -y ${rdma[*]})"
fi

if [ -f "$cuda/include/cuda_runtime.h" ]; then
    # nvml.h is not part of every CUDA toolkit; the PyPI wheel nvidia-nvml-dev ships it.
    nvml=$work/nvml
    if [ ! -f "$cuda/include/nvml.h" ] && [ -z "$(find "$nvml" -name nvml.h 2>/dev/null)" ]; then
        python3 -m pip download -q --no-deps -d "$nvml" nvidia-nvml-dev || die "cannot fetch nvidia-nvml-dev from PyPI"
        (cd "$nvml" && python3 -m zipfile -e nvidia_nvml_dev-*.whl .)
    fi
    nvml_inc=$(dirname "$(find "$cuda/include" "$nvml" -name nvml.h 2>/dev/null | head -n 1)")
    # With dlopen, libcudart is loaded at run time: the library also works without CUDA.
    cuda_lib=(--with-cuda="$cuda" --enable-cuda-dlopen CPPFLAGS="-I$nvml_inc")
    cuda_tests=(--with-cuda="$cuda" CPPFLAGS="-I$nvml_inc")
    with="$with, CUDA $cuda"
else
    say "no CUDA toolkit at $cuda: building without CUDA (host memory only; set CUDA_HOME for GPU memory)"
    cuda_lib=(--without-cuda) cuda_tests=() with="$with, no CUDA"  # fabtests: any --with*-cuda checks for it
fi

cd "$src"
[ -x configure ] || quietly ./autogen.sh
say "configuring libfabric $version ($with) -> $prefix (log: $log)"
quietly ./configure --prefix="$prefix" "${providers[@]}" "${cuda_lib[@]}" \
    --disable-psm2 --disable-psm3 --disable-usnic --disable-opx --disable-lpp
quietly make -j"$jobs"
quietly make install
cuda_in=$(grep -q '^#define HAVE_CUDA 1' config.h && echo "with CUDA" || echo "without CUDA")

say "building fabtests"
cd fabtests
[ -x configure ] || quietly ./autogen.sh
quietly ./configure --prefix="$prefix" --with-libfabric="$prefix" "${cuda_tests[@]}"
quietly make -j"$jobs"
quietly make install

built=$("$prefix/bin/fi_info" --version | sed -n 's/^libfabric: *//p')  # what was installed
listed=$("$prefix/bin/fi_info" -l | sed -n 's/^\([a-z0-9_]*\):$/\1/p' | grep -v '^ofi_hook\|^off_coll' | tr '\n' ' ')
cat <<DONE
libfabric $built $cuda_in is in $prefix, built in $((SECONDS / 60)) min $((SECONDS % 60)) s.
Its providers (fi_info -l): $listed
fabtests: $prefix/bin/fi_rma_bw
Point the project at it (setup.sh rebuilds the binding against it):
    LIBFABRIC_PREFIX=$prefix bash scripts/setup.sh
DONE
if [ "$cuda_in" = "with CUDA" ]; then
    echo "    export LD_LIBRARY_PATH=$cuda/lib64:\$LD_LIBRARY_PATH    # libcudart, loaded at run time"
fi
