"""Every path the repository cites (`see core/blocks.py`, `docs/index.md`) exists.

Docstrings, comments and the docs name files by their path from the repository root; a module
that moves must take its citations along. Scans the whole text of every .py, .md and .toml file
(a path in code is checked too), outside third_party/, build outputs and hidden folders.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("docs", "core", "router", "backends", "simulation", "loadgen", "urc", "tests", "bench")
# a path from the root: not the tail of a longer path or name (`sgl-router/src/x.py`, `a.router/`)
CITED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})/[\w/.-]*?\w\.(?:py|md))\b")
SKIP = {"third_party", "build", "out"}  # and every hidden folder (.git, .venv*)


def _sources() -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP and not d.startswith((".", "__"))]
        files += [Path(folder, n) for n in names if n.endswith((".py", ".md", ".toml"))]
    return files


def test_cited_paths_exist() -> None:
    missing = [
        f"{path.relative_to(ROOT)}:{n}: {cited}"
        for path in _sources()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        for cited in CITED.findall(line)
        if not (ROOT / cited).is_file()
    ]
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def test_the_scan_sees_citations() -> None:
    """The pattern finds a citation in prose and skips paths that only end like ours."""
    text = "see core/blocks.py, (docs/index.md); sgl-router/src/x.py and a/router/y.py are not"
    assert CITED.findall(text) == ["core/blocks.py", "docs/index.md"]


MODULE_PACKAGES = ("core", "router", "backends", "loadgen", "simulation", "urc")
FOLDER = re.compile(r"^\s*- \*\*([\w/]+/)\*\*", flags=re.MULTILINE)


def _map_bullets() -> dict[str, str]:
    """docs/README.md's "Packages": each folder's bullet (`- **router/gateway/** ...`) -> its
    text, up to the next folder's bullet."""
    text = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Packages\n", 1)[1].split("\n## ", 1)[0]
    starts = list(FOLDER.finditer(section))
    ends = [m.start() for m in starts[1:]] + [len(section)]
    return {m.group(1): section[m.end() : end] for m, end in zip(starts, ends, strict=True)}


def test_the_map_names_every_module() -> None:
    """Each module of the packages (but `__init__.py` and `__main__.py`) is named, as `name.py`,
    in the bullet of its folder in docs/README.md's map: a new module takes its line there."""
    bullets = _map_bullets()
    unnamed = []
    for package in MODULE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name in ("__init__.py", "__main__.py") or "__pycache__" in path.parts:
                continue
            folder = path.parent.relative_to(ROOT).as_posix() + "/"
            if f"`{path.name}`" not in bullets.get(folder, ""):
                unnamed.append(path.relative_to(ROOT).as_posix())
    assert not unnamed, "modules docs/README.md's map does not name:\n" + "\n".join(unnamed)
