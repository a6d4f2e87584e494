"""PS apply throughput: a real PS shard applying Adam to gradients pushed by a worker,
next to a single-process NumPy apply of the same rule, measured in the same invocation.

Each row runs twice per repetition (fresh processes, the server FLUSHALLed before each):

* ``qps`` column: the PS, two processes. The **shard** process configures a one-shard
  job with Adam, creates and places the variable, and runs :meth:`qps.ps.Shard.run`
  (what ``qps ps`` runs). The **pusher** process is a worker (``qps.Session.push``). It
  pushes one warm-up message, which the shard applies (scripts loaded, first apply done).
  Then, by the row's mode:

  - ``prefill`` (the PS apply figure; one process): the shard process also acts as the
    pusher. Its warm-up shard stops; it enqueues ``--count`` messages and marks the job
    finished; then prints READY. At GO it starts a new :class:`~qps.ps.Shard` (lease,
    fencing, loading the state), and the clock starts when that shard's apply loop does
    (:attr:`~qps.ps.Shard.loop_started`): it dequeues, decodes, checks, applies,
    commits and acknowledges every message, and the clock ends when ``run()`` returns
    ``"finished"``, the queue drained. This is the shard's throughput, end to end, with
    the worker's enqueue and the one-off state load outside the clock.
  - ``live`` (two processes): the shard keeps running; after GO a pusher process pushes
    ``--count`` messages one after the other and marks the job finished; the clock
    (from GO) ends when the shard has drained its queue. One worker's sequential pushes
    (each a 16 MiB enqueue) bound this figure, whatever the shard does.

  Nothing polls in the timed region. The shard then checks that it applied exactly
  ``count`` messages (``count + 1`` in ``live`` mode: the warm-up too) and that the
  variable's version is ``count + 1``.
* ``raw`` column: **in process**, one process applies the same rule
  (:class:`qps.optimizers.Adam`, ``apply_dense`` / ``apply_sparse``) to NumPy arrays of
  the same shape, ``--count`` times after one warm-up apply. No Redis.

Rows (``--only`` keys):

* ``dense``: a 16 MiB float32 variable (4 Mi elements), Adam, ``prefill``, the shard's
  default group commit; GiB/s of gradient applied = count x 16 MiB / T. The issue's
  acceptance figure (goal: ratio >= 0.5).
* ``dense-g1``: the same with ``max_group=1``: one commit per message (value and both
  slots, 48 MiB), as before group commits.
* ``dense-live``: the same as ``dense`` with a live pusher (``live``).
* ``lazy``: a 1M x 64 float32 embedding, messages of 4,096 uniform random rows
  (duplicates allowed, as generated), ``Adam(lazy=True)`` (``qps ps -p lazy=true``):
  only the named rows of value, m and v change, and the shard commits just those rows
  (``publish_rows``, once per group for the union of the group's rows); ``prefill``;
  rows/s applied = count x 4,096 / T.
* ``tf1``: the same embedding with TF1's ``Adam()`` (``lazy=False``, the default): every
  message moves all 1M rows of value, m and v (TF1's ``AdamOptimizer`` sparse apply),
  so the shard commits the whole 768 MB state once per group; ``prefill``; rows/s as
  above.

The ratio column is PS / in process.

    python bench/ps_apply.py                       # every row, 3 repetitions
    python bench/ps_apply.py --only dense --reps 5
    python bench/ps_apply.py --only dense --profile /tmp/prof --server-stats
    python bench/ps_apply.py --quick               # smoke test
    QPS_BENCH_PS_OPTIONS='{"commit_interval_ms": 1000}' python bench/ps_apply.py --only dense
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

import harness
import numpy as np

MIB = 1 << 20
GIB = 1 << 30
DENSE_N = 4 * MIB  # float32 elements: 16 MiB
ROWS, WIDTH, BATCH = 1_000_000, 64, 4096
VAR = "w"
POOL = 4  # precomputed gradient messages, cycled
CASES = ("dense", "dense-g1", "dense-live", "lazy", "tf1")


def _dense(case: str) -> bool:
    return case.startswith("dense")


def _live(case: str) -> bool:
    return case.endswith("-live")


def _shard_options(case: str) -> dict[str, Any]:
    """ShardOptions of the row, over those of ``QPS_BENCH_PS_OPTIONS`` (a JSON map, e.g.
    ``{"commit_interval_ms": 1000}``; default: the shard's defaults)."""
    opts = json.loads(os.environ.get("QPS_BENCH_PS_OPTIONS") or "{}")
    if case == "dense-g1":
        opts["max_group"] = 1
    return dict(opts)


def _optimizer(case: str) -> Any:
    from qps.optimizers import Adam

    return Adam(learning_rate=0.001, lazy=case == "lazy")


def _shape(case: str) -> tuple[int, ...]:
    return (DENSE_N,) if _dense(case) else (ROWS, WIDTH)


def _grads(case: str) -> list[Any]:
    rng = np.random.default_rng(7)
    if _dense(case):
        return [
            rng.standard_normal(DENSE_N, dtype=np.float32) * np.float32(1e-2) for _ in range(POOL)
        ]
    return [
        (
            rng.integers(0, ROWS, size=BATCH, dtype=np.int64),
            rng.standard_normal((BATCH, WIDTH), dtype=np.float32) * np.float32(1e-2),
        )
        for _ in range(POOL)
    ]


async def _wait(what: str, cond: Any, timeout: float) -> None:
    """Set-up only (never in the timed region): wait until ``await cond()`` is true."""
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"set-up: {what} did not happen in {timeout} s")
        await asyncio.sleep(0.01)


