"""Which Python the tests run scripts/nixl_pages.py with: this one where nixl is importable,
else NIXL_PYTHON (a venv of its own with `pip install nixl-cu13`); WHY says why neither can,
HERE whether this one can."""
import importlib.util
import os
import subprocess
import sys

MODULES = ("nixl", "nixl_cu13", "nixl_cu12")


def has_nixl(python):
    probe = "import importlib.util as u, sys; sys.exit(not any(u.find_spec(m) for m in %r))"
    try:
        return subprocess.run([python, "-c", probe % (MODULES,)], timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


HERE = any(importlib.util.find_spec(m) for m in MODULES)
NIXL_PYTHON = sys.executable if HERE else os.environ.get("NIXL_PYTHON")
WHY = None if NIXL_PYTHON and has_nixl(NIXL_PYTHON) else (
    f"nixl is not importable by {sys.executable} and NIXL_PYTHON "
    f"{'(' + NIXL_PYTHON + ') has none either' if NIXL_PYTHON else 'is not set'} "
    "(pip install nixl-cu13 in a venv of its own)")
