"""The optional compiled step of the hot path (offload_core/_native.c), built where a C compiler
and Python's headers are found; without them the install goes on and offload_core uses its
numpy path. Everything else about the package is in pyproject.toml."""

import sys

from setuptools import Extension, setup

threads = [] if sys.platform == "win32" else ["-pthread"]  # _spread.c's; Windows builds go without them
setup(
    ext_modules=[
        Extension(
            "offload_core._native",
            [
                "offload_core/_native.c",
                "offload_core/_frozen.c",
                "offload_core/_spread.c",
            ],
            extra_compile_args=threads,
            extra_link_args=threads,
            optional=True,
        )
    ]
)
