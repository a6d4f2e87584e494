"""PS shards in-process (qps/ps/shard.py, client.py, control.py) on both backends:
async training, the optimizer rules through the shard, exactly-once skipping of
redelivered messages, single writer (standby, fencing), dead letters, staleness."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

import qps
from qps import keys
from qps.errors import (
    CancelledError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
)
from qps.optimizers import SGD, Adagrad, Adam, Momentum, Optimizer
from qps.ps import control
from qps.ps.messages import GradientMessage, SparseGradient, encode_message
from qps.ps.shard import LeaseLostError, Shard, ShardOptions
from qps.queues import base as queue_base
from qps.variables import StaleTokenError
from tests.conftest import ClientFactory, cancel_all, pending, until, until_blocked, within

C = "job"


class Job:
    """Shards running as tasks, and sessions, on one server."""

    def __init__(self, make_client: ClientFactory) -> None:
        self.make_client = make_client
        self.tasks: list[asyncio.Task[str]] = []
        self.sessions: list[qps.Session] = []

    async def session(self, worker: str = "w0") -> qps.Session:
        s = qps.Session(client=await self.make_client(), container=C, worker=worker)
        await s.open()
        self.sessions.append(s)
        return s

    async def shard(
        self, shard: int = 0, num: int = 1, opt: Optimizer | None = None, **kw: Any
    ) -> tuple[Shard, asyncio.Task[str]]:
        # a running shard renews its lease every third of it: 5 s leaves a loaded machine
        # room for a stall (tests of an expiry take over a lease they set short)
        kw.setdefault("lease_ms", 5000)
        s = Shard(
            await self.make_client(),
            ShardOptions(shard, num, container=C, optimizer=opt, **kw),
        )
        task = asyncio.create_task(s.run())
        self.tasks.append(task)
        return s, task

    async def close(self) -> None:
        await cancel_all(self.tasks)
        for s in self.sessions:
            await s.close()


@pytest.fixture
async def job(make_client: ClientFactory) -> AsyncIterator[Job]:
    j = Job(make_client)
    try:
        yield j
    finally:
        await j.close()


async def _steps(sess: qps.Session, n: int) -> None:
    async def reached() -> bool:
        return await sess.global_step() >= n

    await until(reached, timeout=30)


async def _versions(sess: qps.Session, want: dict[str, int]) -> None:
    async def reached() -> bool:
        got = await sess.pull(list(want))
        return all(got[n].version >= v for n, v in want.items())

    await until(reached, timeout=30, what=f"versions {want}")


async def test_async_training_dense_and_sparse(job: Job) -> None:
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    w = sess.variable("w", (3,), np.float64, initializer="zeros")
    emb = sess.variable("emb", (10, 2), np.float64, initializer="zeros")
    await w.create()
    await emb.create()
    _, task = await job.shard()
    for step in range(5):
        await sess.pull([w, "emb"])
        ids = await sess.push(
            {w: np.array([1.0, 2.0, 3.0]), "emb": ([1, 1, 7], np.ones((3, 2)))}, step=step
        )
        assert list(ids) == [0] and ids[0].startswith(f"w0/{step}/0/")
    await _steps(sess, 5)
    val, ver = await sess.pull(w)
    assert val.tolist() == [-5.0, -10.0, -15.0] and ver == 5
    rows, _ = await sess.pull_rows("emb", [1, 7, 0])
    assert rows.tolist() == [[-10.0, -10.0], [-5.0, -5.0], [0.0, 0.0]]
    assert await sess.global_step() == 5
    st = await control.shard_status(sess.client, C, 0)
    assert (st.state, st.applied, st.skipped, st.variables) == ("running", 5, 0, 2)
    assert st.rows == 5 * (3 + 3) and st.dead_letters == 0
    assert st.percentiles()["w0"]["messages"] == 5  # stale by how far the shard lags
    # the job ends: the shard drains its queue and returns; later pushes fail
    await control.mark_finished(sess.client, C)
    assert await asyncio.wait_for(task, 30) == "finished"
    with pytest.raises(CancelledError, match="finished"):
        await sess.push({w: np.ones(3)})
    st = await control.shard_status(sess.client, C, 0)
    assert st.state == "finished" and st.owner is None
    # no applied ids are left once the messages are acknowledged
    for name in ("w", "emb"):
        assert await sess.client.commands.zcard(keys.variable_applied(C, name)) == 0


@pytest.mark.parametrize(
    "opt",
    [
        Adam(learning_rate=0.1),
        Adam(learning_rate=0.1, lazy=True),
        Momentum(learning_rate=0.1, momentum=0.9),
        Adagrad(learning_rate=0.5),
    ],
    ids=["adam", "lazy-adam", "momentum", "adagrad"],
)
async def test_rules_match_the_in_process_reference(job: Job, opt: Optimizer) -> None:
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, opt)
    init = np.random.default_rng(0).random((6, 3))
    await sess.variable("d", (4,), np.float64, initializer=np.arange(4.0)).create()
    await sess.variable("e", (6, 3), np.float64, initializer=init).create()
    await job.shard()
    rng = np.random.default_rng(1)
    ref_d, ref_e = np.arange(4.0), init.copy()
    sd, se = opt.init_slots(ref_d), opt.init_slots(ref_e)
    for t in range(1, 6):
        gd = rng.standard_normal(4)
        idx = rng.integers(0, 6, 4)
        ge = rng.standard_normal((4, 3))
        await sess.push({"d": gd, "e": (idx, ge)})
        opt.apply_dense(ref_d, gd, sd, t)
        opt.apply_sparse(ref_e, idx, ge, se, t)
    await _steps(sess, 5)
    got = await sess.pull(["d", "e"])
    np.testing.assert_allclose(got["d"].value, ref_d, rtol=1e-12)
    np.testing.assert_allclose(got["e"].value, ref_e, rtol=1e-12)
    state = await (await sess.ps.variable("e")).read_state()
    assert state.t == 5 and list(state.slots) == list(opt.slot_names())
    for n in opt.slot_names():
        np.testing.assert_allclose(state.slots[n], se[n], rtol=1e-12)


@pytest.mark.parametrize("sync", [None, (1, 1)], ids=["async", "sync"])
async def test_float16_gradients_apply_as_their_float32_values(
    job: Job, sync: tuple[int, int] | None
) -> None:
    """Gradients sent in float16 (qps worker --grad-dtype) for float32 variables, dense
    and sparse rows: the shard widens them before the apply, so the state is exactly
    the in-process Adam's on the widened values, in both modes."""
    opt = Adam(learning_rate=0.01)
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, opt, sync=sync)
    init = np.random.default_rng(0).random((6, 3)).astype(np.float32)
    await sess.variable("d", (4,), np.float32, initializer=np.arange(4.0)).create()
    await sess.variable("e", (6, 3), np.float32, initializer=init).create()
    await job.shard()
    rng = np.random.default_rng(1)
    ref_d, ref_e = np.arange(4.0, dtype=np.float32), init.copy()
    sd, se = opt.init_slots(ref_d), opt.init_slots(ref_e)
    for t in range(1, 6):
        gd = rng.standard_normal(4).astype(np.float16)
        idx = np.unique(rng.integers(0, 6, 4))
        ge = rng.standard_normal((len(idx), 3)).astype(np.float16)
        await sess.push({"d": gd, "e": (idx, ge)}, step=t - 1)
        opt.apply_dense(ref_d, gd.astype(np.float32), sd, t)
        opt.apply_sparse(ref_e, idx, ge.astype(np.float32), se, t)
        await _steps(sess, t)  # synchronous: one update at a time
    got = await sess.pull(["d", "e"])
    assert got["d"].value.dtype == np.float32
    np.testing.assert_array_equal(got["d"].value, ref_d)
    np.testing.assert_array_equal(got["e"].value, ref_e)


