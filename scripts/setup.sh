#!/usr/bin/env bash
# Set up this checkout: libfabric, a virtualenv in .venv, the project and its
# compiled libfabric binding. Safe to run again: it only redoes what changed.
#
#   bash scripts/setup.sh
#   LIBFABRIC_PREFIX=.deps/libfabric bash scripts/setup.sh    # another libfabric
#   LIBFABRIC_PREFIX= bash scripts/setup.sh                   # the system's (pkg-config)
#
# Where the AWS EFA installer put its libfabric (/opt/amazon/efa), that one is
# the default: it has the efa provider the system's may lack.
set -euo pipefail
case "${1:-}" in  # which libfabric: LIBFABRIC_PREFIX (above), not an argument
    "") ;;
    -h|--help) echo "usage: bash scripts/setup.sh"
               sed -n '2,/^set -euo/{s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "setup: no arguments (the variables it reads: --help)" >&2; exit 2 ;;
esac
# Absolute, before the cd: the binding finds libfabric at run time under this path.
[ ! -d "${LIBFABRIC_PREFIX:-}" ] || LIBFABRIC_PREFIX=$(cd "$LIBFABRIC_PREFIX" && pwd)
cd "$(dirname "$0")/.."

say() { echo "setup: $*" >&2; }
as_root() {  # install Debian/Ubuntu packages, or say exactly what to run
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing $*"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
    else
        say "missing system packages; run: sudo apt-get install -y $*"
        exit 1
    fi
}

efa_installer=/opt/amazon/efa
if [ -z "${LIBFABRIC_PREFIX+set}" ] && [ -f "$efa_installer/include/rdma/fabric.h" ]; then
    export LIBFABRIC_PREFIX=$efa_installer
    say "using the EFA installer's libfabric in $efa_installer (the system's: LIBFABRIC_PREFIX= bash scripts/setup.sh)"
fi

missing=()
if [ -n "${LIBFABRIC_PREFIX:-}" ]; then
    [ -f "$LIBFABRIC_PREFIX/include/rdma/fabric.h" ] || { say "LIBFABRIC_PREFIX=$LIBFABRIC_PREFIX has no include/rdma/fabric.h"; exit 1; }
elif ! pkg-config --exists libfabric 2>/dev/null; then
    missing+=(libfabric-dev libfabric-bin pkg-config)
fi
command -v cc >/dev/null || missing+=(gcc)
python3 -c 'import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || missing+=(python3-dev)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
[ ${#missing[@]} -eq 0 ] || as_root "${missing[@]}"

[ -x .venv/bin/python ] || python3 -m venv .venv
# Reinstall when the build inputs or the chosen libfabric change (not cffi's own
# output, common/*/_native.c, written there by common/_build_native.py).
want="$(cat pyproject.toml setup.py common/_build_native.py common/fabric/_build.py common/*/*.h common/*/[!_]*.c chapters/*.c 2>/dev/null | sha1sum) ${LIBFABRIC_PREFIX:-pkg-config}"
if [ "$(cat .venv/.installed 2>/dev/null)" != "$want" ]; then
    say "installing the project into .venv (builds the libfabric binding)"
    log=.venv/install.log
    if ! { .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install -e '.[test]'; } >"$log" 2>&1; then
        tail -n 25 "$log" >&2
        say "pip install failed; the whole log is in $log"
        exit 1
    fi
    echo "$want" > .venv/.installed
fi
