"""The optional compiled steps of the hot path, built where a C compiler and Python's headers are
found; without them the install goes on and the Python paths run instead: numpy for offload_core's
(offload_core/_native.c), ctypes for the cuda backend's driver calls (backends/cuda/_driver.c).
Everything else about the package is in pyproject.toml."""

import sys

from setuptools import Extension, setup

threads = [] if sys.platform == "win32" else ["-pthread"]  # _spread.c's; Windows builds go without them
shared = ["offload_core/_arrays.c", "offload_core/_spread.c"]  # compiled into each module
setup(
    ext_modules=[
        Extension(
            "offload_core._native",
            ["offload_core/_native.c", "offload_core/_frozen.c", *shared],
            extra_compile_args=threads,
            extra_link_args=threads,
            optional=True,
        ),
        Extension(
            "offload_core.backends.cuda._driver",  # the backends/ folder is offload_core.backends (pyproject.toml)
            ["backends/cuda/_driver.c", *shared],
            extra_compile_args=threads,
            extra_link_args=threads,
            optional=True,
        ),
    ]
)