def _message(sess: qps.Session, grads: dict[str, Any], nonce: str = "x.1") -> GradientMessage:
    return GradientMessage(worker="w9", step=3, shard=0, nonce=nonce, grads=grads, global_step=True)


async def _setup_two(sess: qps.Session) -> None:
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    for n in ("a", "b"):
        await sess.variable(n, (2,), np.float64, initializer="zeros").create()
    await qps.ps.place_variables(sess.client, C, ["a", "b"])


async def _committed_to_a_only(job: Job, sess: qps.Session) -> tuple[GradientMessage, Shard]:
    """Variables "a" and "b" on one shard, and a message for both that a first shard
    committed to "a" only (then it was "killed", before the ack); the message and that
    shard."""
    await _setup_two(sess)
    m = _message(sess, {"a": np.array([1.0, 1.0]), "b": np.array([2.0, 2.0])})
    first = Shard(await job.make_client(), ShardOptions(0, 1, container=C, lease_ms=600))
    first.optimizer = SGD(learning_rate=1.0)
    assert await first._acquire()
    await first._own_placed()
    await first._apply(dataclasses.replace(m, grads={"a": m.grads["a"]}, global_step=False))
    return m, first


async def _redeliver(sess: qps.Session, m: GradientMessage) -> None:
    """The queue gives message ``m`` back (as when its delivery lease ran out)."""
    await control.gradient_queue(sess.client, C, 0).enqueue(
        np.frombuffer(encode_message(m), np.uint8)
    )


