"""Training curves and progress: a real `qps train --logdir` run read back and drawn by
`qps plot` (a PNG checked by reading it back); the event-file reader on its own
(restarts, a cut-short record, corruption, missing directories); the progress
reporter's plain lines and its terminal bar; checkpoint progress callbacks against
fakeredis and a real server."""

from __future__ import annotations

import asyncio
import io
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from rich.console import Console

import qps
from qps import checkpoint, curves
from qps.cli.main import cli
from qps.cli.progress import Progress
from qps.errors import DataLossError, NotFoundError

REPO = str(Path(__file__).resolve().parents[1])
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _qps(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("QPS_REDIS_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "qps.cli.main", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="qps train's roles")
def test_train_logdir_then_plot(tmp_path: Path) -> None:
    logdir = tmp_path / "logs"
    run = _qps(
        "train", "--ps", "1", "--workers", "2", "--steps", "120", "--log-every", "20",
        "--logdir", str(logdir), "--container", f"t-{secrets.token_hex(4)}", "--json", "-q",
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)
    assert result["stopped"] == "finished" and result["global_step"] == 240

    # not a terminal: plain progress lines, the last one at the end
    progress = [ln for ln in run.stderr.splitlines() if "worker steps" in ln]
    assert progress and progress[-1].startswith("qps train: 240/240 worker steps (100%)")
    assert "\x1b[" not in run.stderr  # no terminal control codes

    scalars = curves.read_scalars(logdir)
    assert sorted(scalars) == ["worker-0", "worker-1"]
    steps = [20, 40, 60, 80, 100, 120]
    for run_name, series in scalars.items():
        for tag in (curves.LOSS, curves.THROUGHPUT):
            assert [s for s, _ in series[tag]] == steps, (run_name, tag)
        # a staleness point needs gradients of this worker applied since the last one:
        # at the first point the shard may have applied none yet; after that always
        # some, as a shard holds back at most its queue (8) and one group (8) < 20 steps
        stale_steps = [s for s, _ in series[curves.STALENESS]]
        assert steps[1:] == [s for s in stale_steps if s != steps[0]], run_name
        losses = [v for _, v in series[curves.LOSS]]
        assert all(v > 0 for v in losses) and losses[-1] < losses[0]
        assert all(v > 0 for _, v in series[curves.THROUGHPUT])
        assert all(v >= 0 for _, v in series[curves.STALENESS])
    # only the chief evaluates: at every log point and at its end (step 120 again)
    assert curves.ACCURACY not in scalars["worker-1"]
    accuracy = scalars["worker-0"][curves.ACCURACY]
    assert [s for s, _ in accuracy] == steps
    assert all(0 <= v <= 1 for _, v in accuracy) and accuracy[-1][1] >= 0.8

    out = tmp_path / "curves.png"
    drawn = _qps("plot", str(logdir), "-o", str(out), cwd=tmp_path)
    assert drawn.returncode == 0, drawn.stderr
    assert f"wrote {out}: 2 run(s)" in drawn.stdout
    raw = out.read_bytes()
    assert raw[:8] == PNG_SIGNATURE
    from matplotlib import image

    pixels = image.imread(out)
    assert pixels.shape[:2] == (7 * 80, 10 * 80)  # the 10×7 in figure at 80 dpi
    assert float(np.std(pixels[..., :3])) > 0.05  # lines and text, not a blank image

    dumped = _qps("plot", str(logdir), "--json", cwd=tmp_path)
    assert dumped.returncode == 0, dumped.stderr
    got = json.loads(dumped.stdout)
    assert got == {
        r: {t: [[s, v] for s, v in pts] for t, pts in tags.items()}
        for r, tags in scalars.items()
    }


def test_reader_merges_restarts_and_keeps_the_later_value(tmp_path: Path) -> None:
    first = curves.ScalarWriter(curves.run_dir(tmp_path, 3))
    for step in (10, 20, 30):
        first.add(step, {curves.LOSS: step / 8, curves.STALENESS: step / 10})
    first.close()
    # a restarted worker: a second file in the same run, writing step 30 again
    with curves.ScalarWriter(curves.run_dir(tmp_path, 3)) as again:
        again.add(30, {curves.LOSS: 0.5})
        again.add(40, {curves.LOSS: 0.25, "test/auc": 0.75})
    assert len(list(curves.run_dir(tmp_path, 3).iterdir())) == 2
    got = curves.read_scalars(tmp_path)
    assert list(got) == ["worker-3"]
    # (values a float32 holds exactly: the files store float32)
    assert got["worker-3"][curves.LOSS] == [(10, 1.25), (20, 2.5), (30, 0.5), (40, 0.25)]
    assert got["worker-3"][curves.STALENESS] == [(10, 1.0), (20, 2.0), (30, 3.0)]
    assert got["worker-3"][curves.AUC] == [(40, 0.75)]


def _one_file(tmp_path: Path) -> Path:
    with curves.ScalarWriter(tmp_path / "w") as w:
        for step in range(1, 6):
            w.add(step, {curves.LOSS: float(step)})
    (path,) = (tmp_path / "w").iterdir()
    return path


def test_a_cut_short_record_ends_the_file_quietly(tmp_path: Path) -> None:
    path = _one_file(tmp_path)
    whole = [(s, t, v) for _, s, t, v in curves.read_event_file(path)]
    assert whole == [(s, curves.LOSS, float(s)) for s in range(1, 6)]
    path.write_bytes(path.read_bytes()[:-7])  # the last record, half written
    cut = [(s, t, v) for _, s, t, v in curves.read_event_file(path)]
    assert cut == whole[:-1]


def test_a_corrupt_record_is_data_loss(tmp_path: Path) -> None:
    path = _one_file(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-6] ^= 0xFF  # inside the last record's bytes: its checksum no longer matches
    path.write_bytes(bytes(raw))
    with pytest.raises(DataLossError, match="corrupt"):
        curves.read_event_file(path)
    r = CliRunner().invoke(cli, ["plot", str(tmp_path), "-o", str(tmp_path / "x.png")])
    assert r.exit_code == 1 and "corrupt" in r.output
    assert not (tmp_path / "x.png").exists()


def test_missing_or_empty_logdir(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="does not exist"):
        curves.read_scalars(tmp_path / "nowhere")
    (tmp_path / "empty" / "worker-0").mkdir(parents=True)
    with pytest.raises(NotFoundError, match="no TensorBoard event files"):
        curves.read_scalars(tmp_path / "empty")
    for where in ("nowhere", "empty"):
        r = CliRunner().invoke(cli, ["plot", str(tmp_path / where)])
        assert r.exit_code == 3, r.output
        assert r.output.startswith("qps: error: ")


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: Any) -> None:
    with curves.ScalarWriter(curves.run_dir(tmp_path, 0)) as w:
        w.add(1, {curves.LOSS: 1.0})
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    r = CliRunner().invoke(cli, ["plot", str(tmp_path), "-o", str(tmp_path / "c.png")])
    assert r.exit_code == 1
    assert "needs matplotlib" in r.output and "pip install 'qps[plot]'" in r.output


def test_plot_draws_empty_panels_and_auc(tmp_path: Path) -> None:
    scalars: curves.Scalars = {"worker-0": {curves.LOSS: [(1, 2.0), (2, 1.0)]}}
    scalars["worker-0"][curves.AUC] = [(2, 0.7)]
    from qps.cli.plot import draw

    assert draw(scalars, tmp_path / "c.png", "title") == 3
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG_SIGNATURE


# -- progress --------------------------------------------------------------------------


def test_plain_lines_every_step_of_ten_percent() -> None:
    lines: list[str] = []
    with Progress("job", unit="things", live=False, write=lines.append) as p:
        p.line("news")
        for done in range(0, 101, 7):  # 0, 7, ..., 98
            p.update(done, 100, info=f"at {done}")
    # a line when 10%, 20%, ... is passed (at 14, 21, 35, ...), and the end (98)
    marks = [14, 21, 35, 42, 56, 63, 70, 84, 91, 98]
    assert lines == ["news"] + [
        f"job: {d}/100 things ({d}%), at {d}" for d in marks
    ]


def test_plain_end_line_when_the_last_mark_was_not_reached() -> None:
    lines: list[str] = []
    with Progress("save", live=False, write=lines.append, plain_step=25) as p:
        p.update(1, 3)
        p.update(2, 3)
    assert lines == ["save: 1/3 (33%)", "save: 2/3 (67%)"]
    lines.clear()
    with pytest.raises(RuntimeError), Progress("x", live=False, write=lines.append) as p:
        p.update(1, 30)
        raise RuntimeError("no end line after a failure")
    assert lines == []


def test_plain_lines_wait_until_the_work_has_run_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr("qps.cli.progress.time.monotonic", lambda: clock[0])
    lines: list[str] = []
    with Progress("restore", live=False, write=lines.append, quiet_for=2.0) as p:
        p.update(1, 2)
        p.update(2, 2)
    assert lines == []  # done within 2 s: only the command's result is printed
    with Progress("restore", live=False, write=lines.append, quiet_for=2.0) as p:
        p.update(1, 4)  # 25%, within 2 s: no line
        clock[0] += 2.5
        p.update(2, 4)
        p.update(3, 4)
    assert lines == ["restore: 2/4 (50%)", "restore: 3/4 (75%)"]


def test_terminal_bar_with_lines_above_it() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    plain: list[str] = []
    with Progress("qps train", console=console, write=plain.append) as p:
        assert p.live
        p.line("[worker1] before the bar")  # no bar yet: a plain line
        p.update(30, 120, info="global step 30")
        p.line("[worker0] step 30")
        p.update(120, 120, info="global step 120")
    assert plain == ["[worker1] before the bar"]
    text = buf.getvalue()
    assert "\x1b[" in text  # drawn with terminal control codes
    assert "[worker0] step 30" in text  # markup left alone
    assert "120/120" in text and "100%" in text and "global step 120" in text


async def test_checkpoint_progress_callbacks(client: qps.Client, tmp_path: Path) -> None:
    c = f"ckp-{secrets.token_hex(4)}"
    async with qps.Session(client=client, container=c) as s:
        for k in range(3):
            await s.variable(f"v{k}", (4,), np.float32, np.full(4, k, np.float32)).create()
    saved: list[tuple[int, int]] = []
    info = await checkpoint.save(
        client, tmp_path / "ck", container=c, progress=lambda *a: saved.append(a)
    )
    assert info.variables == 3 and saved == [(1, 3), (2, 3), (3, 3)]
    restored: list[tuple[int, int]] = []
    await checkpoint.restore(
        client, tmp_path / "ck", container=c + "-b", progress=lambda *a: restored.append(a)
    )
    assert restored == [(1, 3), (2, 3), (3, 3)]


def test_checkpoint_cli_plain_progress_lines(
    redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = f"ckp-{secrets.token_hex(4)}"
    monkeypatch.setattr("qps.cli.checkpoint.QUIET_SECONDS", 0.0)  # lines from the start

    async def make() -> None:
        async with qps.Session(redis_url, container=c) as s:
            for k in range(4):
                await s.variable(f"v{k}", (2,), np.float32, np.full(2, k, np.float32)).create()

    asyncio.run(make())
    where = ["--url", redis_url, "--container", c]
    r = CliRunner().invoke(cli, ["checkpoint", "save", str(tmp_path / "a"), *where])
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines() == [
        f"qps checkpoint save: {k}/4 variables ({25 * k}%)" for k in (1, 2, 3, 4)
    ]
    r = CliRunner().invoke(cli, ["checkpoint", "save", str(tmp_path / "b"), "--json", *where])
    assert r.exit_code == 0 and r.stderr == ""
    assert json.loads(r.output)["variables"] == 4
    r = CliRunner().invoke(
        cli, ["checkpoint", "restore", str(tmp_path / "a"), "--url", redis_url,
              "--container", c + "-r"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[-1] == "qps checkpoint restore: 4/4 variables (100%)"
