"""``qps server start|stop|status``: a shared embedded server that outlives the command
that started it, found by the other commands through the run directory, and keeping
its data (AOF) across a stop and a start."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from qps import embedded

REPO = str(Path(__file__).resolve().parents[1])


@pytest.fixture
def run_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="qsv", dir="/tmp")
    try:
        yield d
    finally:
        embedded.stop_local_server(d, timeout=5)
        shutil.rmtree(d, ignore_errors=True)


def qps(run_dir: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QPS_RUN_DIR": run_dir, "PYTHONPATH": REPO}
    env.pop("QPS_REDIS_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "qps.cli.main", *args],
        env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_start_status_share_stop(run_dir: str) -> None:
    st = qps(run_dir, "server", "status")
    assert st.returncode == 3 and "not running" in st.stdout

    r = qps(run_dir, "server", "start", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["running"] and info["started"] and info["run_dir"] == run_dir
    pid, url = info["pid"], info["url"]
    assert url == f"unix://{run_dir}/redis.sock"
    assert embedded._ping(f"{run_dir}/redis.sock")  # outlived the command

    again = json.loads(qps(run_dir, "server", "start", "--json").stdout)
    assert not again["started"] and again["pid"] == pid  # one server per run directory

    # another command finds it through the run directory and leaves it running
    made = qps(run_dir, "queue", "ls", "--json")
    assert made.returncode == 0, made.stderr
    assert (embedded.read_state(run_dir) or {}).get("pid") == pid
    assert embedded._ping(f"{run_dir}/redis.sock")

    st = qps(run_dir, "server", "status")
    assert st.returncode == 0 and f"pid {pid}" in st.stdout

    stop = qps(run_dir, "server", "stop", "--json")
    assert stop.returncode == 0 and json.loads(stop.stdout) == {
        "run_dir": run_dir, "stopped": True, "pid": pid,
    }  # fmt: skip
    assert not embedded._pid_alive(pid)
    assert qps(run_dir, "server", "status").returncode == 3
    none = qps(run_dir, "server", "stop")
    assert none.returncode == 0 and "no qps server was running" in none.stdout


def test_data_survives_stop_and_start(run_dir: str) -> None:
    def redis(*cmd: str) -> str:
        r = qps(run_dir, "server", "status", "--json")
        sock = json.loads(r.stdout)["url"].removeprefix("unix://")
        import socket

        with socket.socket(socket.AF_UNIX) as s:
            s.connect(sock)
            parts = [f"*{len(cmd)}\r\n"] + [f"${len(c)}\r\n{c}\r\n" for c in cmd]
            s.sendall("".join(parts).encode())
            return s.recv(1000).decode()

    assert qps(run_dir, "server", "start").returncode == 0
    assert redis("SET", "kept", "yes") == "+OK\r\n"
    assert qps(run_dir, "server", "stop").returncode == 0
    assert qps(run_dir, "server", "start").returncode == 0
    assert redis("GET", "kept") == "$3\r\nyes\r\n"


def test_help_and_bad_run_dir(run_dir: str) -> None:
    h = qps(run_dir, "server", "--help")
    assert h.returncode == 0
    for word in ("start", "stop", "status", "run directory"):
        assert word in h.stdout
    bad = os.path.join(run_dir, "a-file")
    Path(bad).write_text("x")
    r = qps(run_dir, "server", "start", "--run-dir", bad)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_shell_completion_as_documented(run_dir: str) -> None:
    """docs/cli.md: click's completion, through the console script's entry point."""
    env = {**os.environ, "PYTHONPATH": REPO, "_QPS_COMPLETE": "bash_complete",
           "COMP_WORDS": "qps server st", "COMP_CWORD": "2"}  # fmt: skip
    code = "import sys; sys.argv[0] = 'qps'; from qps.cli.main import main; main()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.stdout.split() == ["plain,start", "plain,status", "plain,stop"], r.stderr
    env["_QPS_COMPLETE"] = "bash_source"
    src = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert "_qps_completion()" in src.stdout and "complete " in src.stdout