async def _each_applied_once(sess: qps.Session) -> None:
    """After the global step's first update: "a" and "b" hold the message of
    ``_committed_to_a_only`` once each (SGD, learning rate 1)."""
    await _steps(sess, 1)
    got = await sess.pull(["a", "b"])
    assert got["a"].value.tolist() == [-1.0, -1.0] and got["a"].version == 1
    assert got["b"].value.tolist() == [-2.0, -2.0] and got["b"].version == 1


async def test_redelivery_after_a_crash_between_two_commits(job: Job) -> None:
    """The skip-if-applied path: variable a committed the message, b did not, the shard
    died before the ack; the redelivered message updates b only, and the step once."""
    sess = await job.session()
    m, first = await _committed_to_a_only(job, sess)
    await _redeliver(sess, m)
    second, _task = await job.shard()
    await _each_applied_once(sess)
    assert second.token > first.token
    st = await control.shard_status(sess.client, C, 0)
    assert (st.applied, st.skipped) == (1, 0)

    async def released() -> bool:  # with the next ack, or once the shard is idle
        return not await sess.client.commands.zcard(keys.variable_applied(C, "a"))

    await until(released)


async def test_redelivery_of_a_fully_applied_message_is_skipped(job: Job) -> None:
    sess = await job.session()
    await _setup_two(sess)
    m = _message(sess, {"a": np.array([1.0, 1.0]), "b": np.array([2.0, 2.0])})
    first = Shard(await job.make_client(), ShardOptions(0, 1, container=C, lease_ms=600))
    first.optimizer = SGD(learning_rate=1.0)
    assert await first._acquire()
    await first._own_placed()
    done = await first._apply(m)  # everything committed, then killed before the ack
    assert done.fresh == 1 and sorted(done.vars) == ["a", "b"] and done.gs_ids == [m.id]
    assert await sess.global_step() == 1
    await _redeliver(sess, m)
    second, _ = await job.shard()

    async def skipped() -> bool:
        return (await control.shard_status(sess.client, C, 0)).skipped == 1

    await until(skipped, timeout=30)
    got = await sess.pull(["a", "b"])
    assert got["a"].value.tolist() == [-1.0, -1.0] and got["b"].value.tolist() == [-2.0, -2.0]
    assert await sess.global_step() == 1
    assert second.skipped == 1 and second.applied == 0