async def run_shard(args: Any, barrier: harness.Barrier) -> dict[str, Any]:
    import qps
    from qps.ps import Shard, ShardOptions, configure, mark_finished, place_variables

    c = await qps.connect(args.url)
    container = args.name
    opt = _optimizer(args.case)
    await configure(c, container, 1, opt, queue_capacity=256)  # room for a prefill
    await qps.Variable(
        VAR, _shape(args.case), np.float32, "zeros", container=container, client=c
    ).create()
    await place_variables(c, container, [VAR])

    def new_shard() -> Any:
        return Shard(
            c,
            ShardOptions(
                shard=0,
                num_shards=1,
                container=container,
                optimizer=opt,
                **_shard_options(args.case),
            ),
        )

    shard = new_shard()
    task = asyncio.ensure_future(shard.run())
    if not _live(args.case):  # the warm-up message (in live mode: the pusher's)
        async with qps.Session(client=c, container=container, worker="bench") as s:
            await s.push({VAR: _grads(args.case)[0]})

    async def owning() -> bool:
        if task.done():
            task.result()  # raises what stopped it
        return VAR in shard.owned

    await _wait("the shard owning the variable", owning, args.timeout)
    want = args.count + 1  # the warm-up message too
    if not _live(args.case):

        async def warmed_up() -> bool:
            if task.done():
                task.result()
            return shard.applied >= 1

        await _wait("the warm-up message applied", warmed_up, args.timeout)
        shard.request_stop()  # the queue is filled while no shard runs
        reason = await asyncio.wait_for(task, args.timeout)
        if reason != "stopped":
            raise RuntimeError(f"the warm-up shard returned {reason!r}")
        grads = _grads(args.case)
        async with qps.Session(client=c, container=container, worker="bench") as s:
            for i in range(args.count):
                await s.push({VAR: grads[i % POOL]})
        await mark_finished(c, container)
        await barrier()
        shard = new_shard()
        reason = await asyncio.wait_for(shard.run(), args.limit)
        start = shard.loop_started
        want_applied = args.count
    else:
        start = await barrier()
        want_applied = want
        reason = await asyncio.wait_for(task, args.limit)
    end = time.monotonic()
    version = await qps.Variable(
        VAR, _shape(args.case), np.float32, container=container, client=c
    ).version()
    groups = int(await c.commands.hget(f"qps:{{{container}/ps/0}}:stats", "groups") or 0)
    await c.close()
    error = None
    if reason != "finished" or shard.applied != want_applied or version != want:
        error = (
            f"run() {reason}, applied {shard.applied} (want {want_applied}), version "
            f"{version} (want {want})"
        )
    return {
        "start": start,
        "end": end,
        "ok": error is None,
        "error": error,
        "applied": shard.applied,
        "groups": groups,
    }


