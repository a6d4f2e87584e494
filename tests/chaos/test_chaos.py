"""The CI version of the chaos run (bench/chaos.py, the long runs and their figures in
docs/reliability.md): a PS job of 2 shards and 2 workers pushing known gradients while
shards and workers are SIGKILLed and restarted, a worker is SIGSTOPped, Redis is
restarted (AOF), and every role's connection is cut (reset by the proxy between the
roles and Redis). Every message must be applied exactly once, no process left behind,
no key left after the container reset."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [0, 1])
def test_faults_lose_nothing_and_apply_nothing_twice(seed: int) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "chaos.py"), "--workers", "2", "--steps", "300",
           "--shard-kills", "3", "--worker-kills", "2", "--stops", "1", "--redis-restarts", "1",
           "--cuts", "1", "--blackholes", "0", "--partitions", "0",
           "--stop-seconds", "1", "--seed", str(seed), "--limit", "400", "--json"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=500)
    assert run.stdout.strip(), run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["ok"], result["problems"]
    assert run.returncode == 0
    assert result["faults"] == {"shard-kill": 3, "worker-kill": 2, "stop": 1, "redis-restart": 1,
                                "cut": 1, "blackhole": 0, "partition": 0}  # fmt: skip
    assert result["connections_cut"] > 0
    assert result["lost"] == 0 and result["duplicated"] == 0
    # every logged push, plus those that landed of the ones in flight at a worker's death
    for var in ("w", "v"):
        v = result["variables"][var]
        assert v["version"] == 2 * 300 + v["in_flight_landed"]
    assert result["global_step"] == result["variables"]["w"]["version"]
    # each kill's restarted shard applied again, or (a kill near the end) found nothing left
    assert result["recovery_s"]["count"] + result["shards_idle_after_a_kill"] == 3
    assert result["shards_not_recovered"] == 0
    assert sum(result["restarts"].values()) >= 3 + 2  # the kills at least