async def test_a_commit_not_looked_up_is_refused_and_the_group_delivered_again(
    job: Job, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The net under the look-ups: a message that "a" committed, taken for one that
    cannot have been (the ids read when the shard took "a" over are forgotten), is
    applied again in memory; a's commit refuses it ('dup', writing nothing), "a" is
    reloaded and the group comes again, looked up this time: each variable has the
    message once."""
    caplog.set_level("INFO", logger="qps")
    sess = await job.session()
    m, _ = await _committed_to_a_only(job, sess)
    placed = Shard._own_placed

    async def forgetful(self: Shard) -> None:
        await placed(self)
        self._suspect.clear()

    monkeypatch.setattr(Shard, "_own_placed", forgetful)
    await _redeliver(sess, m)
    second, _ = await job.shard()
    await _each_applied_once(sess)
    assert await sess.global_step() == 1

    async def counted() -> bool:  # once the group's ack is done: b had committed it
        return second.skipped == 1  # in the refused round, so the second finds it all done

    await until(counted)
    assert "'a' had applied a message of the group: reloading it" in caplog.text


async def test_a_second_copy_waits_then_takes_over(job: Job) -> None:
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    await sess.variable("w", (1,), np.float64, initializer="zeros").create()
    first, t1 = await job.shard(lease_ms=5000)
    await sess.push({"w": np.ones(1)})
    await _steps(sess, 1)
    second, t2 = await job.shard(lease_ms=5000)

    async def standby() -> bool:
        st = await control.shard_status(sess.client, C, 0)
        return second.token == 0 and st.token == first.token

    await until(standby)
    assert not t2.done()
    first.request_stop()
    assert await asyncio.wait_for(t1, 10) == "stopped"
    # the release wakes the standby at once (well before the 5 s lease would expire)

    async def took_over() -> bool:
        return second.token > first.token and "w" in second.owned

    await until(took_over, timeout=4)
    await sess.push({"w": np.ones(1)})
    await _steps(sess, 2)
    assert (await sess.pull("w")).value.tolist() == [-2.0]
    assert (await (await sess.ps.variable("w")).stats()).token == second.token


async def test_a_zombie_cannot_write_after_a_new_owner_fenced(job: Job) -> None:
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    await sess.variable("w", (1,), np.float64, initializer="zeros").create()
    await qps.ps.place_variables(sess.client, C, ["w"])
    zombie, zt = await job.shard(lease_ms=900)

    async def owns() -> bool:
        return "w" in zombie.owned

    await until(owns)
    # the zombie stalls past its lease: a new owner takes the shard and fences "w"
    await sess.client.commands.delete(keys.ps_prefix(C, 0) + "lease")
    new, _ = await job.shard(lease_ms=900)

    async def fenced() -> bool:
        return (await (await sess.ps.variable("w")).stats()).token == new.token > 0

    await until(fenced)
    with pytest.raises(StaleTokenError):
        await zombie._apply(
            GradientMessage(worker="zombie", step=0, shard=0, nonce="z.1", grads={"w": np.ones(1)})
        )
    with pytest.raises(LeaseLostError, match="lease lost"):
        await asyncio.wait_for(zt, 10)
    await sess.push({"w": np.ones(1)})
    await _steps(sess, 1)
    assert (await sess.pull("w")).value.tolist() == [-1.0]


async def test_a_shard_behind_takes_what_waits_in_one_delivery(
    job: Job, monkeypatch: pytest.MonkeyPatch, queue_path: None
) -> None:
    """Messages that piled up before the shard started come in deliveries of several
    (one attempt each, settled once): every one is applied exactly once, in order, and
    the queue keeps nothing held afterwards."""
    taken: list[int] = []
    real = queue_base.QueueBase.dequeue_ready_acked

    async def spy(self: Any, n: int, **kw: Any) -> Any:
        d, replies = await real(self, n, **kw)
        taken.append(len(d.value))
        return d, replies

    monkeypatch.setattr(queue_base.QueueBase, "dequeue_ready_acked", spy)
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    w = sess.variable("w", (2,), np.float64, initializer="zeros")
    await w.create()
    for step in range(7):  # the queue holds 8: nobody waits
        await sess.push({w: np.array([1.0, 10.0**step])}, step=step)
    await job.shard(max_group=4)
    await _steps(sess, 7)
    assert (await sess.pull(w)).value.tolist() == [-7.0, -1111111.0]
    assert taken and max(taken) > 1 and sum(taken) <= 6  # the first one comes alone
    q = control.gradient_queue(sess.client, C, 0)
    await until(lambda: _none_held(q))
    st = await control.shard_status(sess.client, C, 0)
    assert (st.applied, st.skipped, st.dead_letters) == (7, 0, 0)


async def _none_held(q: Any) -> bool:
    return await q.size() == 0 and await q.held() <= 1  # the reader's next wait


async def test_bad_messages_are_dead_lettered_never_applied(job: Job) -> None:
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    await sess.variable("w", (2,), np.float32, initializer="zeros").create()
    await qps.ps.place_variables(sess.client, C, ["w"])
    q = control.gradient_queue(sess.client, C, 0)
    await q.enqueue(np.frombuffer(b"not a message at all", np.uint8))
    bad = [
        {"w": np.ones(3, np.float32)},  # wrong shape
        {"w": np.ones(2, np.float64)},  # wrong dtype
        {"nope": np.ones(2, np.float32)},  # unknown variable
        {"w": SparseGradient(np.array([5]), np.ones((1,), np.float32))},  # index out of range
    ]
    for i, g in enumerate(bad):
        m = _message(sess, g, nonce=f"bad.{i}")  # type: ignore[arg-type]
        await q.enqueue(np.frombuffer(encode_message(m), np.uint8))
    # a poison gradient passes the worker's checks and is quarantined by the shard
    await sess.push({"w": np.array([np.nan, 1.0], np.float32)}, step=11)
    await sess.push({"w": np.array([1.0, 1.0], np.float32)}, step=12)
    await job.shard()
    await _steps(sess, 1)
    assert (await sess.pull("w")).value.tolist() == [-1.0, -1.0]
    letters = await control.dead_letters(sess.client, C, 0)
    reasons = [d["reason"] for d in letters]
    assert len(letters) == 6, reasons
    # the pushes may travel on the shard's gradient list, read beside the queue: the
    # poison push's letter may come before the queue's, which keep their order
    (nan,) = [d for d in letters if "NaN or Inf" in d["reason"]]
    queued = [d["reason"] for d in letters if d is not nan]
    assert "gradient message" in queued[0] or "magic" in queued[0]
    assert "shape [3]" in queued[1] and "float64" in queued[2]
    assert "not placed" in queued[3] and "not in [0, 2)" in queued[4]
    assert (nan["worker"], nan["step"], nan["variable"]) == ("w0", 11, "w")
    assert nan["data"] and nan["id"].startswith("w0/11/0/")
    st = await control.shard_status(sess.client, C, 0)
    assert (st.applied, st.dead_letters) == (1, 6)
    assert int(st.fields["dead_letters"]) == 6
    assert await control.drop_dead_letters(sess.client, C, 0) == 6
    assert await control.dead_letters(sess.client, C, 0) == []


@pytest.mark.no_cluster(reason="a read plan is for a single server (pull_plan gives None)")
async def test_push_then_reads_the_parameters_in_the_push_round_trip(job: Job) -> None:
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 2, SGD(learning_rate=1.0))
    for name in ("w", "b"):
        await sess.variable(name, (2,), np.float64, initializer="zeros").create()
    ps = sess.ps
    where = await ps.shards_of(["w", "b"])
    plan = await ps.pull_plan(["w", "b"])
    assert plan is not None and sorted(where.values()) == [0, 1]
    got = ps.pulled(plan, await sess.client.run_commands_replies(plan.commands))
    assert got is not None
    # no shard runs: the read after the push sees the parameters as they are
    ids, replies = await ps.push_then({"w": np.ones(2), "b": np.ones(2)}, plan.commands, step=0)
    assert sorted(ids) == [0, 1]
    now = ps.pulled(plan, replies)
    assert now is not None and now["w"].version == got["w"].version
    ids, replies = await ps.push_then({"w": np.ones(2)}, [], step=1)
    assert replies == [] and ids[where["w"]].startswith("w0/1/")
    await job.shard(0, 2)
    await job.shard(1, 2)
    # the global step counts a step once shard 0 applied its part: wait for the versions
    # of both variables, which live on different shards
    await _versions(sess, {"w": 2, "b": 1})
    ids, replies = await ps.push_then({"w": np.ones(2), "b": np.ones(2)}, plan.commands, step=2)
    await _versions(sess, {"w": 3, "b": 2})
    values = await sess.pull(["w", "b"])
    assert values["w"].value.tolist() == [-3.0, -3.0] and values["b"].value.tolist() == [-2.0, -2.0]
    then = ps.pulled(plan, replies)  # read right after the push: before its apply, or after
    assert then is not None and then["w"].version in (2, 3)
    assert then["w"].value.tolist() == [-float(then["w"].version)] * 2
    with pytest.raises(InvalidArgumentError):  # checked before anything is sent
        await ps.push_then({"w": np.ones(3)}, plan.commands)


async def test_worker_side_errors_send_nothing(job: Job) -> None:
    sess = await job.session()
    with pytest.raises(FailedPreconditionError, match="no PS job"):
        await sess.variable("w", (2,), np.float32).create()
        await sess.push({"w": np.ones(2, np.float32)})
    await qps.ps.configure(sess.client, C, 2, SGD(learning_rate=1.0))
    await sess.variable("n", (2,), np.int64).create()
    with pytest.raises(InvalidArgumentError, match=r"has shape \[3\], the variable \[2\]"):
        await sess.push({"w": np.ones(3, np.float32)})
    with pytest.raises(InvalidArgumentError, match="float64, the variable float32"):
        await sess.push({"w": np.ones(2, np.float64)})
    with pytest.raises(NotFoundError, match="no variable 'ghost'"):
        await sess.push({"w": np.ones(2, np.float32), "ghost": np.ones(2, np.float32)})
    with pytest.raises(InvalidArgumentError, match="floating-point"):
        await sess.push({"n": np.ones(2, np.int64)})
    with pytest.raises(InvalidArgumentError, match=r"is not in \[0, 2\)"):
        await sess.push({"w": ([2], np.ones((1,), np.float32))})
    for shard in (0, 1):
        assert await control.gradient_queue(sess.client, C, shard).size() == 0
    assert await control.read_placement(sess.client, C) == {}


async def test_staleness_per_worker(job: Job) -> None:
    s0 = await job.session("alice")
    s1 = await job.session("bob")
    await qps.ps.configure(s0.client, C, 1, SGD(learning_rate=1.0))
    await s0.variable("w", (1,), np.float64, initializer="zeros").create()
    await job.shard()
    await s0.pull("w")
    await s1.pull("w")  # both compute from version 0
    await s0.push({"w": np.ones(1)})
    await _steps(s0, 1)
    await s1.push({"w": np.ones(1)})  # applied at version 1: missed one update
    await _steps(s0, 2)
    await s1.pull("w")
    await s1.push({"w": np.ones(1)})  # fresh again
    await _steps(s0, 3)

    async def counted() -> bool:  # the stats follow the global step (after the ack)
        per = (await control.shard_status(s0.client, C, 0)).percentiles()
        return per.get("*", {}).get("messages") == 3

    await until(counted)
    per = (await control.shard_status(s0.client, C, 0)).percentiles()
    assert per["alice"] == {"messages": 1, "p50": 0, "p99": 0}
    assert per["bob"] == {"messages": 2, "p50": 0, "p99": 1}
    assert per["*"]["messages"] == 3


async def test_a_push_undone_during_a_partition_is_sent_again(
    job: Job, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, queue_path: None
) -> None:
    """A push waiting on a full queue whose lease runs out (its process cut off from
    Redis, tests/test_multihost.py) is undone by Redis; the push sends the same message
    again, and it is applied once."""
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0), queue_capacity=1)
    await sess.variable("w", (1,), np.float64, initializer="zeros").create()
    await sess.push({"w": np.ones(1)})  # the queue is full: no shard runs yet
    monkeypatch.setattr("qps.queues.waiters.LEASE_MS", 1)  # every wait outlives its lease
    push = asyncio.create_task(sess.push({"w": np.ones(1)}))

    async def undone() -> bool:
        return "sending the message again" in caplog.text

    await until(undone)
    monkeypatch.undo()
    await job.shard()
    ids = await push
    await _steps(sess, 2)
    queue = control.gradient_queue(sess.client, C, 0, 1)
    assert await queue.size() == 0 and await sess.global_step() == 2, ids
    assert (await sess.pull("w")).value.tolist() == [-2.0]


async def test_two_shards_split_a_push_and_shard0_counts_steps(job: Job) -> None:
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 2, SGD(learning_rate=0.5))
    for n in ("v0", "v1", "v2"):
        await sess.variable(n, (2,), np.float64, initializer="ones").create()
    placed = await qps.ps.place_variables(sess.client, C, ["v0", "v1", "v2"])
    assert placed == {"v0": 0, "v1": 1, "v2": 0}  # round robin, creation order
    await job.shard(0, 2)
    await job.shard(1, 2)
    ids = await sess.push({n: np.full(2, 2.0) for n in ("v0", "v1", "v2")})
    assert sorted(ids) == [0, 1]
    ids = await sess.push({"v1": np.full(2, 2.0)})  # shard 0 still gets one, for the step
    assert sorted(ids) == [0, 1]
    await _steps(sess, 2)

    async def v1_done() -> bool:
        return (await sess.pull("v1")).version == 2

    await until(v1_done)
    got = await sess.pull(["v0", "v1", "v2"])
    assert got["v0"].value.tolist() == [0.0, 0.0] and got["v1"].value.tolist() == [-1.0, -1.0]
    assert got["v2"].version == 1
    assert await sess.global_step() == 2
    s0 = await control.shard_status(sess.client, C, 0)
    s1 = await control.shard_status(sess.client, C, 1)
    assert (s0.variables, s1.variables) == (2, 1)
    assert (s0.applied, s1.applied) == (2, 2)


async def test_a_variable_placed_after_the_shard_started(job: Job) -> None:
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    shard, _ = await job.shard()
    await until(lambda: _true(shard.token > 0))
    await sess.variable("late", (2,), np.float32, initializer="zeros").create()
    await sess.push({"late": np.ones(2, np.float32)})  # placed now, owned on arrival
    await _steps(sess, 1)
    assert (await sess.pull("late")).value.tolist() == [-1.0, -1.0]
    assert "late" in shard.owned


async def test_config_must_agree(job: Job) -> None:
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 2, SGD(learning_rate=1.0))
    with pytest.raises(InvalidArgumentError, match="has 2 shard"):
        await qps.ps.configure(sess.client, C, 3)
    with pytest.raises(InvalidArgumentError, match="applies sgd"):
        await qps.ps.configure(sess.client, C, 2, Adam())
    _, task = await job.shard(0, 3)
    with pytest.raises(InvalidArgumentError, match="has 2 shard"):
        await asyncio.wait_for(task, 10)


async def test_a_shard_without_an_optimizer_waits_for_the_one_that_has_it(job: Job) -> None:
    """Two shards started together, only one given the optimizer (docs/ps.md): the
    other waits for it, blocked in Redis, instead of failing; a stop ends the wait."""
    sess = await job.session()
    # a shard waiting for an optimizer that never comes stops on request
    alone = Shard(await job.make_client(), ShardOptions(0, 1, container=C + "-alone"))
    task = asyncio.create_task(alone.run())
    job.tasks.append(task)
    await until_blocked(sess.client, task=task, what="a shard waits for the optimizer")
    alone.request_stop()
    assert await within(task, 10, "a stop ends the wait for the optimizer") == "stopped"

    for name in ("a", "b"):
        await sess.variable(name, (4,), np.float32, np.zeros(4, np.float32)).create()
    second, waiting = await job.shard(1, 2)
    await until_blocked(sess.client, task=waiting, what="shard 1 waits for the optimizer")
    assert pending(waiting)
    await job.shard(0, 2, SGD(learning_rate=1.0))
    await sess.push({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}, step=0)

    async def both_applied() -> bool:
        pulled = await sess.pull(["a", "b"])
        return all(np.array_equal(v, np.full(4, -1, np.float32)) for v, _ in pulled.values())

    await until(both_applied, 30, "both shards apply the push")
    assert second.optimizer == SGD(learning_rate=1.0) and pending(waiting)


async def test_slots_of_another_optimizer_need_reset_slots(job: Job) -> None:
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, Adam())
    await sess.variable("w", (2,), np.float64, initializer="zeros").create()
    await qps.ps.place_variables(sess.client, C, ["w"])
    var = await sess.ps.variable("w")
    await var.init_slots({"accumulator": np.zeros(2)}, 1)
    _, task = await job.shard()
    with pytest.raises(FailedPreconditionError, match="reset-slots"):
        await asyncio.wait_for(task, 10)
    _, task = await job.shard(reset_slots=True)
    await sess.push({"w": np.ones(2)})
    await _steps(sess, 1)
    assert list((await var.read_state()).slots) == ["m", "v"]


async def _true(x: bool) -> bool:
    return x


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_dead_holder_only_for_a_gone_process_of_this_host_and_namespace() -> None:
    import os
    import socket

    from qps.owners import default_owner
    from qps.owners import pid_namespace as _pid_namespace
    from qps.ps.shard import dead_holder

    host, ns = socket.gethostname(), _pid_namespace()
    assert default_owner().startswith(f"{host}:{os.getpid()}:")
    assert default_owner().endswith(f":{ns}")
    gone = _dead_pid()
    assert dead_holder(f"7 {host}:{gone}:abc:{ns}")
    assert not dead_holder(f"7 {host}:{os.getppid()}:abc:{ns}")  # alive
    assert not dead_holder(f"7 {host}:{os.getpid()}:abc:{ns}")  # this process
    assert not dead_holder(f"7 other-{host}:{gone}:abc:{ns}")  # another host
    assert not dead_holder(f"7 {host}:{gone}:abc:{ns}0")  # another pid namespace
    assert not dead_holder(f"7 {host}:{gone}:abc:-")  # namespace unknown
    for bad in ("", "7", f"7 {host}:{gone}:abc", f"7 {host}:x:abc:{ns}", f"7 {host}:-1:a:{ns}"):
        assert not dead_holder(bad), bad


async def test_a_dead_holder_of_this_host_is_taken_over_at_once(job: Job) -> None:
    """A lease held by a process of this host that is gone (a shard SIGKILLed and
    restarted) is taken over without waiting it out: here it has a minute left."""
    import socket

    from qps.owners import pid_namespace as _pid_namespace

    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    await sess.variable("w", (1,), np.float64, initializer="zeros").create()
    held = f"1 {socket.gethostname()}:{_dead_pid()}:dead00:{_pid_namespace()}"
    lease = keys.ps_prefix(C, 0) + "lease"
    await sess.client.commands.set(lease, held, px=60_000)
    shard, task = await job.shard(lease_ms=5000)

    async def running() -> bool:
        return shard.loop_started is not None

    await until(running, timeout=20)  # far less than the minute left on the lease
    assert shard.takeover == held and shard.token >= 1
    assert (await sess.client.commands.get(lease)).decode() == shard._lease_value
    st = await control.shard_status(sess.client, C, 0)
    assert st.fields["takeover"] == held
    await sess.push({"w": np.ones(1)})
    await _steps(sess, 1)

    async def first_apply() -> bool:  # written after the ack, which follows the step
        st = await control.shard_status(sess.client, C, 0)
        return int(st.fields.get("first_ms", 0)) > 0

    await until(first_apply)
    st = await control.shard_status(sess.client, C, 0)
    assert int(st.fields["first_ms"]) >= int(st.fields["started_ms"]) > 0
    shard.request_stop()
    assert await asyncio.wait_for(task, 10) == "stopped"


async def test_a_live_holder_is_not_taken_over(job: Job, caplog: pytest.LogCaptureFixture) -> None:
    """The same with a live holder (a pid that exists): the new copy waits as a standby."""
    import os
    import socket

    from qps.owners import pid_namespace as _pid_namespace

    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    held = f"1 {socket.gethostname()}:{os.getppid()}:live00:{_pid_namespace()}"
    lease = keys.ps_prefix(C, 0) + "lease"
    await sess.client.commands.set(lease, held, px=60_000)
    shard, task = await job.shard(lease_ms=5000)

    caplog.set_level("INFO", logger="qps")

    async def announced() -> bool:  # it has looked at the holder and gone to wait
        return any("waiting as a standby" in r.getMessage() for r in caplog.records)

    await until(announced)
    assert shard.token == 0 and shard.takeover is None
    assert (await sess.client.commands.get(lease)).decode() == held
    shard.request_stop()
    assert await asyncio.wait_for(task, 10) == "stopped"


async def test_deliveries_a_dead_owner_held_are_applied_before_finishing(
    job: Job, queue_path: None
) -> None:
    """A shard that died holding messages it had taken (read ahead, never acked): its
    successor puts them back and applies them, even when the job is already marked
    finished and the queue looks empty (it used to exit 'finished' and lose them)."""
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 1, SGD(learning_rate=1.0))
    await sess.variable("w", (1,), np.float64, initializer="zeros").create()
    for _ in range(3):
        await sess.push({"w": np.ones(1)})
    dead = await job.make_client()
    grads = control.gradient_queue(dead, C, 0)
    taken = [await grads.dequeue_acked(), await grads.dequeue_acked()]  # then "SIGKILL"
    assert all(d.tokens for d in taken)
    assert await grads.size() == 1 and await grads.held() == 2
    await control.mark_finished(sess.client, C)
    shard, task = await job.shard()
    assert await asyncio.wait_for(task, 30) == "finished"
    assert shard.applied == 3
    assert await sess.global_step() == 3
    assert (await sess.pull("w")).value.tolist() == [-3.0]
    assert await grads.held() == 0 and await grads.size() == 0


async def test_marking_finished_twice_at_once_succeeds_for_both(job: Job) -> None:
    """A chief that stops and `qps job stop` both mark the job finished; the one that
    lost the race to close a gradient queue used to fail with 'already closed'."""
    sess = await job.session()
    await qps.ps.configure(sess.client, C, 3, SGD(learning_rate=1.0))
    other = await job.make_client()
    counts = await asyncio.gather(
        control.mark_finished(sess.client, C), control.mark_finished(other, C)
    )
    assert sum(counts) == 3  # each queue closed once, by one of them
    for shard in range(3):
        assert await control.gradient_queue(sess.client, C, shard).is_closed()
    assert await control.mark_finished(sess.client, C) == 0
