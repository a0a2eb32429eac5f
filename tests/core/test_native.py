"""The modules mypyc compiles (core/native.py): built and current, switched off by
URC_PURE_PYTHON=1, and giving byte for byte the replay that their Python source gives."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from core import native
from tests.simulation.test_simulation_cli import synthetic_trace

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, pure: bool | str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "URC_PURE_PYTHON"}
    if pure:
        env["URC_PURE_PYTHON"] = "1" if pure is True else pure
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_listed_module_is_compiled_and_current():
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["urc"]["compiled"]
    names = {".".join(Path(p).with_suffix("").parts) for p in listed}
    built = native.extensions()
    assert names <= set(built), f"not compiled: {sorted(names - set(built))} (`pip install -e .`)"
    assert not native.stale(), "compiled modules older than their source: `pip install -e .`"
    assert native.compiled()


def test_pure_python_imports_the_source():
    code = "import simulation.replay as r, router.index as i; print(r.__file__, i.__file__)"
    assert all(f.endswith(".py") for f in _python(code, pure=True).split())
    assert not any(f.endswith(".py") for f in _python(code, pure=False).split())


def test_one_group_from_source():
    """A compiled group measured on its own: its modules' source, the others compiled."""
    code = "import router.gateway.app as a, router.index as i; print(a.__file__, i.__file__)"
    gateway, index = _python(code, pure="router.gateway,core.strict_json").split()
    assert gateway.endswith(".py") and not index.endswith(".py")


def test_compiled_and_source_replays_are_byte_identical(tmp_path: Path):
    trace = synthetic_trace(tmp_path / "trace.jsonl", n=300)
    outputs = []
    for pure in (False, True):
        out = tmp_path / f"{pure}.json"
        code = (
            "from simulation import cli; import sys; sys.exit(cli.main(["
            f"{str(trace)!r}, '--policy', 'all', '--workers', '3', '--capacity-tokens', "
            f"'8192', '--json', {str(out)!r}, '--no-progress']))"
        )
        _python(code, pure)
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
