"""`qps --log-json`: one JSON object per log line, secrets scrubbed."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from qps.cli import JsonFormatter, remember_url


def test_json_lines_carry_the_record_and_hide_passwords() -> None:
    remember_url("redis://alice:s3cret@db:6379/0")
    record = logging.LogRecord(
        "qps.worker",
        logging.INFO,
        __file__,
        1,
        "worker0: step %d via %s",
        (7, "redis://alice:s3cret@db:6379/0"),
        None,
    )
    data = json.loads(JsonFormatter().format(record))
    assert data["level"] == "INFO" and data["logger"] == "qps.worker"
    assert data["message"] == "worker0: step 7 via redis://alice:***@db:6379/0"
    assert "s3cret" not in json.dumps(data) and isinstance(data["time"], float)


def test_a_role_logs_json_lines(redis_url: str, tmp_path) -> None:
    import numpy as np

    np.savez(tmp_path / "d.npz", x=np.zeros((4, 2), np.float32), y=np.arange(4))
    out = subprocess.run(
        [sys.executable, "-m", "qps.cli.main", "--log-json", "--log-level", "INFO", "feed",
         "--data", str(tmp_path / "d.npz"), "--queue", "logtest", "--url", redis_url,
         "--container", "logjson"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    records = [json.loads(ln) for ln in out.stderr.splitlines() if ln.startswith("{")]
    assert records, out.stderr
    assert all(r["logger"].startswith("qps") and r["level"] for r in records)
    assert any("epoch" in r["message"] for r in records), records
