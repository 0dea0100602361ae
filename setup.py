# The cffi extensions need a setup.py hook: pyproject.toml has no field for
# cffi_modules. Everything else is in pyproject.toml.
from pathlib import Path

from setuptools import setup

native = [f"common/_build_native.py:ch{p.name[:2]}"
          for p in sorted(Path(__file__).parent.glob("chapters/[0-9][0-9]_*.c"))]
setup(cffi_modules=["common/fabric/_build.py:ffibuilder", *native,
                    "common/_build_native.py:transfer", "common/_build_native.py:proxy"])
