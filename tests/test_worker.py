"""The worker role's choice of array backend (workers/worker.py, ``--backend``).

On a machine without CUDA only the NumPy side and the errors run; the GPU tests
(marked ``gpu``) train the same synchronous job on NumPy and on CuPy and compare."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import qps
from qps import backend, checkpoint, containers, packing
from qps.errors import InvalidArgumentError
from qps.optimizers import SGD
from qps.ps import control
from tests.conftest import within
from tests.test_ps_shard import C, Job
from workers.models import Packed
from workers.worker import Worker, WorkerConfig

needs_gpu = pytest.mark.skipif(not backend.gpu_available(), reason="needs CuPy and a CUDA device")


def _cfg(**kw: Any) -> WorkerConfig:
    base: dict[str, Any] = {
        "index": 0, "num_workers": 1, "num_shards": 1, "model": "mlp:64,16,10",
        "data": "digits", "batch_size": 32, "steps": 12, "container": C,
        "log_every": 1000, "evaluate": False, "finish_job": False,
    }  # fmt: skip
    return WorkerConfig(**{**base, **kw})


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="backend='jax' is not one of auto"):
        _cfg(backend="jax").check()


@pytest.mark.skipif(backend.gpu_available(), reason="a CUDA device is here")
def test_cupy_without_a_device_is_refused_before_training(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(InvalidArgumentError, match="backend=cupy, but CuPy"):
        _cfg(backend="cupy").check()
    monkeypatch.setenv("QPS_BACKEND", "cupy")  # the variable when no flag is given
    with pytest.raises(InvalidArgumentError, match="QPS_BACKEND=cupy"):
        _cfg().check()


def test_numpy_is_chosen_and_a_small_model_computes_inline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("QPS_BACKEND", "cupy")  # the flag wins over the variable
    w = Worker(_cfg(backend="numpy"), None)  # type: ignore[arg-type]
    assert w.xp is np and w.inline
    w = Worker(_cfg(backend="numpy", model="mlp:64,1024,1024,10"), None)  # type: ignore[arg-type]
    assert w.xp is np and not w.inline  # a large model computes on a thread


async def _train(make_client: Any, backend_name: str, steps: int) -> dict[str, np.ndarray]:
    """One synchronous worker, one shard, in a fresh container: every step applies
    exactly this worker's gradient of the step before's parameters, so the run is
    deterministic. Returns the final parameters."""
    j = Job(make_client)
    client = await make_client()
    await containers.reset(client, [C])
    try:
        await control.configure(client, C, 1, SGD(learning_rate=0.05), sync=(1, 1))
        _, shard = await j.shard(0, 1)
        sess = await j.session("worker0")
        w = Worker(_cfg(steps=steps, backend=backend_name), sess)
        await w.prepare()
        res = await within(w.train(), 120, f"the worker trains {steps} steps", shard)
        assert res.steps == steps
        got = await sess.pull([p.name for p in w.model.params_spec()])
        return {n: np.array(v.value) for n, v in got.items()}
    finally:
        await j.close()


async def test_a_numpy_worker_trains_the_same_twice(make_client: Any) -> None:
    first = await _train(make_client, "numpy", 6)
    init = Worker(_cfg(), None).model.init_params(np.random.default_rng(0))  # type: ignore[arg-type]
    assert set(first) == set(init)
    assert all(not np.array_equal(first[n], init[n]) for n in init)  # every one moved
    second = await _train(make_client, "numpy", 6)
    for n, v in first.items():
        np.testing.assert_array_equal(second[n], v, err_msg=n)


@pytest.mark.gpu
@needs_gpu
async def test_a_cupy_worker_trains_as_a_numpy_one(make_client: Any) -> None:
    """The same job on the GPU and on the host: the parameters agree to rounding."""
    host = await _train(make_client, "numpy", 20)
    dev = await _train(make_client, "cupy", 20)
    for n, v in host.items():
        np.testing.assert_allclose(dev[n], v, rtol=1e-3, atol=1e-5, err_msg=n)


def test_the_clis_refuse_a_backend_they_cannot_use(tmp_path: Any) -> None:
    """`qps train` refuses a bad --backend (flag or config file) before it starts any
    role; `qps worker` before it connects. Where a GPU exists only the bad name runs."""
    from click.testing import CliRunner

    from qps.cli.main import cli

    def run(*args: str) -> Any:
        return CliRunner().invoke(cli, list(args), catch_exceptions=False)

    conf = tmp_path / "job.toml"
    conf.write_text('backend = "jax"\n')
    r = run("train", "--config", str(conf))
    assert r.exit_code == 2 and "backend='jax' is not one of auto, numpy, cupy" in r.output
    r = run("worker", "--index", "0", "--num-workers", "1", "--backend", "jax")
    assert r.exit_code == 2 and "'jax' is not one of" in r.output
    if backend.gpu_available():
        return
    r = run("train", "--backend", "cupy")
    assert r.exit_code == 2 and "backend=cupy, but CuPy" in r.output, r.output
    r = run("worker", "--index", "0", "--num-workers", "1", "--backend", "cupy")
    assert r.exit_code == 2 and "backend=cupy, but CuPy" in r.output, r.output


def test_qps_train_passes_the_backend_to_every_worker() -> None:
    from workers.launcher import TrainConfig

    args = TrainConfig(backend="numpy").worker_args(1, "redis://x", "c")
    assert args[args.index("--backend") + 1] == "numpy"
    assert "--backend" not in TrainConfig().worker_args(1, "redis://x", "c")


def test_auto_puts_only_a_large_model_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a device (here a stand-in CuPy module), auto computes a model of more than
    INLINE_PARAMS dense parameters with CuPy and a smaller one with NumPy; cupy forces
    CuPy for any model, numpy NumPy."""
    import types

    fake = types.ModuleType("cupy")
    monkeypatch.setattr(backend, "_probe_cupy", lambda: (fake, ""))
    monkeypatch.delenv("QPS_BACKEND", raising=False)
    small, large = "mlp:64,16,10", "mlp:784,1024,1024,10"

    def xp(model: str, choice: str) -> Any:
        return Worker(_cfg(model=model, backend=choice), None).xp  # type: ignore[arg-type]

    assert xp(small, "auto") is np
    assert xp(large, "auto") is fake
    assert xp(small, "cupy") is fake
    assert xp(large, "numpy") is np
    monkeypatch.setenv("QPS_BACKEND", "cupy")  # no flag: the variable decides
    assert xp(small, "") is fake


