"""The optional compiled step of the hot path (offload_core/_native.c), built where a C compiler
and Python's headers are found; without them the install goes on and offload_core uses its
numpy path. Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("offload_core._native", ["offload_core/_native.c"], optional=True)])
