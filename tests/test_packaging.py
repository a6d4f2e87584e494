"""Packaging: the wheel built from pyproject.toml carries everything `qps` needs at run
time (the Lua scripts, the workers package, py.typed), its console script, and the one
version of qps/_version.py (`qps --version` prints it); `python -m build` makes an sdist
and a wheel, and that wheel installed in a new venv trains the digits example to its
target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
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


OFFLINE = ("No matching distribution", "Could not find a version", "Network is unreachable",
           "Temporary failure in name resolution")  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_built_wheel_in_a_new_venv_trains_digits(tmp_path: Path) -> None:
    """`python -m build` -> sdist + wheel; a new venv with only that wheel (and its
    dependencies from the index) runs the README's main job to the accuracy target."""
    dist = tmp_path / "dist"
    out = subprocess.run(
        [sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist), str(ROOT)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if out.returncode != 0 and any(t in out.stdout + out.stderr for t in OFFLINE):
        pytest.skip(f"no build backend to be had here: {out.stderr.strip()[-200:]}")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    [wheel] = list(dist.glob(f"qps-{__version__}-*.whl"))
    [sdist] = list(dist.glob(f"qps-{__version__}.tar.gz"))
    with tarfile.open(sdist) as tar:
        members = tar.getnames()
    assert f"qps-{__version__}/pyproject.toml" in members
    assert any(m.endswith("qps/lua/dequeue.lua") for m in members)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if pip.returncode != 0 and any(t in pip.stdout + pip.stderr for t in OFFLINE):
        pytest.skip(f"the dependencies cannot be downloaded here: {pip.stderr.strip()[-200:]}")
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QPS_REDIS_URL")}
    env["OPENBLAS_NUM_THREADS"] = "1"
    run = subprocess.run(
        [str(venv / "bin" / "qps"), "train", "--json", "-q"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["test_value"] >= 0.95, result
    # it ran the installed package, not this checkout
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import qps; print(qps.__file__)"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert where.stdout.startswith(str(venv)), where.stdout