async def run_pusher(args: Any, barrier: harness.Barrier) -> dict[str, Any]:
    """``live`` mode only: the worker pushing while the shard runs."""
    import qps
    from qps.ps import mark_finished, read_config

    grads = _grads(args.case)
    async with qps.Session(args.url, container=args.name, worker="bench") as s:
        c = s.client

        async def configured() -> bool:
            return await read_config(c, args.name) is not None and VAR in await s.list_variables()

        await _wait("the PS job and its variable", configured, args.timeout)
        await s.push({VAR: grads[0]})  # warm-up: scripts loaded, shard's first apply done

        async def applied() -> bool:
            return await s.global_step() >= 1

        await _wait("the warm-up message applied", applied, args.timeout)
        start = await barrier()
        for i in range(args.count):
            await s.push({VAR: grads[i % POOL]})
        await mark_finished(c, args.name)
        end = time.monotonic()
    return {"start": start, "end": end, "ok": True}


async def run_inproc(args: Any, barrier: harness.Barrier) -> dict[str, Any]:
    opt = _optimizer(args.case)
    var = np.zeros(_shape(args.case), np.float32)
    slots = opt.init_slots(var)
    grads = _grads(args.case)

    def apply(i: int, t: int) -> None:
        g = grads[i % POOL]
        if _dense(args.case):
            opt.apply_dense(var, g, slots, t)
        else:
            opt.apply_sparse(var, g[0], g[1], slots, t)

    apply(0, 1)  # warm-up
    start = await barrier()
    for i in range(args.count):
        apply(i, i + 2)
    end = time.monotonic()
    ok = bool(np.isfinite(var).all())
    return {"start": start, "end": end, "ok": ok, "error": None if ok else "non-finite"}


async def participant(args: Any, barrier: harness.Barrier) -> dict[str, Any]:
    role = {"shard": run_shard, "pusher": run_pusher, "inproc": run_inproc}[args.role]
    return await role(args, barrier)


def rows(quick: bool) -> list[harness.Row]:
    # prefilled rows hold count messages in the gradient queue (capacity 256)
    counts = {"dense": 10, "lazy": 40, "tf1": 2} if quick else {"dense": 60, "lazy": 250, "tf1": 6}
    labels = {
        "dense": "dense 16 MiB float32, Adam, queue prefilled: PS (qps) vs in process (raw)",
        "dense-g1": "  the same, max_group=1 (one commit per message)",
        "dense-live": "  the same, one live pusher (bound by its 16 MiB enqueues)",
        "lazy": "sparse 1M x 64, 4,096-row msgs, Adam lazy=True, prefilled: PS vs in process",
        "tf1": "sparse 1M x 64, 4,096-row msgs, TF1 Adam (all rows), prefilled: PS vs in process",
    }
    out = []
    for case in CASES:
        n = counts["dense" if _dense(case) else case]
        common = ("--impl", "qps", "--case", case, "--count", str(n))
        procs: tuple[tuple[str, ...], ...] = (("--role", "shard", *common),)
        if _live(case):
            procs += (("--role", "pusher", *common),)
        ps = harness.Run("ps_apply.py", procs, _metric(case, n))
        inproc = harness.Run(
            "ps_apply.py",
            (("--role", "inproc", "--impl", "raw", "--case", case, "--count", str(n)),),
            _metric(case, n),
        )
        dense = _dense(case)
        out.append(
            harness.Row(
                case,
                labels[case],
                "GiB/s of gradient" if dense else "rows/s",
                qps=ps,
                raw=inproc,
                fmt="{:.3f}".format if dense else "{:,.0f}".format,
            )
        )
    return out


def _metric(case: str, n: int) -> Any:
    if _dense(case):
        return lambda t, _r: n * DENSE_N * 4 / GIB / t
    return lambda t, _r: n * BATCH / t


def main() -> None:
    if "--role" in sys.argv:
        p = harness.participant_parser(__doc__ or "")
        p.add_argument("--case", choices=CASES, required=True)
        p.add_argument("--count", type=int, required=True)
        harness.participant_main(p, participant)
    else:
        harness.bench_main(rows, "PS apply: a PS shard (qps) against in-process NumPy (raw)")


if __name__ == "__main__":
    main()
