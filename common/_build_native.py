"""The C helpers that live next to their chapters (chapters/NN_name.c): one cffi module each.

A chapter's .c file begins with a comment `/* cdef ... */` holding what Python
sees of it (its structs and functions, compiled ahead of the rest), and may
include common/engine/lane.h (the lane its worker drives, whose struct Python fills
in). It is compiled against the same libfabric as common._fabric and shares
its types, so an endpoint or a message built there can be passed here. Both are
compiled with common/fabric/rules.h, so with FABRIC_RULES (efa, efa-direct, verbs) a
worker's calls are checked like Python's.
setup.py builds them all (module common._nativeNN); `.venv/bin/python common/_build_native.py`
builds them in place. The transfer engine's worker (common/transfer/worker.c, the engine
under chapters 18-19, with copier.c, its CUDA IPC route's launches) is built the same
way, inside its package, as common.transfer._native, and so is the MoE host
proxy of chapters 16-17 (common/moe/proxy.c, with the ring entry of common/moe/ring.h
ahead of it), as common.moe._native.
"""
import glob
import importlib.util
import os
import re
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
# common/fabric/_build.py, loaded from its file: importing common.fabric needs the binding built
_spec = importlib.util.spec_from_file_location("fabric_build",
                                               os.path.join(HERE, "fabric", "_build.py"))
_fabric_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fabric_build)
_flags, fabric = _fabric_build._flags, _fabric_build.ffibuilder

CHAPTERS = os.path.join(os.path.dirname(HERE), "chapters")
LANE = os.path.join(HERE, "engine", "lane.h")  # the lane of chapters 11-15, shared by their C files


def cdef_of(path):
    """What the `/* cdef ... */` comment a C file begins with declares."""
    cdef = re.match(r"/\* cdef\n(.*?)\*/", open(path).read(), re.S)
    if not cdef:
        sys.exit(f"{path}: must begin with a /* cdef ... */ comment")
    return cdef[1]


def builder(path, module=None, with_lane=True, header=None, more=()):
    """The cffi builder of one C file: module common._nativeNN for chapters/NN_*.c, or
    `module`. `with_lane`: compile common/engine/lane.h's struct lane ahead of it;
    `header`: a plain C header declared and compiled ahead of it, whole; `more`: C files
    compiled after it, in the same module (each with its own cdef comment)."""
    ahead = (cdef_of(LANE) if with_lane else "") + (open(header).read() if header else "")
    mine = "".join(cdef_of(p) for p in (path, *more))  # lane: 11-15; header: MoE proxy
    ffi = FFI()
    ffi.include(fabric)
    ffi.cdef(re.sub(r"//.*", "", ahead + mine))
    flags = _flags()
    flags["include_dirs"] = flags.get("include_dirs", []) + [HERE]  # engine/, fabric/
    # The declarations are C too: compiled ahead of the files, they are written once.
    # rules.h first: with FABRIC_RULES the workers' calls are checked like Python's.
    sources = "".join(open(p).read() for p in (path, *more))
    ffi.set_source(module or f"common._native{os.path.basename(path)[:2]}",
                   '#include "fabric/rules.h"\n' + ahead + mine + sources, **flags)
    return ffi


SOURCES = sorted(glob.glob(os.path.join(CHAPTERS, "[0-9][0-9]_*.c")))
for _path in SOURCES:  # ch11, ch12, ...: the names setup.py's cffi_modules point at
    globals()["ch" + os.path.basename(_path)[:2]] = builder(_path)
WORKER = os.path.join(HERE, "transfer", "worker.c")
COPIER = os.path.join(HERE, "transfer", "copier.c")  # the CUDA IPC route's launches
transfer = builder(WORKER, "common.transfer._native", with_lane=False,  # setup.py: ...:transfer
                   more=[COPIER])
PROXY = os.path.join(HERE, "moe", "proxy.c")
proxy = builder(PROXY, "common.moe._native", with_lane=False,  # setup.py: ...:proxy
                header=os.path.join(HERE, "moe", "ring.h"))

if __name__ == "__main__":
    for _path in SOURCES:
        globals()["ch" + os.path.basename(_path)[:2]].compile(verbose=True)
    transfer.compile(verbose=True)
    proxy.compile(verbose=True)
