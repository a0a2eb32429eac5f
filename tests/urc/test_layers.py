"""The layers (pyproject.toml [tool.importlinter]): the tree keeps them, and an import upwards
breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("core", "router", "backends", "simulation", "loadgen", "urc")
LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [LINT, "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )


def copy_tree(dest: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", dest)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("*.so"))
    return dest


def test_the_tree_keeps_its_layers():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-3000:]


def test_an_import_upwards_breaks_them(tmp_path: Path):
    tree = copy_tree(tmp_path)
    heap = tree / "core" / "heap.py"
    heap.write_text(heap.read_text() + "\nfrom router import index  # noqa: E402, F401\n")
    result = lint(tree)
    assert result.returncode != 0
    assert "core.heap -> router.index" in result.stdout