async def test_grad_dtype_float16_sends_half_the_bytes() -> None:
    """--grad-dtype float16: the step's gradients leave the worker as float16 (the
    shard widens them: tests/test_ps_shard.py); without it, as the variables' dtype."""
    from workers.data import builtin_split

    w = Worker(_cfg(grad_dtype="float16"), None)  # type: ignore[arg-type]
    params = w.model.init_params(np.random.default_rng(0))
    train, _ = builtin_split("digits", w.model)
    batch = tuple(a[:32] for a in train)
    _, half = await w._compute(params, batch)
    _, full = await Worker(_cfg(), None)._compute(params, batch)  # type: ignore[arg-type]
    assert {g.dtype for g in half.values()} == {np.dtype(np.float16)}
    assert {g.dtype for g in full.values()} == {np.dtype(np.float32)}
    for n, g in full.items():
        np.testing.assert_array_equal(half[n], g.astype(np.float16))
    with pytest.raises(InvalidArgumentError, match="grad dtype 'int8' is not one of"):
        _cfg(grad_dtype="int8").check()
    from workers.launcher import TrainConfig

    args = TrainConfig(grad_dtype="float16").worker_args(0, "redis://x", "c")
    assert args[args.index("--grad-dtype") + 1] == "float16"


async def test_sync_training_is_single_process_training_of_the_averaged_batches(
    make_client: Any,
) -> None:
    """Two synchronous workers, one shard: every update is the mean of one gradient per
    worker on the same parameters, which is what one process computes from the two
    workers' minibatch streams (worker k draws with default_rng(seed + k)). The job's
    parameters equal that process's to float rounding, and so does the accuracy."""
    from workers.data import builtin_split, minibatches, take

    steps, lr = 15, 0.05
    j = Job(make_client)
    client = await make_client()
    await containers.reset(client, [C])
    try:
        await control.configure(client, C, 1, SGD(learning_rate=lr), sync=(2, 2))
        _, shard = await j.shard(0, 1)

        async def run(index: int) -> Worker:
            sess = await j.session(f"worker{index}")
            w = Worker(_cfg(index=index, num_workers=2, steps=steps, backend="numpy"), sess)
            await w.prepare()
            await w.train()
            return w

        both = asyncio.gather(run(0), run(1))
        w0, _ = await within(both, 120, f"two workers train {steps} steps", shard)
        got = await j.sessions[0].pull([p.name for p in w0.model.params_spec()])
        job_params = {n: np.array(v.value) for n, v in got.items()}
    finally:
        await j.close()
    model = w0.model
    params = model.init_params(np.random.default_rng(0))
    train, test = builtin_split("digits", model)
    streams = [minibatches(len(train[-1]), 32, np.random.default_rng(1 + k)) for k in range(2)]
    for _ in range(steps):
        grads = [model.loss_and_grads(params, take(train, next(s)))[1] for s in streams]
        for n in params:
            params[n] = params[n] - lr * ((grads[0][n] + grads[1][n]) / 2)
    for n, v in params.items():
        np.testing.assert_allclose(job_params[n], v, rtol=1e-5, atol=1e-6, err_msg=n)
    assert model.accuracy(job_params, test) == pytest.approx(
        model.accuracy(params, test), abs=0.003
    )


