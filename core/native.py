"""Which compiled modules run, the extensions or their Python source (docs/compiled.md). Each
package's `__init__` calls `install()` before it imports a compiled module."""

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
_source: tuple[str, ...] | None = None  # the modules (and packages) whose source runs; "": all


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
    """Compiled modules whose source changed after they were built (in a checkout only)."""
    if not (ROOT / "pyproject.toml").exists():
        return []
    return sorted(  # setup.py stamps every extension at the end of a build
        name
        for name, (ext, src) in extensions().items()
        if src.stat().st_mtime > ext.stat().st_mtime
    )


def compiled() -> bool:
    """Whether the compiled modules are the ones imported."""
    return "" not in _source_first() and bool(extensions())


def _source_first() -> tuple[str, ...]:
    global _source
    if _source is None:
        names = tuple(filter(None, os.environ.get("URC_PURE_PYTHON", "").split(",")))
        some = all(name.split(".")[0] in PACKAGES for name in names)  # else "1", "yes": all
        _source = names if some else ("",)
        if "" not in _source and (old := stale()):
            warnings.warn(
                f"compiled modules older than their source ({', '.join(old)}): running the "
                "Python source; `pip install -e .` compiles them again",
                stacklevel=3,
            )
            _source = ("",)
    return _source


class _SourceFirst(importlib.machinery.PathFinder):
    """Finds our modules' .py where an extension module would shadow it."""

    @classmethod
    def find_spec(  # type: ignore[override]
        cls, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".", 1)[0] not in PACKAGES or path is None:
            return None
        if not any(not n or fullname == n or fullname.startswith(n + ".") for n in _source_first()):
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
