"""Build hook for the optional native parts (docs/compiled.md): core/_blockkeys.c,
core/_key_table.c, core/_kv_decode.c, core/_kv_ingest.c and, by mypyc,
the modules under `[tool.urc] compiled`. Without them the Python source runs, with equal results.
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
    sources = tomllib.loads((HERE / "pyproject.toml").read_text())["tool"]["urc"]["compiled"]
    try:
        extensions = mypycify(
            [*sources, "--ignore-missing-imports", "--follow-imports=silent"],
            opt_level="3",
            group_name="core._compiled",
        )
    except SystemExit as exc:  # a type error in the listed modules: mypyc refuses them
        print(f"mypyc failed ({exc}): the Python source runs", file=sys.stderr)
        return []
    for ext in extensions:
        ext.optional = True
    return extensions


def mark_built() -> None:
    """Stamp the built modules with this build's time, by which core/native.py judges staleness
    (an unchanged rebuild would leave their old times)."""
    for package in ("core", "router", "backends", "simulation"):
        for path in (HERE / package).rglob("*.so"):
            source = path.with_name(path.name.split(".", 1)[0] + ".py")
            if "__mypyc" in path.name or source.exists():
                path.touch()


compiled = compiled_modules()
setup(
    ext_modules=[
        Extension(
            "core._blockkeys",
            sources=["core/_blockkeys.c"],
            depends=["core/_msgpack.h", "core/_chain.h"],
            include_dirs=["third_party/xxhash"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "core._kv_decode",
            sources=["core/_kv_decode.c"],
            depends=["core/_msgpack.h", "core/_slots.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "core._kv_ingest",
            sources=["core/_kv_ingest.c"],
            depends=["core/_chain.h", "core/_key_table.h", "core/_slots.h"],
            include_dirs=["third_party/xxhash"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "core._key_table",
            sources=["core/_key_table.c"],
            depends=["core/_key_table.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        *compiled,
    ]
)
if compiled:
    mark_built()
