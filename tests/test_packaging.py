"""Packaging: the wheel built from pyproject.toml carries everything `qps` needs at run
time (the Lua scripts, the workers package, py.typed), its console script, and the one
version of qps/_version.py (`qps --version` prints it)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import qps
from qps._version import __version__

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_wheel_holds_the_scripts_the_workers_and_the_entry_point(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    offline = ("No matching distribution", "Could not find a version", "Network is unreachable")
    if out.returncode != 0 and any(text in out.stderr for text in offline):
        pytest.skip(f"no build backend to be had here: {out.stderr.strip()[-200:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    [wheel] = list(tmp_path.glob("qps-*.whl"))
    assert wheel.name.startswith(f"qps-{__version__}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    lua = {p.name for p in (ROOT / "qps" / "lua").glob("*.lua")}
    assert {f"qps/lua/{n}" for n in lua} <= names
    assert "qps/py.typed" in names
    for module in ("workers/worker.py", "workers/launcher.py", "workers/models/__init__.py",
                   "qps/cli/main.py"):  # fmt: skip
        assert module in names, module
    assert not any(n.startswith("tests/") for n in names)
    meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    entry = zipfile.ZipFile(wheel).read(meta).decode()
    assert "qps = qps.cli.main:main" in entry


def test_qps_version_is_the_package_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "qps.cli.main", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == f"qps {__version__}"
    assert qps.__version__ == __version__
