"""Build hook for the optional native parts; without a C compiler the Python source runs and
gives the same results.

- router/_blockkeys.c: block-key hashing, the C twin of router/blocks.py.
- The modules listed under `[tool.urc] compiled` in pyproject.toml, compiled by mypyc from
  their own source (router/native.py says how they are picked up). URC_PURE_PYTHON=1 at
  install time skips them.
"""

import os
import sys
import tomllib
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).resolve().parent


def compiled_modules() -> list[Extension]:
    if os.environ.get("URC_PURE_PYTHON"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("mypyc is not installed: the Python source runs", file=sys.stderr)
        return []
    config = tomllib.loads((HERE / "pyproject.toml").read_text())
    sources = config["tool"]["urc"]["compiled"]
    try:
        extensions = mypycify(
            [*sources, "--ignore-missing-imports", "--follow-imports=silent"],
            opt_level="3",
            group_name="router._compiled",
        )
    except SystemExit as exc:  # a type error in the listed modules: mypyc refuses them
        print(f"mypyc failed ({exc}): the Python source runs", file=sys.stderr)
        return []
    for ext in extensions:
        ext.optional = True
    return extensions


setup(
    ext_modules=[
        Extension(
            "router._blockkeys",
            sources=["router/_blockkeys.c"],
            include_dirs=["third_party/xxhash"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        *compiled_modules(),
    ]
)
