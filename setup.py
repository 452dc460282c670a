"""The optional compiled steps of the hot path, built where a C compiler and Python's headers are
found; without them the install goes on and the Python paths run instead: numpy for offload_core's
(offload_core/_native.c), ctypes for the cuda backend's driver calls (backends/cuda/_driver.c).
Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

shared = ["offload_core/_arrays.c"]  # compiled into each module
setup(
    ext_modules=[
        Extension(
            "offload_core._native",
            ["offload_core/_native.c", *shared],
            optional=True,
        ),
        Extension(
            "offload_core.backends.cuda._driver",  # the backends/ folder is offload_core.backends (pyproject.toml)
            ["backends/cuda/_driver.c", *shared],
            optional=True,
        ),
    ]
)
