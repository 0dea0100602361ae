# The cffi extension (common._fabric) needs a setup.py hook: pyproject.toml
# has no field for cffi_modules. Everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["common/_build_fabric.py:ffibuilder"])
