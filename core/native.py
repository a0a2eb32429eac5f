"""The compiled modules: which run, and the way back to their Python source.

`pip install -e .` compiles the modules listed under `[tool.urc] compiled` in pyproject.toml
with mypyc (setup.py): the same source, as C extensions next to it, which Python imports in
place of the .py. They are the replay's hot path (the unified index, the engine model, the
policies, the event loop), which the gateway shares, and the gateway's request path (its HTTP
server and client, routing, forwarding). Where they are not built (no C compiler) the source
runs, with the same results.

Compiled code checks declared types at run time: an annotation that is wrong (typeshed's
`asyncio.Server.sockets` is a tuple, uvloop's a list) or a duck-typed stand-in passed where a
class is declared raises TypeError where the source would run on. Type such values `Any`.

The source runs instead, for every compiled module at once (calls between them are direct C
calls, so a mix would run stale code):

- when `URC_PURE_PYTHON=1` is set: to debug or profile line by line, or to measure what
  compiling buys (bench/replay_bench.py does, in a child process);
- in a checkout, when any extension is older than its .py (an edit since the last build),
  with a warning once; `pip install -e .` (or `make venv`) compiles them again.

Each package's `__init__` calls `install()` before anything imports a compiled module.

What keeps compiled code fast (each measured with callgrind on the replay):
- classes on the hot path are plain classes, or dataclasses with `init=False` and a written-out
  `__init__`: NamedTuples and generated `__init__`s run Python code on every construction;
- no builtins (`min`, `max`, `sum`, `zip`) or lambdas on a few items in inner loops: plain loops
  and comparisons compile to C, the builtins are calls through the C API;
- heapq over tuples compares tuples through the C API: core/heap.py compares two fields;
- block keys are read as `object`s where they go into dicts (`cast(list[object], keys)`, dicts
  typed `dict[object, ...]`): an `int` read from a list is unboxed, and boxed again for each
  dict operation, a new object when it is below 2**62 (a quarter of 64-bit keys);
- the garbage collector is off while a replay loops (simulation/replay.py): it makes no cycles
  per request, and the passes cost ~3 % and freed nothing.

mypyc compiles neither async generators nor `continue` inside `try ... finally`: the gateway's
modules do without them.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "router", "backends", "simulation")
_decided: bool | None = None  # True: take the source


def extensions() -> dict[str, tuple[Path, Path]]:
    """Module name -> (extension, source) for every built module that has a .py beside it."""
    found: dict[str, tuple[Path, Path]] = {}
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        for package in PACKAGES:
            for ext in (ROOT / package).rglob(f"*{suffix}"):
                source = ext.with_name(ext.name[: -len(suffix)] + ".py")
                if source.exists():
                    name = ".".join(source.relative_to(ROOT).with_suffix("").parts)
                    found[name] = (ext, source)
    return found


def stale() -> list[str]:
    """Compiled modules whose source changed after they were built (in a checkout; an
    installed wheel's files carry no build order)."""
    if not (ROOT / "pyproject.toml").exists():
        return []
    # setup.py stamps every extension at the end of a build (an unchanged rebuild would leave
    # their old times)
    return sorted(
        name
        for name, (ext, src) in extensions().items()
        if src.stat().st_mtime > ext.stat().st_mtime
    )


def compiled() -> bool:
    """Whether the compiled modules are the ones imported."""
    return not _source_first() and bool(extensions())


def _source_first() -> bool:
    global _decided
    if _decided is None:
        _decided = bool(os.environ.get("URC_PURE_PYTHON"))
        if not _decided and (old := stale()):
            warnings.warn(
                f"compiled modules older than their source ({', '.join(old)}): running the "
                "Python source; `pip install -e .` compiles them again",
                stacklevel=3,
            )
            _decided = True
    return _decided


class _SourceFirst(importlib.machinery.PathFinder):
    """Finds our modules' .py where an extension module would shadow it."""

    @classmethod
    def find_spec(  # type: ignore[override]
        cls, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", 1)[0] not in PACKAGES or path is None:
            return None
        for entry in path:
            source = Path(entry) / (fullname.rsplit(".", 1)[-1] + ".py")
            if source.exists():
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def install() -> None:
    """Put the source first on the import path when it should run (module doc)."""
    if _source_first() and not any(f is _SourceFirst for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceFirst)