async def test_the_chief_packs_a_small_model_and_the_others_follow(make_client: Any) -> None:
    """--pack (the default): the chief stores a small dense model joined in one flat
    variable per shard and records where each parameter lies (`qps var get W1`); a
    worker told --no-pack trains what the chief chose; another model is refused."""
    j = Job(make_client)
    client = await make_client()
    await containers.reset(client, [C])
    try:
        chief = Worker(_cfg(num_workers=3, num_shards=2), await j.session("worker0"))
        await chief.prepare()
        assert isinstance(chief.model, Packed) and chief.model.spec == "packed:2:mlp:64,16,10"
        sess = await j.session("worker1")
        assert sorted(await sess.list_variables()) == ["packed/0", "packed/1"]
        other = Worker(_cfg(index=1, num_workers=3, num_shards=2, pack=False), sess)
        assert not isinstance(other.model, Packed)
        await other.prepare()
        assert other.model.spec == chief.model.spec and other.dense == ["packed/0", "packed/1"]
        got = await sess.pull(["packed/0", "packed/1"])
        params = chief.model.unpack({n: v.value for n, v in got.items()})  # type: ignore[attr-defined]
        view = await packing.read_view(client, C, "W1")
        assert view is not None and view[1] == [("packed/0", 0), ("packed/1", 0)]  # over both
        assert np.array_equal(view[0], params["W1"])
        b2 = await packing.read_view(client, C, "b2")
        assert b2 is not None and np.array_equal(b2[0], params["b2"])
        assert await packing.read_view(client, C, "W9") is None
        wrong = Worker(_cfg(index=2, num_workers=3, model="mlp:64,8,10"), sess)
        with pytest.raises(InvalidArgumentError, match="the job's model is 'packed:2:mlp:64,16"):
            await wrong.prepare()
    finally:
        await j.close()


async def test_a_packed_model_checkpointed_restores_with_its_names_and_resumes(
    make_client: Any, tmp_path: Path
) -> None:
    """docs/quickstart.md: a checkpoint of a packed model keeps the layout, so `qps var
    get b2` reads the restored copy; a chief not told --num-shards resumes the stored
    two parts (it used to pack into one and die on the shapes, leaving a wrong layout)."""
    j = Job(make_client)
    client = await make_client()
    await containers.reset(client, [C, C + "-r"])
    try:
        chief = Worker(_cfg(num_workers=1, num_shards=2), await j.session("worker0"))
        await chief.prepare()
        saved = await checkpoint.save(client, tmp_path / "ck", container=C)
        assert saved.variables == 2
        assert checkpoint.load(tmp_path / "ck").manifest["packed"]["parts"] == [
            ["packed/0", chief.model.layout().parts[0][1]],
            ["packed/1", chief.model.layout().parts[1][1]],
        ]
        await checkpoint.restore(client, tmp_path / "ck", container=C + "-r")
        assert await packing.read_layout(client, C + "-r") == chief.model.layout()
        b2 = await packing.read_view(client, C + "-r", "b2")
        original = await packing.read_view(client, C, "b2")
        assert b2 is not None and original is not None and np.array_equal(b2[0], original[0])

        sess = qps.Session(client=await make_client(), container=C + "-r", worker="worker0")
        await sess.open()
        j.sessions.append(sess)
        resumed = Worker(_cfg(container=C + "-r", num_shards=None), sess)  # not told
        await resumed.prepare()
        assert resumed.model.spec == "packed:2:mlp:64,16,10"
        assert await packing.read_layout(client, C + "-r") == chief.model.layout()
    finally:
        await j.close()


async def test_a_chief_that_cannot_make_the_model_records_no_layout(make_client: Any) -> None:
    """A chief that fails to create the packed parts leaves no layout behind (`qps var
    get b2` would then read parts that are not the model's)."""
    j = Job(make_client)
    client = await make_client()
    await containers.reset(client, [C])
    try:
        sess = await j.session("worker0")
        await sess.variable("packed/1", (3,), np.float32, np.zeros(3, np.float32)).create()
        chief = Worker(_cfg(num_shards=2), sess)
        with pytest.raises(InvalidArgumentError, match="'packed/1' has shape"):
            await chief.prepare()
        assert await packing.read_layout(client, C) is None
    finally:
        await j.close()


async def test_a_container_holding_the_model_unpacked_keeps_it(make_client: Any) -> None:
    """A chief that finds the model's variables stored one per parameter (a job started
    with --no-pack, or before packing was the default) trains those, unpacked."""
    j = Job(make_client)
    client = await make_client()
    await containers.reset(client, [C])
    try:
        first = Worker(_cfg(pack=False), await j.session("worker0"))
        await first.prepare()
        names = ["W1", "W2", "b1", "b2"]
        assert sorted(await first.sess.list_variables()) == names
        again = Worker(_cfg(), await j.session("worker0"))
        assert isinstance(again.model, Packed)
        await again.prepare()
        assert not isinstance(again.model, Packed) and again.dense == ["W1", "b1", "W2", "b2"]
        assert sorted(await again.sess.list_variables()) == names  # nothing packed made
    finally:
        await j.close()
