"""compose/: the files are checked here, since no Docker engine runs on our machines
(see compose/README.md): the YAML parses, Redis keeps its data (AOF, noeviction) and
has a healthcheck, every qps service runs a real `qps` command whose options parse,
the worker count adds up, and the images install exactly the package of pyproject.toml."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import Any

import click
import pytest

yaml = pytest.importorskip("yaml")

from qps.cli.main import cli  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # a dependency on Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "compose"


def _defaults(text: str) -> str:
    """Compose's ${VAR:-default} interpolation, with every variable unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(_defaults((COMPOSE / "docker-compose.yml").read_text()))


def _rest(ctx: click.Context) -> list[str]:
    """The arguments a group left for its subcommand (click 8: protected_args + args)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return [*ctx.protected_args, *ctx.args]


def _parse(args: list[str]) -> click.Context:
    """Parse a `qps ...` command line as the CLI would, without running it."""
    assert args[0] == "qps", args
    group: click.Command = cli
    ctx = group.make_context("qps", args[1:])
    rest = _rest(ctx)
    while isinstance(group, click.Group) and rest:
        name, cmd, rest = group.resolve_command(ctx, rest)
        assert cmd is not None and name is not None
        ctx = cmd.make_context(name, rest, parent=ctx)
        group, rest = cmd, _rest(ctx)
    assert rest == [], f"unparsed arguments {rest} in {args}"
    return ctx


def test_redis_keeps_its_data_and_reports_health(compose: dict[str, Any]) -> None:
    redis = compose["services"]["redis"]
    cmd = " ".join(redis["command"])
    assert "--appendonly yes" in cmd and "--maxmemory-policy noeviction" in cmd
    assert redis["healthcheck"]["test"][:2] == ["CMD", "redis-cli"]


def test_every_qps_service_runs_a_real_command(compose: dict[str, Any]) -> None:
    roles = {}
    for name, svc in compose["services"].items():
        if name == "redis":
            continue
        assert svc["image"] == "qps:cpu" and svc["build"]["dockerfile"] == "compose/Dockerfile"
        assert svc["environment"]["QPS_REDIS_URL"].startswith("redis://redis:")
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        ctx = _parse([str(a) for a in svc["command"]])
        roles[name] = ctx
        health = svc.get("healthcheck", {}).get("test")
        if health:
            assert health[0] == "CMD"
            _parse([str(a) for a in health[1:]])
    assert {"ps0", "ps1", "feeder", "chief", "worker"} <= set(roles)
    assert roles["chief"].params["index"] == 0
    assert roles["worker"].params["index"] == -1  # --index auto
    shards = {roles[f"ps{i}"].params["shard"] for i in range(2)}
    assert shards == {0, 1} and roles["ps0"].params["num_shards"] == 2
    workers = compose["services"]["worker"]["deploy"]["replicas"]
    assert roles["chief"].params["num_workers"] == 1 + workers
    assert roles["worker"].params["num_workers"] == 1 + workers
    # the workers read what the feeder writes, once it exists
    queue = roles["feeder"].params["queue"]
    assert roles["chief"].params["data"] == f"queue:{queue}"
    for name in ("chief", "worker"):
        assert compose["services"][name]["depends_on"]["feeder"]["condition"] == "service_healthy"


def test_images_install_the_package_of_pyproject() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    low = tuple(int(x) for x in re.findall(r"\d+", meta["requires-python"])[:2])
    cpu = (COMPOSE / "Dockerfile").read_text()
    gpu = (COMPOSE / "Dockerfile.gpu").read_text()
    py = re.search(r"^FROM python:(\d+)\.(\d+)", cpu, re.M)
    assert py is not None and (int(py[1]), int(py[2])) >= low
    for text in (cpu, gpu):
        assert "COPY pyproject.toml" in text and "COPY qps ./qps" in text
        assert "COPY workers ./workers" in text
    assert re.search(r"RUN pip install \. ", cpu)
    assert 'pip install ".[gpu]"' in gpu and "gpu" in meta["optional-dependencies"]
    assert any(d.startswith("cupy-cuda12x") for d in meta["optional-dependencies"]["gpu"])


def test_the_compose_job_runs_to_its_end_as_processes(redis_url: str) -> None:
    """No Docker engine here: run every qps service of the compose file as a process
    with the compose environment (the Redis URL pointed at a test server, a few epochs)
    and check that the job ends with every role exiting 0, the feeder's healthcheck
    gating the workers as in compose."""
    import os
    import secrets
    import subprocess
    import time

    text = (COMPOSE / "docker-compose.yml").read_text().replace("${QPS_EPOCHS:-60}", "3")
    spec = yaml.safe_load(_defaults(text))
    services = spec["services"]
    env = {
        **os.environ,
        **{k: str(v) for k, v in services["chief"]["environment"].items()},
        "QPS_REDIS_URL": redis_url,
        "QPS_CONTAINER": f"compose-{secrets.token_hex(3)}",
        "PYTHONPATH": str(ROOT),
    }

    def start(name: str, **extra: str) -> subprocess.Popen[bytes]:
        cmd = [str(a) for a in services[name]["command"]]
        return subprocess.Popen(
            [sys.executable, "-m", "qps.cli.main", *cmd[1:]],
            env={**env, **extra},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    procs = {name: start(name) for name in ("ps0", "ps1", "feeder")}
    try:
        health = [str(a) for a in services["feeder"]["healthcheck"]["test"][1:]]
        end = time.monotonic() + 60
        while subprocess.run(  # compose's depends_on: service_healthy
            [sys.executable, "-m", "qps.cli.main", *health[1:]], env=env, capture_output=True
        ).returncode:
            assert time.monotonic() < end, "the feeder never became healthy"
            time.sleep(0.2)
        procs["chief"] = start("chief")
        for k in range(services["worker"]["deploy"]["replicas"]):
            procs[f"worker.{k}"] = start("worker")
        errs = {}
        for name, p in procs.items():
            _, err = p.communicate(timeout=240)
            errs[name] = err.decode()
            assert p.returncode == 0, f"{name}: {errs[name][-2000:]}"
        # the chief reads its input from the queue; it evaluates on --eval-data's split
        assert re.search(r"worker0: test accuracy 0\.\d+", errs["chief"]), errs["chief"][-2000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


# -- the Kubernetes equivalent (compose/k8s) ----------------------------------------------


def _k8s() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((COMPOSE / "k8s" / "qps-digits.yaml").read_text()))


def _expand(args: list[Any], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of command/args from the container's env."""
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], str(a)) for a in args]


