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
