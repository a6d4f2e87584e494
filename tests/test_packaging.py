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

#: Variables a subprocess here must not inherit: they change which Python, which
#: site-packages or which installed distributions it sees. A PYTHONPATH naming a checkout
#: that holds qps.egg-info (an editable install's) makes the new venv's pip take qps for
#: installed already, install no `qps` script and leave the venv running the checkout.
_UNSET = frozenset(
    {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONEXECUTABLE",
     "PYTHONINSPECT", "VIRTUAL_ENV", "__PYVENV_LAUNCHER__", "CONDA_PREFIX"}
)  # fmt: skip
#: The pip settings kept: where packages come from and how to reach it (an offline
#: machine's wheel folder or local index among them). Every other PIP_* variable (target,
#: prefix, user, constraints, ignore-installed, no-deps, require-virtualenv, ...) is dropped.
_PIP_KEPT = frozenset(
    {"PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX",
     "PIP_TRUSTED_HOST", "PIP_CERT", "PIP_CLIENT_CERT", "PIP_PROXY", "PIP_TIMEOUT",
     "PIP_DEFAULT_TIMEOUT", "PIP_RETRIES", "PIP_CONFIG_FILE", "PIP_CACHE_DIR",
     "PIP_NO_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK", "PIP_NO_INPUT", "PIP_PROGRESS_BAR"}
)  # fmt: skip


def _isolated_env(*, path_first: Path | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This process's environment without what would let a subprocess see another Python
    installation than the one it is started with (see _UNSET, _PIP_KEPT); ``path_first``
    goes to the front of PATH (a venv's bin, as activating it would); ``drop``: more to
    unset."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _UNSET and k not in drop and (not k.startswith("PIP_") or k in _PIP_KEPT)
    }
    if path_first is not None:
        env["PATH"] = os.pathsep.join([str(path_first), env.get("PATH", os.defpath)])
    return env


def test_the_subprocess_environment_is_isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    unsafe = ["PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "QPS_REDIS_URL"]
    unsafe += ["PIP_TARGET", "PIP_PREFIX", "PIP_USER", "PIP_IGNORE_INSTALLED", "PIP_NO_DEPS"]
    for name in unsafe:
        monkeypatch.setenv(name, str(ROOT))
    monkeypatch.setenv("PIP_FIND_LINKS", "/wheels")
    monkeypatch.setenv("PIP_INDEX_URL", "https://index.example/simple")
    monkeypatch.setenv("PATH", "/usr/bin")
    env = _isolated_env(path_first=Path("/venv/bin"), drop=("QPS_REDIS_URL",))
    assert [name for name in unsafe if name in env] == []
    assert env["PIP_FIND_LINKS"] == "/wheels"
    assert env["PIP_INDEX_URL"] == "https://index.example/simple"
    assert env["PATH"] == os.pathsep.join(["/venv/bin", "/usr/bin"])
    # a real subprocess started with it has no checkout on sys.path from the environment
    script = "import os, sys; print(os.environ.get('PYTHONPATH')); print(str(sys.path))"
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True, text=True, timeout=60, env=_isolated_env(), cwd=ROOT.parent,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    pythonpath, sys_path = out.stdout.splitlines()
    assert pythonpath == "None" and repr(str(ROOT)) not in sys_path, out.stdout


@pytest.mark.slow
def test_the_wheel_holds_the_scripts_the_workers_and_the_entry_point(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300, env=_isolated_env(), cwd=tmp_path,
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
    # the checkout's qps (as this process imports it): `-m` looks in the cwd first
    out = subprocess.run(
        [sys.executable, "-m", "qps.cli.main", "--version"],
        capture_output=True, text=True, timeout=120, env=_isolated_env(), cwd=ROOT,
    )  # fmt: skip
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
        capture_output=True, text=True, timeout=600, env=_isolated_env(), cwd=tmp_path,
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
    subprocess.run(
        [sys.executable, "-m", "venv", str(venv)],
        check=True, timeout=120, env=_isolated_env(), cwd=tmp_path,
    )  # fmt: skip
    venv_env = _isolated_env(path_first=venv / "bin", drop=("QPS_REDIS_URL",))
    venv_env["OPENBLAS_NUM_THREADS"] = "1"
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", str(wheel)],
        capture_output=True, text=True, timeout=600, env=venv_env, cwd=tmp_path,
    )  # fmt: skip
    if pip.returncode != 0 and any(t in pip.stdout + pip.stderr for t in OFFLINE):
        pytest.skip(f"the dependencies cannot be downloaded here: {pip.stderr.strip()[-200:]}")
    assert pip.returncode == 0, pip.stderr[-3000:]
    # pip installed the wheel (it did not take qps for installed already)
    assert (venv / "bin" / "qps").is_file(), (pip.stdout + pip.stderr)[-3000:]
    run = subprocess.run(
        [str(venv / "bin" / "qps"), "train", "--json", "-q"],
        capture_output=True, text=True, timeout=600, env=venv_env, cwd=tmp_path,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["test_value"] >= 0.95, result
    # it ran the installed package, not this checkout
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import qps; print(qps.__file__)"],
        capture_output=True, text=True, timeout=60, env=venv_env, cwd=tmp_path,
    )  # fmt: skip
    assert where.stdout.startswith(str(venv)), where.stdout