def test_kubernetes_manifest_mirrors_the_compose_job(compose: dict[str, Any]) -> None:
    docs = _k8s()
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Service", "redis"), ("StatefulSet", "redis"), ("Job", "qps-ps"),
            ("Job", "qps-feeder"), ("Job", "qps-workers")} <= kinds  # fmt: skip
    redis = next(d for d in docs if d["kind"] == "StatefulSet")
    rargs = " ".join(redis["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--appendonly yes" in rargs and "--maxmemory-policy noeviction" in rargs
    assert redis["spec"]["volumeClaimTemplates"]  # the AOF outlives the pod
    jobs = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Job"}
    roles: dict[str, list[click.Context]] = {}
    for name, job in jobs.items():
        spec = job["spec"]
        pod = spec["template"]["spec"]
        assert pod["restartPolicy"] == "OnFailure"  # a crashed role restarts; exit 0 ends it
        (c,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["QPS_REDIS_URL"] == "redis://redis:6379/0" and env["QPS_CONTAINER"]
        indexed = spec.get("completionMode") == "Indexed"
        if indexed:  # the completion index is the shard or worker index
            (idx,) = [e for e in c["env"] if e["name"] == "INDEX"]
            path = idx["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            assert spec["completions"] == spec["parallelism"]
        n = spec["completions"] if indexed else 1
        roles[name] = [
            _parse(_expand(c.get("command") or c["args"], {**env, "INDEX": str(i)}))
            for i in range(n)
        ]
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in c:
                _parse(c[probe]["exec"]["command"])
    assert sorted(ctx.params["shard"] for ctx in roles["qps-ps"]) == [0, 1]
    assert all(ctx.params["num_shards"] == 2 for ctx in roles["qps-ps"])
    workers = roles["qps-workers"]
    assert sorted(ctx.params["index"] for ctx in workers) == list(range(len(workers)))
    assert all(ctx.params["num_workers"] == len(workers) for ctx in workers)
    (feeder,) = roles["qps-feeder"]
    assert all(ctx.params["data"] == f"queue:{feeder.params['queue']}" for ctx in workers)
    # the same roles and options as the compose file
    svc = compose["services"]
    assert feeder.params == _parse([str(a) for a in svc["feeder"]["command"]]).params | {
        "epochs": feeder.params["epochs"]
    }
    chief = _parse([str(a) for a in svc["chief"]["command"]]).params
    for key in ("num_shards", "data", "steps"):
        assert workers[0].params[key] == chief[key]
    # workers wait for the feeder's queue, as the compose healthcheck makes them
    (init,) = jobs["qps-workers"]["spec"]["template"]["spec"]["initContainers"]
    assert f"qps queue stat {feeder.params['queue']}" in init["command"][-1]
