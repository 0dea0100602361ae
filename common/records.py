"""What every results file carries, with nothing but the standard library: the machine,
the commit, the command line, a label safe as a file name, and the writing itself (whole
or not at all).
common/bench.py builds on it; scripts/atomic_bench.py, which needs no libfabric, uses it
alone.
"""
import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def machine(gpu=None):
    """What the figures were measured on: CPU model and count, GPU name, host."""
    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu_name = None
    if gpu is not None:
        from common.fabric.memory import cupy
        gpu_name = cupy().cuda.runtime.getDeviceProperties(gpu)["name"]
        gpu_name = gpu_name.decode() if isinstance(gpu_name, bytes) else gpu_name
    return {"host": socket.gethostname(), "cpu": cpu, "cores": os.cpu_count(), "gpu": gpu_name}


def git_sha():
    """The commit measured, with "-dirty" when the tree had changes."""
    done = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def arguments(argv=None):
    """The command line as a record keeps it (default: this process's): every absolute
    path by its last part, an output file or an interpreter alike, so that no machine's
    folders end up in results/."""
    return [re.sub(r"(?<![\w.~-])/(?:[^/\s=]+/)+", "", a)
            for a in (sys.argv[1:] if argv is None else argv)]


def options(args):
    """A side's own flags as data, {flag's name: value} (cli.Parser lists them in
    `own_flags`), each path by its last part as arguments() keeps it."""
    def kept(value):
        return arguments([value])[0] if isinstance(value, str) else value
    return {name: kept(getattr(args, name)) for name in getattr(args, "own_flags", ())}


def parse_label(text):
    """A machine name for a results file: letters, digits, '.', '_', '-' (no folders)."""
    if not re.fullmatch(r"[\w.-]+", text) or text.startswith("."):
        raise argparse.ArgumentTypeError(f"a label is a plain name (letters, digits, . _ -), "
                                         f"got '{text}'")
    return text


def write_json(path, data):
    """Write `data` to `path` as indented JSON, through a temporary file, so that a reader
    never finds it half-written; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path
